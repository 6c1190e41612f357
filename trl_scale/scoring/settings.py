"""What the scoring engine is told and what it counts: the settings built once from a trainer's config
(`ScoringSettings`), one model's packed-forward configuration (`PackedScoringConfig`) and its live figures
(`PackingStats`). Kept apart from the engine (`engine.py`) so the trainers, the critic and the Ray roles read the
settings without the engine's forward code."""

from __future__ import annotations

from dataclasses import dataclass, field

from .logprob_head import DEFAULT_LOGPROB_CHUNK_SIZE
from .sampler_support import SamplerSupport
from .sequence_parallel import SequenceParallelGroup


@dataclass
class PackingStats:
    """Counts since the last :meth:`pop`, for logging."""

    padded_tokens: int = 0
    real_tokens: int = 0
    forwarded_tokens: int = 0
    micro_batches: int = 0
    calls: int = 0
    fallbacks: int = 0
    tokens_per_micro_batch: list[int] = field(default_factory=list)

    def pop(self) -> dict[str, float]:
        if not self.calls:
            return {}
        logs = {
            "padding_free/pad_fraction_removed": 1.0 - self.real_tokens / max(1, self.padded_tokens),
            "padding_free/tokens_per_micro_batch": sum(self.tokens_per_micro_batch)
            / max(1, len(self.tokens_per_micro_batch)),
            "padding_free/micro_batches_per_call": self.micro_batches / self.calls,
            # Filler at the end of packed rows (dense kernels): the compute packing still spends on non-tokens.
            "padding_free/row_fill": self.real_tokens / max(1, self.forwarded_tokens),
        }
        self.__init__()
        return logs


@dataclass(frozen=True)
class ScoringSettings:
    """How a model's tokens are scored, built once from a trainer's config (`from_config`) and handed to the
    policy, the reference and the critic, in the trainer or on a Ray group (it pickles)."""

    padding_free: bool | None = None
    token_budget: int | None = None
    logprob_chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE
    temperature: float = 1.0
    cast_lm_head_to_fp32: bool = False
    sampler_support: SamplerSupport | None = None  # log-probs on the sampler's support (see `sampler_support`)

    @classmethod
    def from_config(cls, args, temperature: float = 1.0) -> ScoringSettings:
        """From a trl-scale config (`ScoringArguments` fields; GRPO's `cast_lm_head_to_fp32` where it has one; an
        online trainer's sampling truncation where `logprobs_on_sampler_support` asks for it)."""
        return cls(
            padding_free=args.padding_free,
            token_budget=args.token_budget,
            logprob_chunk_size=args.logprob_chunk_size,
            temperature=temperature,
            cast_lm_head_to_fp32=getattr(args, "cast_lm_head_to_fp32", False),
            sampler_support=SamplerSupport.from_config(args),
        )


@dataclass
class PackedScoringConfig:
    """What one model's packed forward uses: the scoring settings, the extra outputs asked for, and the live
    figures it collects."""

    settings: ScoringSettings
    outputs: tuple[str, ...] = ()
    stats: PackingStats = field(default_factory=PackingStats)
    sequence_parallel: SequenceParallelGroup | None = None  # Ulysses: every rank of the group scores a slice
