"""`ToolImages` (trainers/tool_images.py): the two mends that let TRL's step take a tool's image on any vision-language
processor. End to end: tests/test_serve_images.py (a streamed tool answering with an image, on the tiny Gemma 3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import ProcessorMixin

from trl_scale.trainers.tool_images import ToolImages
from trl_scale.trainers.trl_facade import TrlFacade


class _Processor(ProcessorMixin):
    def __init__(self):  # no attributes: only its class matters here
        pass


def _trainer(image_token_id=7, found=None, processor=None):
    model = SimpleNamespace(config=SimpleNamespace(image_token_id=image_token_id))
    processor = processor if processor is not None else object.__new__(_Processor)
    return SimpleNamespace(model=model, processing_class=processor, _image_pad_token_id=found)


def _built(arguments: dict):
    """`ToolImages` as a trainer builds it: from the run plan of these constructor arguments."""
    from trl_scale.trainers.plan import RunPlan

    return ToolImages.build(RunPlan.from_arguments("GRPOTrainer", arguments))


def test_built_for_vision_language_runs_with_tools_or_environments_only(tiny_vlm, tiny_llama):
    processor = object.__new__(_Processor)
    assert _built({"tools": [print], "processing_class": processor}) is not None
    assert _built({"environment_factory": object, "model": tiny_vlm}) is not None
    assert _built({"tools": None, "processing_class": processor}) is None
    assert _built({"tools": [print], "model": tiny_llama}) is None  # a text policy


def test_the_policys_image_token_types_a_tools_image_where_trl_found_none():
    trainer = _trainer(image_token_id=7)
    ToolImages().setup(SimpleNamespace(trl=TrlFacade(trainer)))
    assert trainer._image_pad_token_id == 7
    kept = _trainer(image_token_id=7, found=3)  # TRL found one by name: its own stays
    ToolImages().setup(SimpleNamespace(trl=TrlFacade(kept)))
    assert kept._image_pad_token_id == 3
    text = _trainer(image_token_id=7, processor=object())  # a tokenizer: no images at all
    ToolImages().setup(SimpleNamespace(trl=TrlFacade(text)))
    assert text._image_pad_token_id is None


def test_scoring_takes_no_crop_counts_and_refuses_crops():
    seen = []
    proceed = lambda *args, **kwargs: seen.append(kwargs) or "scored"  # noqa: E731
    assert ToolImages().scoring(None, proceed, "model", pixel_values=1, num_crops=torch.zeros(3)) == "scored"
    assert seen == [{"pixel_values": 1}]
    with pytest.raises(ValueError, match="do_pan_and_scan=False"):
        ToolImages().scoring(None, proceed, "model", num_crops=torch.tensor([0, 2]))
