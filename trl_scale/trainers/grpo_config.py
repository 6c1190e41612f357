"""`GRPOConfig`: TRL's `trl.GRPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig as _TRLGRPOConfig


@dataclass
class GRPOConfig(_TRLGRPOConfig):
    r"""
    Configuration class for [`trl_scale.GRPOTrainer`]: every field of [`trl.GRPOConfig`], unchanged, plus the
    trl-scale fields documented below. With every trl-scale feature off, training matches TRL's exactly.
    """
