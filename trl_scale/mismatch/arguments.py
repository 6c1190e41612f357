"""The mismatch gate's config fields, mixed into the GRPO, RLOO and PPO configs (read with server rollout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..numbers import check_field_types, check_positive, check_whole

MismatchAction = Literal["error", "warn", "drop"]
# Nats per token (the sampler-to-policy KL). Measured 2026-11-29 on a tiny Llama with peaked next-token distributions
# (entropy 4.9 nats), fp32 trainer (`tests/test_mismatch_vllm.py`, `benchmarks/mismatch.py`): a vLLM 0.32 CPU server of
# the policy in fp32 gives about 1e-12, the policy in bfloat16 about 1e-3, another revision of the policy about 2.6.
DEFAULT_BUDGET = 0.01


@dataclass(frozen=True)
class MismatchSettings:
    """The gate's settings, read once by the run plan (none on a config without the fields: TRL's own)."""

    budget: float | None = None  # None: no probe
    action: MismatchAction = "error"
    prompts: int = 4

    @classmethod
    def from_config(cls, config) -> MismatchSettings:
        if not isinstance(config, MismatchArguments):
            return cls()
        return cls(config.rollout_mismatch_budget, config.rollout_mismatch_action, config.rollout_mismatch_prompts)


@dataclass
class MismatchArguments:
    """Config fields of the mismatch gate (server rollout: GRPO, RLOO, PPO)."""

    FIELDS_DOC = """
    > Mismatch gate (server rollout)

    rollout_mismatch_budget (`float` or `None`, defaults to `0.01`):
        How far a server's sampler may be from the policy, in nats per token: the KL from the tokens the server
        sampled to the policy, estimated on those tokens (`mean(e^d - 1 - d)`, d = the policy's log-prob minus the
        server's). Before step 1 every server samples completions of the run's first prompts and the trainer scores
        them; a server past the budget is named with its figures and the likely cause (another model or revision,
        another tokenizer or template, another dtype or quantization, a LoRA adapter not loaded). `None`: no probe.
    rollout_mismatch_action (`str`, defaults to `"error"`):
        What a server past the budget does: `"error"` (the run stops before step 1, naming every such server),
        `"warn"` (said once, the run goes on), `"drop"` (the server leaves the fleet, said once; the run stops if
        none is left).
    rollout_mismatch_prompts (`int`, defaults to `4`):
        Prompts of the training set each server samples for the probe (two completions each).
"""  # its section of each config's docstring (`config_docstring`)

    rollout_mismatch_budget: float | None = field(
        default=DEFAULT_BUDGET,
        metadata={
            "help": "Server rollout: the KL per token (nats) a server's sampler may be from the policy, measured on "
            "each server before step 1. None: not measured."
        },
    )
    rollout_mismatch_action: MismatchAction = field(
        default="error",
        metadata={
            "help": "A server past rollout_mismatch_budget: 'error' (stop), 'warn', or 'drop' (leave the fleet)."
        },
    )
    rollout_mismatch_prompts: int = field(
        default=4,
        metadata={"help": "Training prompts each server samples for the mismatch probe (2 completions each)."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_field_types(self, MismatchArguments)
        budget_fix = "a KL in nats per token, e.g. 0.01 (None: no probe)"
        check_positive("rollout_mismatch_budget", self.rollout_mismatch_budget, optional=True, fix=budget_fix)
        check_whole("rollout_mismatch_prompts", self.rollout_mismatch_prompts, minimum=1, fix="e.g. 4")
        if self.rollout_mismatch_action not in ("error", "warn", "drop"):
            raise ValueError(
                f"rollout_mismatch_action={self.rollout_mismatch_action!r}: use 'error', 'warn' or 'drop'"
            )
