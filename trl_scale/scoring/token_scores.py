"""A backbone's per-token scalar outputs (a critic's values), scored as the policy is: packed rows, tree rows, images
packed, sharded over a sequence-parallel group (the engine's `_forward_pieces`), else one padded forward."""

from __future__ import annotations

import dataclasses

import torch

from .engine import _forward_pieces, _sharding
from .image_packing import image_pieces, packs_images
from .packing import unpack
from .sequence_parallel import SequenceParallelGroup, summed_over_group
from .settings import ScoringSettings
from .support import use_packing


def token_scores(
    backbone,
    head,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: ScoringSettings | None = None,
    multimodal_inputs: dict | None = None,
    sequence_parallel: SequenceParallelGroup | None = None,
    **fields,
) -> torch.Tensor:
    """Per-token scalar outputs ``head(hidden)`` of a backbone, as ``[B, T]`` (0 at padding): a critic's values.

    Scored as ``settings`` say (or a `ScoringSettings` of ``fields``, e.g. ``tree_packing=False``): where packing is
    on and exact for this backbone (:func:`.support.use_packing`), the real tokens go through it packed (tree rows
    as ``tree_packing`` says), in micro-batches of at most ``token_budget`` tokens, the same way the policy is
    scored; otherwise one padded forward. ``multimodal_inputs`` (``pixel_values``, ``token_type_ids``, ...) go
    packed where the policy's calls with images would (:mod:`.image_packing`), else to that padded forward.
    """
    settings = dataclasses.replace(settings or ScoringSettings(), **fields)
    batch_size, seq_len = input_ids.shape
    sp = _sharding(sequence_parallel)
    if sp is not None and multimodal_inputs:
        raise ValueError("sequence parallelism scores token rows only: no image inputs. Fix: sp_size=1")
    if sp is None and packs_images(backbone, multimodal_inputs, settings.padding_free):
        pieces = image_pieces(backbone, input_ids, attention_mask, multimodal_inputs)
        flat = torch.cat([head(hidden).squeeze(-1).float() for _, hidden in pieces])
        return unpack(flat, torch.cat([index for index, _ in pieces]), batch_size, seq_len)
    padded = sp is None and (
        multimodal_inputs or not use_packing(backbone, settings.padding_free, probe_now=True, width=seq_len)
    )
    if padded:
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **(multimodal_inputs or {})
        ).last_hidden_state
        return head(hidden).squeeze(-1).float() * attention_mask
    pieces, anchor, _ = _forward_pieces(backbone, input_ids, attention_mask, settings, sp)
    values = [head(hidden).squeeze(-1).float() for _, hidden in pieces]
    indices = [flat_index for flat_index, _ in pieces]
    flat = torch.cat(values) if values else input_ids.new_zeros(0, dtype=torch.float32)
    scores = unpack(flat, torch.cat(indices) if indices else input_ids.new_zeros(0), batch_size, seq_len)
    scores = scores if anchor is None else scores + anchor
    return scores if sp is None else summed_over_group(scores, sp)
