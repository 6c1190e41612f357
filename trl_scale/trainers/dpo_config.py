"""`DPOConfig`: TRL's `trl.DPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig as _TRLDPOConfig


@dataclass
class DPOConfig(_TRLDPOConfig):
    r"""
    Configuration class for [`trl_scale.DPOTrainer`]: every field of [`trl.DPOConfig`], unchanged, plus the
    trl-scale fields documented below. With every trl-scale feature off, training matches TRL's exactly.
    """
