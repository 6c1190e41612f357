"""`RLOOConfig`: TRL's `trl.RLOOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trl import RLOOConfig as _TRLRLOOConfig

from ..distributed.arguments import DistributedArguments
from ..evaluation import EvaluationArguments
from ..fleet.arguments import ManagedServerArguments
from ..mismatch import MismatchArguments
from ..numbers import check_field_types
from ..rollout.arguments import RolloutArguments
from ..rollout.dynamic_sampling import DynamicSamplingArguments
from ..scoring.arguments import ScoringArguments
from ..timeline import TimelineArguments
from .construction import config_docstring


@dataclass
class RLOOCorrectionArguments:
    """RLOO's vLLM importance-sampling correction (TRL's RLOO has none): GRPO's fields, sequence modes only."""

    FIELDS_DOC = """
    > Off-policy correction (RLOO with `async_rollout_staleness ≥ 1`)

    vllm_importance_sampling_correction (`bool`, defaults to `True`), vllm_importance_sampling_mode (`str`, defaults
    to `"sequence_mask"`), vllm_importance_sampling_clip_min (`float` or `None`), vllm_importance_sampling_clip_max
    (`float`, defaults to `3.0`): GRPO's fields and rules, per sequence (RLOO's loss is per sequence). TRL's RLOO
    scores its old log-probs with the weights current at scoring time, the sampler's only when generation is
    synchronous; with prefetched completions each sequence's loss is weighted by `exp(sum(old - sampling))`,
    truncated (`"sequence_truncate"`) or zeroed outside the bounds (`"sequence_mask"`), from the servers' log-probs
    of the sampled tokens. A synchronous run (staleness 0) is TRL's, unchanged.
"""

    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={"help": "RLOO with async rollout: weight each sequence's loss by old / sampler probability."},
    )
    vllm_importance_sampling_mode: Literal["sequence_mask", "sequence_truncate"] = field(
        default="sequence_mask",
        metadata={"help": "'sequence_mask' (weights outside the bounds set to 0) or 'sequence_truncate' (clamped)."},
    )
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "Lower bound."})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "Upper bound."})

    @property
    def corrects_sampler_logprobs(self) -> bool:
        """The servers' log-probs feed this run's correction: only prefetched (stale) completions are corrected."""
        return bool(self.vllm_importance_sampling_correction and getattr(self, "async_rollout_staleness", 0))

    @property
    def sampler_logprobs_corrected(self) -> bool:
        return self.corrects_sampler_logprobs

    def __post_init__(self):
        super().__post_init__()
        check_field_types(self, RLOOCorrectionArguments)
        if self.vllm_importance_sampling_mode not in ("sequence_mask", "sequence_truncate"):
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r}: RLOO's loss is per sequence. "
                "Fix: 'sequence_mask' or 'sequence_truncate'"
            )


@dataclass
class RLOOConfig(
    TimelineArguments,
    EvaluationArguments,
    RLOOCorrectionArguments,
    DistributedArguments,
    ManagedServerArguments,
    MismatchArguments,
    RolloutArguments,
    DynamicSamplingArguments,
    ScoringArguments,
    _TRLRLOOConfig,
):
    __doc__ = config_docstring(
        "RLOO",
        ScoringArguments,
        RolloutArguments,
        ManagedServerArguments,
        MismatchArguments,
        DynamicSamplingArguments,
        RLOOCorrectionArguments,
        DistributedArguments,
        EvaluationArguments,
    )
