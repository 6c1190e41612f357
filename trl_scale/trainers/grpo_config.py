"""`GRPOConfig`: TRL's `trl.GRPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig as _TRLGRPOConfig

from .common import DistributedArguments, RolloutArguments, ScoringArguments, config_docstring


@dataclass
class GRPOConfig(DistributedArguments, RolloutArguments, ScoringArguments, _TRLGRPOConfig):
    __doc__ = config_docstring("GRPO", ScoringArguments, RolloutArguments, DistributedArguments)
