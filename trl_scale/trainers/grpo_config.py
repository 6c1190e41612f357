"""`GRPOConfig`: TRL's `trl.GRPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig as _TRLGRPOConfig

from ..distributed.arguments import DistributedArguments
from ..evaluation import EvaluationArguments
from ..fleet.arguments import ManagedServerArguments
from ..mismatch import MismatchArguments
from ..rollout.arguments import RolloutArguments
from ..rollout.dynamic_sampling import DynamicSamplingArguments
from ..scoring.arguments import ScoringArguments
from ..timeline import TimelineArguments
from .construction import config_docstring


@dataclass
class GRPOConfig(
    TimelineArguments,
    EvaluationArguments,
    DistributedArguments,
    ManagedServerArguments,
    MismatchArguments,
    RolloutArguments,
    DynamicSamplingArguments,
    ScoringArguments,
    _TRLGRPOConfig,
):
    __doc__ = config_docstring(
        "GRPO",
        ScoringArguments,
        RolloutArguments,
        ManagedServerArguments,
        MismatchArguments,
        DynamicSamplingArguments,
        DistributedArguments,
        EvaluationArguments,
        TimelineArguments,
    )
