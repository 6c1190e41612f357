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
    tree_calls: int = 0  # calls forwarded as tree rows
    tree_row_tokens: int = 0  # their tokens as rows (before sharing)
    tree_tokens: int = 0  # their tokens forwarded (after sharing)
    image_calls: int = 0  # calls with images, scored by the chunked head
    packed_image_calls: int = 0  # of them, those run packed (`image_packing`); the others run padded

    def record(self, padded_tokens: int, figures: dict[str, int]) -> None:
        """One packed call's figures (the engine's `_forward_pieces`)."""
        self.padded_tokens += padded_tokens
        self.real_tokens += figures["real"]
        self.forwarded_tokens += figures["forwarded"]
        self.micro_batches += figures["micro_batches"]
        self.calls += 1
        self.tokens_per_micro_batch += figures["sizes"]  # tokens forwarded per micro-batch (trees: unique tokens)
        if "tree_tokens" in figures:
            self.tree_calls += 1
            self.tree_row_tokens += figures["real"]
            self.tree_tokens += figures["tree_tokens"]

    def pop(self) -> dict[str, float]:
        logs = {}
        if self.image_calls:
            logs["chunked_head/image_calls"] = float(self.image_calls)
            logs["padding_free/image_calls_packed"] = self.packed_image_calls / self.image_calls
        if not self.calls:
            self.__init__()
            return logs
        logs |= {
            "padding_free/pad_fraction_removed": 1.0 - self.real_tokens / max(1, self.padded_tokens),
            "padding_free/tokens_per_micro_batch": sum(self.tokens_per_micro_batch)
            / max(1, len(self.tokens_per_micro_batch)),
            "padding_free/micro_batches_per_call": self.micro_batches / self.calls,
        }
        if self.calls > self.tree_calls:  # filler at the end of packed rows (dense kernels): compute on non-tokens
            rows_forwarded = self.forwarded_tokens - self.tree_tokens
            logs["padding_free/row_fill"] = (self.real_tokens - self.tree_row_tokens) / max(1, rows_forwarded)
        logs["tree_packing/fraction_of_calls"] = self.tree_calls / self.calls
        if self.tree_calls:  # tokens per tree-packed call, before and after sharing prefixes
            logs["tree_packing/tokens_before"] = self.tree_row_tokens / self.tree_calls
            logs["tree_packing/tokens_after"] = self.tree_tokens / self.tree_calls
            logs["tree_packing/share_ratio"] = self.tree_row_tokens / max(1, self.tree_tokens)
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
    tree_packing: bool | str = "auto"  # rows sharing a prefix forwarded as one trie (see `tree_forward`)

    @classmethod
    def from_config(
        cls,
        args,
        temperature: float = 1.0,
        sampler_support: SamplerSupport | None = None,
        cast_lm_head_to_fp32: bool = False,
    ) -> ScoringSettings:
        """From a trl-scale config (`ScoringArguments` fields), with what the run plan resolved for the family:
        GRPO's `cast_lm_head_to_fp32`, an online trainer's sampling truncation where `logprobs_on_sampler_support`
        asks for it (`trainers.plan.ScoringPlan`)."""
        return cls(
            padding_free=args.padding_free,
            token_budget=args.token_budget,
            logprob_chunk_size=args.logprob_chunk_size,
            temperature=temperature,
            cast_lm_head_to_fp32=cast_lm_head_to_fp32,
            sampler_support=sampler_support,
            tree_packing=args.tree_packing,
        )


@dataclass
class PackedScoringConfig:
    """What one model's packed forward uses: the scoring settings, the extra outputs asked for, and the live
    figures it collects."""

    settings: ScoringSettings
    outputs: tuple[str, ...] = ()
    stats: PackingStats = field(default_factory=PackingStats)
    sequence_parallel: SequenceParallelGroup | None = None  # Ulysses: every rank of the group scores a slice
