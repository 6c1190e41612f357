"""`PPOConfig`: GRPO's online configuration plus PPO's critic, KL and GAE fields (TRL <= 1.12 names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .grpo_config import GRPOConfig


@dataclass
class PPOConfig(GRPOConfig):
    r"""
    Configuration class for [`trl_scale.PPOTrainer`]: every field of [`trl_scale.GRPOConfig`] (generation, vLLM,
    rewards, logging, packed scoring) plus the PPO fields below, named as in TRL <= 1.12's `PPOConfig`.

    Mapped onto GRPO's fields as TRL <= 1.12 defined them: one rollout is `per_device_train_batch_size ×
    gradient_accumulation_steps × num_mini_batches` completions per process, split into `num_mini_batches`
    mini-batches of `gradient_accumulation_steps` micro-batches; each mini-batch is one optimizer step, and
    `num_ppo_epochs` passes go over the rollout (`steps_per_generation = num_mini_batches ×
    gradient_accumulation_steps`, `num_iterations = num_ppo_epochs`). Unlike TRL <= 1.12 the mini-batches are not
    reshuffled between epochs. `cliprange` sets `epsilon`. `num_generations` defaults to 1 (PPO needs no group);
    `beta` must stay 0: PPO's KL penalty lives in the reward (`kl_coef`). GRPO loss options PPO does not apply
    (`top_entropy_quantile`, `entropy_coef`, `off_policy_mask_threshold`, `delta`, sequence-level importance
    sampling, `router_aux_loss_coef`, `use_liger_kernel`) are rejected; vLLM importance-sampling correction applies.

    kl_coef (`float`, defaults to `0.05`): weight of the per-token KL penalty against the reference, in the reward.
    kl_estimator (`str`, defaults to `"k1"`): `"k1"` (log-ratio) or `"k3"` (unbiased, non-negative).
    gamma (`float`, defaults to `1.0`) and lam (`float`, defaults to `0.95`): GAE discount and lambda.
    cliprange (`float`, defaults to `0.2`): policy ratio clip.
    cliprange_value (`float`, defaults to `0.2`): value clip around the rollout's values.
    vf_coef (`float`, defaults to `0.1`): weight of the value loss (the critic has its own optimizer).
    num_ppo_epochs (`int`, defaults to `4`), num_mini_batches (`int`, defaults to `1`).
    whiten_rewards (`bool`, defaults to `False`): whiten the per-token rewards before GAE.
    missing_eos_penalty (`float` or `None`): subtracted from the score of completions that end without EOS.
    value_learning_rate (`float` or `None`): the critic's learning rate; `None` uses `learning_rate`.
    loss_type (`str`, defaults to `"dapo"`): how the policy and value losses average over tokens, with GRPO's names.
        `"dapo"` (default, as GRPO's): every completion token of an optimizer step weighs the same, whichever
        process and micro-batch holds it (the sum over tokens divided by the generation batch's token count, TRL's
        `num_items_in_batch`), so a run does not depend on the number of processes or accumulation steps.
        `"bnpo"`: TRL <= 1.12's PPO, a token mean per micro-batch on each process, averaged over processes and
        accumulation steps; equal to `"dapo"` only when every micro-batch holds as many completion tokens.
    """

    kl_coef: float = field(default=0.05, metadata={"help": "Weight of the per-token KL penalty in the reward."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator: 'k1' or 'k3'."})
    gamma: float = field(default=1.0, metadata={"help": "GAE discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the policy ratio."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value around rollout values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    num_mini_batches: int = field(default=1, metadata={"help": "Mini-batches (optimizer steps) per rollout pass."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the per-token rewards before GAE."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of completions without an EOS token."}
    )
    value_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the critic; None uses learning_rate."}
    )
    num_generations: int | None = field(default=1, metadata={"help": "Completions per prompt (PPO needs one)."})

    def __post_init__(self):
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: use 'k1' or 'k3'")
        if self.num_ppo_epochs < 1 or self.num_mini_batches < 1:
            raise ValueError("num_ppo_epochs and num_mini_batches must be at least 1")
        if self.beta not in (0, 0.0):
            raise ValueError(f"beta={self.beta}: PPO puts the KL penalty in the reward; set kl_coef instead, beta=0")
        self._reject_unsupported_grpo_options()
        self.num_iterations = self.num_ppo_epochs
        # A mini-batch is GA micro-batches (one optimizer step): without the factor, GA > 1 would make every
        # "epoch" the same micro-batch accumulated GA times (ratio 1, clipping never acting).
        self.steps_per_generation = self.num_mini_batches * self.gradient_accumulation_steps
        self.epsilon = self.cliprange
        if self.loss_type not in ("dapo", "bnpo"):
            raise ValueError(
                f"loss_type={self.loss_type!r}: PPOTrainer's losses are token means, 'dapo' (over the whole batch, "
                "the default) or 'bnpo' (per micro-batch, TRL <= 1.12's PPO). Fix: loss_type='dapo' or 'bnpo'"
            )
        num_generations = self.num_generations
        if num_generations == 1:
            # GRPOConfig insists on >= 2 generations (it normalises within groups); PPO does not use groups. Check
            # GRPO's batch rules with the local generation batch, which divides the global one.
            local = self.per_device_train_batch_size * self.steps_per_generation
            if local < 2:
                raise ValueError(
                    "per_device_train_batch_size * gradient_accumulation_steps * num_mini_batches (the rollout per "
                    "process) must be at least 2 with num_generations=1"
                )
            self.num_generations = local
        try:
            super().__post_init__()
        finally:
            self.num_generations = num_generations

    def _reject_unsupported_grpo_options(self) -> None:
        """GRPO loss options PPO's loss does not apply: an error naming each, never a silently ignored field.
        (`vllm_importance_sampling_correction` is applied; `mask_truncated_completions` acts on the rollout.)"""
        unsupported = {
            "top_entropy_quantile": (self.top_entropy_quantile, 1.0),
            "entropy_coef": (self.entropy_coef, 0.0),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold, None),
            "delta": (self.delta, None),
            "importance_sampling_level": (self.importance_sampling_level, "token"),
            "router_aux_loss_coef": (self.router_aux_loss_coef, None),
            "use_liger_kernel": (self.use_liger_kernel, False),
        }
        set_fields = [f"{name}={value!r}" for name, (value, default) in unsupported.items() if value != default]
        if set_fields:
            raise ValueError(
                f"PPOTrainer does not apply {', '.join(set_fields)} (GRPO loss options; PPO's loss is the clipped "
                "surrogate with a critic). Fix: leave them at their defaults, or use GRPOTrainer for them"
            )
