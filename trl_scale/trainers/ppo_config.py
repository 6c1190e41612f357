"""`PPOConfig`: GRPO's online configuration plus PPO's critic, KL and GAE fields (TRL <= 1.12 names)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..numbers import check_field_types, check_whole
from .grpo_config import GRPOConfig

# Every field TRL 1.16's GRPOConfig adds to TrainingArguments, as PPO treats it. PPO refuses a field it does not
# apply when it is set; a field TRL adds later (in neither list) is refused too when set, and tests/test_seams.py
# fails until it is classified here: a new GRPO option is refused or handled, never silently ignored.
GRPO_FIELDS_PPO_REFUSES = {
    "top_entropy_quantile": "GRPO's entropy-quantile token mask",
    "entropy_coef": "GRPO's entropy bonus",
    "use_adaptive_entropy": "GRPO's adaptive entropy bonus",
    "off_policy_mask_threshold": "GRPO's off-policy sequence mask",
    "delta": "GRPO's two-sided clipping",
    "importance_sampling_level": "sequence-level importance ratios",
    "router_aux_loss_coef": "the MoE router's auxiliary loss",
    "scale_rewards": "GRPO's group scaling of advantages (PPO whitens GAE advantages)",
    "multi_objective_aggregation": "GRPO's aggregation of several rewards into advantages (PPO sums weighted scores)",
    "use_bias_correction_kl": "GRPO's KL term in the loss (PPO's KL is in the reward: kl_coef)",
}
GRPO_FIELDS_PPO_APPLIES = frozenset(
    {
        # generation (transformers, vLLM, servers) and sampling
        "cache_implementation", "chat_template_kwargs", "ds3_gather_for_generation", "generation_batch_size",
        "generation_kwargs", "max_completion_length", "max_tool_calling_iterations", "min_p", "num_generations",
        "num_generations_eval", "repetition_penalty", "temperature", "top_k", "top_p",
        "transformers_continuous_batching_config", "use_transformers_continuous_batching", "use_transformers_paged",
        "use_vllm", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_group_port",
        "vllm_max_model_length", "vllm_mode", "vllm_model_impl", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_structured_outputs_regex", "vllm_tensor_parallel_size",
        "pad_to_multiple_of", "mask_truncated_completions",
        # importance sampling against the sampler (applied to PPO's per-token loss as GRPO applies it)
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_cap",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        # the model, the reference and the data
        "model_init_kwargs", "trust_remote_code", "cast_lm_head_to_fp32", "disable_dropout", "shuffle_dataset",
        "reward_weights", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
        # the loss: PPO's own meaning (beta must be 0, loss_type 'dapo'/'bnpo', epsilon from cliprange,
        # steps_per_generation and num_iterations from num_mini_batches/num_ppo_epochs: checked apart)
        "beta", "loss_type", "epsilon", "epsilon_high", "steps_per_generation", "num_iterations",
        # inert unless an option refused above (or a loss_type PPO refuses) is on
        "entropy_coef_delta", "entropy_coef_max", "entropy_coef_min", "entropy_target", "sapo_temperature_neg",
        "sapo_temperature_pos", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg", "vespo_lambda_pos",
        # logging
        "log_completions", "log_completions_hub_repo", "log_multimodal", "log_unique_prompts",
        "num_completions_to_print",
    }
)  # fmt: skip


def grpo_own_fields() -> list:
    """The fields the installed TRL's GRPOConfig adds to transformers' TrainingArguments."""
    from transformers import TrainingArguments
    from trl import GRPOConfig as TRLGRPOConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return [f for f in dataclasses.fields(TRLGRPOConfig) if f.name not in base]


def _default_of(field_: dataclasses.Field):
    if field_.default is not dataclasses.MISSING:
        return field_.default
    return field_.default_factory() if field_.default_factory is not dataclasses.MISSING else dataclasses.MISSING


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
    kl_estimator: Literal["k1", "k3"] = field(default="k1", metadata={"help": "KL estimator: 'k1' or 'k3'."})
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
        check_field_types(self, PPOConfig)
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator={self.kl_estimator!r}: use 'k1' or 'k3'")
        check_whole("num_ppo_epochs", self.num_ppo_epochs, minimum=1)
        check_whole("num_mini_batches", self.num_mini_batches, minimum=1)
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
        # An evaluation samples as training does (TRL's default), not the batch-sized group GRPO's checks get below.
        self.num_generations_eval = self.num_generations_eval or num_generations
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
        """GRPO options PPO's loss does not apply, or does not know (added to TRL after 1.16), when set: an error
        naming each, never a silently ignored field. The list is TRL's config itself (`grpo_own_fields`), each field
        classified above; `use_liger_kernel` (a TrainingArguments field) is GRPO's fused loss, refused too."""
        refused, unknown = [], []
        for field_ in grpo_own_fields():
            value, default = getattr(self, field_.name), _default_of(field_)
            if value == default or field_.name in GRPO_FIELDS_PPO_APPLIES:
                continue
            if field_.name in GRPO_FIELDS_PPO_REFUSES:
                refused.append(f"{field_.name}={value!r} ({GRPO_FIELDS_PPO_REFUSES[field_.name]})")
            else:
                unknown.append(f"{field_.name}={value!r}")
        if self.use_liger_kernel:
            refused.append("use_liger_kernel=True (GRPO's fused Liger loss)")
        derived = {
            "steps_per_generation": (None, self.num_mini_batches * self.gradient_accumulation_steps,
                                     "num_mini_batches × gradient_accumulation_steps"),
            "num_iterations": (1, self.num_ppo_epochs, "num_ppo_epochs"),
            "epsilon": (0.2, self.cliprange, "cliprange"),
        }  # fmt: skip
        for name, (default, value, source) in derived.items():
            if getattr(self, name) not in (default, value):
                refused.append(f"{name}={getattr(self, name)!r} (PPO sets it from {source}: set that instead)")
        if refused:
            raise ValueError(
                f"PPOTrainer does not apply {', '.join(refused)}. Fix: leave them at their defaults, or use "
                "GRPOTrainer for them"
            )
        if unknown:
            raise ValueError(
                f"PPOTrainer does not know {', '.join(unknown)}: GRPO options of a TRL newer than trl-scale "
                "classifies (trainers/ppo_config.py). Fix: leave them at their defaults, or use GRPOTrainer"
            )
