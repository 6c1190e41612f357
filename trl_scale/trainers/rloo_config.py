"""`RLOOConfig`: TRL's `trl.RLOOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig as _TRLRLOOConfig


@dataclass
class RLOOConfig(_TRLRLOOConfig):
    r"""
    Configuration class for [`trl_scale.RLOOTrainer`]: every field of [`trl.RLOOConfig`], unchanged, plus the
    trl-scale fields documented below. With every trl-scale feature off, training matches TRL's exactly.
    """
