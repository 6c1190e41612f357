"""Datasets with images, checked before TRL's constructor (`construction.check_image_inputs`, called by the run plan):
a text-only policy, rows without their image, and pan-and-scan crops were each a failure deep in TRL's first step
(KeyError 'pixel_values', TypeError)."""

from __future__ import annotations

import pytest
from datasets import Dataset
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

import trl_scale
from trl_scale.trainers.plan import RunPlan

from .helpers import cpu_args


def _plan(tmp_path, model, processing_class, **datasets):
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=2))
    arguments = {"args": config, "model": model, "processing_class": processing_class, **datasets}
    return RunPlan.from_arguments("GRPOTrainer", arguments)


def _image() -> Image.Image:
    return Image.new("RGB", (16, 16), (200, 10, 10))


def test_an_image_dataset_on_a_text_only_policy_is_refused(tiny_llama, tmp_path):
    data = Dataset.from_dict({"prompt": ["one", "two"], "image": [_image(), _image()]})
    with pytest.raises(ValueError, match=r"image columns \['image'\], but the policy is text-only.*Fix: drop"):
        _plan(tmp_path, tiny_llama, AutoTokenizer.from_pretrained(tiny_llama), train_dataset=data)


@pytest.mark.parametrize("column", ["image", "images"])
def test_rows_without_their_image_are_counted_and_refused(tiny_vlm, tmp_path, column):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    value = [_image(), None, None] if column == "image" else [[_image()], None, None]
    data = Dataset.from_dict({"prompt": ["a", "b", "c"], column: value})
    with pytest.raises(ValueError, match=rf"train_dataset's column '{column}' has 2 row\(s\) without an image"):
        _plan(tmp_path, tiny_vlm, processor, train_dataset=data)
    evaluation = {"held": data}
    good = Dataset.from_dict({"prompt": ["a"], column: [_image()] if column == "image" else [[_image()]]})
    with pytest.raises(ValueError, match=rf"eval_dataset\['held'\]'s column '{column}' has 2 row"):
        _plan(tmp_path, tiny_vlm, processor, train_dataset=good, eval_dataset=evaluation)


def test_complete_image_datasets_and_rows_with_no_images_pass(tiny_vlm, tmp_path):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    _plan(tmp_path, tiny_vlm, processor, train_dataset=Dataset.from_dict({"prompt": ["a"], "image": [_image()]}))
    none_listed = Dataset.from_dict({"prompt": ["a", "b"], "images": [[_image()], []]})  # a row with no images
    _plan(tmp_path, tiny_vlm, processor, train_dataset=none_listed)


def test_pan_and_scan_crops_are_refused_naming_the_setting(tiny_vlm, tmp_path):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    processor.image_processor.do_pan_and_scan = True
    data = Dataset.from_dict({"prompt": ["a"], "image": [_image()]})
    with pytest.raises(ValueError, match=r"do_pan_and_scan=True.*Fix: processor.image_processor.do_pan_and_scan"):
        _plan(tmp_path, tiny_vlm, processor, train_dataset=data)
