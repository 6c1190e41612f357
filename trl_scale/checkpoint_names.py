"""A model's weights under its checkpoint's names, the names every loader reads (vLLM's, `from_pretrained`).

Since transformers 5 a model may hold some weights under other names and shapes than its checkpoints: a
mixture-of-experts block keeps its experts fused (`mlp.experts.gate_up_proj` of `[experts, 2 * intermediate, hidden]`)
where the checkpoint has one tensor per expert and projection (`mlp.experts.3.gate_proj.weight`).

- `checkpoint_tensors(model, walk)`: a walk's tensors under checkpoint names, by transformers' own reverse conversion
  (`revert_weight_conversion`, what `save_pretrained` uses), one parameter at a time (a ZeRO-3 walk holds one gathered
  parameter at once). A model without conversions passes through unchanged.
- `checkpoint_views(model)`: the inverse, for a server holding the model (`trl-scale serve`): where each checkpoint
  tensor's elements sit inside the model's parameters.
- `read_checkpoint_shapes(path)`: the tensors a checkpoint directory holds (names and shapes, headers only).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator

import torch

from .logs import get_logger

logger = get_logger(__name__)


def _conversions(model) -> list | None:
    """transformers' weight conversions of `model` (the list `save_pretrained` reverses), or None where it has none."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:  # transformers < 5: models hold their checkpoint's names
        return None
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    return list(conversions) or None


def conversion_model(model):
    """The transformers model whose conversions name the walk's tensors: a PEFT model's base model (TRL's walk yields
    the base model's names), else the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def checkpoint_tensors(model, walk: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`walk`'s (model name, tensor) under the checkpoint's names: each parameter reverted alone (a fused expert
    tensor becomes one tensor per expert and projection), the others as they are."""
    model = conversion_model(model)
    if _conversions(model) is None:
        yield from walk
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in walk:
        yield from revert_weight_conversion(model, {name: tensor}).items()


def read_checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in the safetensors files of the local directory `path` (their headers only), by name;
    None where `path` is no readable directory with safetensors files."""
    if not path or not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with open(os.path.join(path, file), "rb") as handle:
                (size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(size))
            header.pop("__metadata__", None)
            shapes.update({name: tuple(entry["shape"]) for name, entry in header.items()})
    except (OSError, ValueError, KeyError, struct.error) as error:
        logger.warning("could not read the checkpoint's tensor names in %s (%s)", path, error)
        return None
    return shapes


def checkpoint_views(model) -> dict[str, tuple[str, torch.Tensor]]:
    """For a model with conversions: each checkpoint name -> (the model parameter it sits in, the flat indices of
    its elements there). Found by reverting a tensor of indices shaped as the parameter: exact for any conversion
    that moves elements (splits, concatenations, transposes), which is what checkpoints of one model differ by."""
    if _conversions(model) is None:
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    views = {}
    for name, parameter in model.named_parameters():
        positions = torch.arange(parameter.numel()).view(parameter.shape)
        for checkpoint_name, index in revert_weight_conversion(model, {name: positions}).items():
            if checkpoint_name != name:
                views[checkpoint_name] = (name, index)
    return views
