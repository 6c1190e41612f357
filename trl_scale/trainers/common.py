"""What every trl-scale trainer shares: its tag, the scoring-engine config fields, and their wiring."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..scoring import PackingStats, install_packed_scoring

TRL_SCALE_TAG = "trl-scale"


@dataclass
class ScoringArguments:
    """Config fields of the packed scoring engine, shared by GRPO, RLOO, DPO (and PPO) configs."""

    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Score only real tokens: pack each scoring batch's sequences into rows with position_ids "
            "restarting per sequence (no attention mask, no KV cache) and project only labelled tokens through "
            "the chunked log-prob head. `False` runs TRL's padded path unchanged, with identical numbers."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens in one packed forward (micro-batch); a batch with more real tokens is split into "
            "several, balanced, and every data-parallel rank runs the same number. A sequence longer than the budget "
            "gets a micro-batch of its own. `None` packs each scoring batch into one row."
        },
    )
    logprob_chunk_size: int = field(
        default=256,
        metadata={
            "help": "Tokens projected onto the vocabulary at once by trl-scale's chunked log-prob head (CPU and "
            "other non-Triton devices); peak head memory is about 2 x chunk x vocab x 4 bytes plus the weight "
            "gradient. On CUDA/XPU with Triton, TRL's own kernel runs with its own tiling."
        },
    )

    def _validate_scoring_arguments(self) -> None:
        if self.token_budget is not None and (not isinstance(self.token_budget, int) or self.token_budget < 1):
            raise ValueError(
                f"token_budget={self.token_budget!r}: use a positive number of tokens, or None for no limit"
            )
        if not isinstance(self.logprob_chunk_size, int) or self.logprob_chunk_size < 1:
            raise ValueError(
                f"logprob_chunk_size={self.logprob_chunk_size!r}: use a positive number of tokens (e.g. 256)"
            )


class PackedScoringMixin:
    """Installs the packed scoring engine on the policy and reference forwards TRL patched, and logs its figures."""

    _packing_stats: PackingStats | None = None

    def _install_packed_scoring(self, temperature: float, policy_outputs: tuple[str, ...]) -> None:
        if not self.args.padding_free:
            return
        from peft import PeftModel

        stats = PackingStats()
        settings = dict(token_budget=self.args.token_budget, logprob_chunk_size=self.args.logprob_chunk_size)
        policy = self.accelerator.unwrap_model(self.model)
        if isinstance(policy, PeftModel):
            policy = policy.get_base_model()
        install_packed_scoring(policy, temperature=temperature, outputs=policy_outputs, stats=stats, **settings)
        if getattr(self, "ref_model", None) is not None:
            ref_model = self.accelerator.unwrap_model(self.ref_model)
            install_packed_scoring(ref_model, temperature=temperature, outputs=(), stats=stats, **settings)
        self._packing_stats = stats

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._packing_stats is not None and "loss" in logs:
            logs.update(self._packing_stats.pop())
        super().log(logs, start_time)
