"""`DPOConfig`: TRL's `trl.DPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig as _TRLDPOConfig

from .common import ScoringArguments


@dataclass
class DPOConfig(ScoringArguments, _TRLDPOConfig):
    r"""
    Configuration class for [`trl_scale.DPOTrainer`]: every field of [`trl.DPOConfig`], unchanged, plus trl-scale's.

    > Packed scoring (remove-padding + chunked log-prob head)

    padding_free (`bool`, defaults to `True`):
        Score only real tokens, packed into rows with `position_ids` restarting per sequence. `False` runs TRL's
        padded path and gives TRL's numbers exactly.
    token_budget (`int` or `None`, defaults to `None`):
        Most tokens in one packed forward; larger batches are split into balanced micro-batches, the same number on
        every data-parallel rank.
    logprob_chunk_size (`int`, defaults to `256`):
        Tokens projected onto the vocabulary at once by trl-scale's chunked head (non-Triton devices).
    """
