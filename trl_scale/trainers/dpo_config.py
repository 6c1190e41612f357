"""`DPOConfig`: TRL's `trl.DPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import DPOConfig as _TRLDPOConfig

from ..scoring.arguments import ScoringArguments
from .construction import config_docstring


@dataclass
class DPOConfig(ScoringArguments, _TRLDPOConfig):
    __doc__ = config_docstring("DPO", ScoringArguments)
