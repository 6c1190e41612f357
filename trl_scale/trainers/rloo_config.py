"""`RLOOConfig`: TRL's `trl.RLOOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig as _TRLRLOOConfig

from ..distributed.arguments import DistributedArguments
from ..evaluation import EvaluationArguments
from ..rollout.arguments import RLOOCorrectionArguments, RolloutArguments
from ..rollout.dynamic_sampling import DynamicSamplingArguments
from ..scoring.arguments import ScoringArguments
from ..timeline import TimelineArguments
from .construction import config_docstring


@dataclass
class RLOOConfig(
    TimelineArguments,
    EvaluationArguments,
    RLOOCorrectionArguments,
    DistributedArguments,
    RolloutArguments,
    DynamicSamplingArguments,
    ScoringArguments,
    _TRLRLOOConfig,
):
    __doc__ = config_docstring(
        "RLOO",
        ScoringArguments,
        RolloutArguments,
        DynamicSamplingArguments,
        RLOOCorrectionArguments,
        DistributedArguments,
        EvaluationArguments,
    )
