"""The vLLM importance-sampling correction: what TRL's saw before it truncated or masked the ratios, and RLOO's.

TRL logs the ratio after clipping (`sampling/importance_sampling_ratio/*`): a run whose ratios sit far outside the
clip range looks healthy there (huggingface/trl#5231). `raw_ratio_statistics` gives the ratio before it, and the
share of ratios the clip touched, per token (token modes) or per sequence (sequence modes).

TRL's RLOO has no correction: it scores its old log-probs with the weights current at scoring time, which are the
sampler's only when generation is synchronous. `sequence_importance_weights` is RLOO's, per sequence (its loss is
per sequence), TRL's GRPO rule for the `sequence_*` modes."""

from __future__ import annotations

import math

import torch


def raw_ratio_statistics(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> dict[str, torch.Tensor] | None:
    """``{"min", "mean", "max", "clipped"}`` of ``exp(old - sampling)`` over the real tokens (``mask``) or per
    sequence; None when there is nothing to measure. Tokens vLLM could not score (NaN) count as a ratio of 1, as in
    TRL."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    ratios = diff.sum(-1).exp() if mode.startswith("sequence") else diff.exp()[mask.bool()]
    return ratio_statistics(ratios, clip_min, clip_max)


def ratio_statistics(ratios: torch.Tensor, clip_min: float | None, clip_max: float | None) -> dict | None:
    """``{"min", "mean", "max", "clipped"}`` of some ratios (the share outside ``[clip_min, clip_max]``)."""
    if ratios.numel() == 0:
        return None
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    clipped = ((ratios < low) | (ratios > high)).float().mean()
    return {"min": ratios.min(), "mean": ratios.mean(), "max": ratios.max(), "clipped": clipped}


def record_ratio_statistics(metrics: dict, gather, stats: dict | None) -> None:
    """`ratio_statistics`' figures over every process (`gather`: accelerate's), into TRL's metrics lists
    (`sampling/importance_sampling_ratio_raw/{min,mean,max}`, `.../clipped_fraction`); nothing when None."""
    if stats is None:
        return
    prefix = "sampling/importance_sampling_ratio"
    metrics[f"{prefix}_raw/min"].append(gather(stats["min"]).min().item())
    metrics[f"{prefix}_raw/mean"].append(gather(stats["mean"]).mean().item())
    metrics[f"{prefix}_raw/max"].append(gather(stats["max"]).max().item())
    metrics[f"{prefix}/clipped_fraction"].append(gather(stats["clipped"]).mean().item())


def sequence_importance_weights(
    log_ratios: torch.Tensor, mode: str, clip_min: float | None, clip_max: float | None
) -> torch.Tensor:
    """``[B]`` weights ``exp(log_ratios)`` (each sequence's ``sum(old - sampling)`` over its real tokens), truncated
    to ``[clip_min, clip_max]`` (`"sequence_truncate"`) or set to 0 outside it (`"sequence_mask"`), TRL's rules."""
    ratios = log_ratios.exp()
    if mode == "sequence_truncate":
        return ratios.clamp(min=clip_min, max=clip_max)
    if mode == "sequence_mask":
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratios.masked_fill((ratios < low) | (ratios > high), 0.0)
    raise ValueError(
        f"vllm_importance_sampling_mode={mode!r}: RLOO's loss is per sequence; use 'sequence_mask' or "
        "'sequence_truncate'"
    )
