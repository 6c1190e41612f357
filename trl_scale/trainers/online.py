"""`OnlineTrainerMixin`: everything trl-scale adds to TRL's online trainers (GRPO, RLOO, and PPO through GRPO),
wired around TRL's constructor."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import torch

from ..distributed.role_workers import ReferenceWorkerSettings
from ..distributed.roles import RayReference, start_reference
from ..logs import get_logger
from ..scoring import ScoringSettings
from .checkpoints import RolloutResumeMixin, SafeCheckpointMixin
from .construction import (
    check_model_arguments,
    check_output_dir,
    check_train_dataset,
    image_columns,
    overridden,
    remote_reward_funcs,
    trl_arguments,
    trl_base_class,
    uses_server_rollout,
    wants_remote_reference,
)
from .dynamic_sampling import DynamicSamplingMixin
from .hub import ModelCardMixin
from .reward_checks import checked_reward_funcs
from .wiring import PackedScoringMixin, PhaseTimingMixin, ServerRolloutMixin

logger = get_logger(__name__)

# TRL 1.16 reads `model.is_gradient_checkpointing`, which transformers 5.17 deprecates: a FutureWarning on every run
# that no user setting causes or silences (stock TRL prints it too).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def colocated(trainer, config):
    """TRL's colocate mode (vLLM in the trainer): TRL's constructor builds trl-scale's `ColocatedVLLMGeneration`."""
    if config is None or not (config.use_vllm and config.vllm_mode == "colocate"):
        return nullcontext()
    from ..rollout.colocate import colocated_generation

    return colocated_generation(trl_base_class(trainer).__module__, config.vllm_llm_kwargs)


class OnlineTrainerMixin(
    SafeCheckpointMixin,
    RolloutResumeMixin,
    ServerRolloutMixin,
    DynamicSamplingMixin,
    PhaseTimingMixin,
    ModelCardMixin,
    PackedScoringMixin,
):
    """Everything trl-scale adds to TRL's online trainers (GRPO, RLOO, and PPO through GRPO), wired around TRL's
    constructor: remote reward models, server rollout, packed scoring, timing and model cards."""

    def _calculate_rewards(self, *args, **kwargs):
        rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        if not getattr(self, "_warned_no_rewards", False) and torch.isnan(rewards_per_func).all():
            # TRL trains on it with zero advantages and logs the reward as nan: a run that learns nothing, silently.
            self._warned_no_rewards = True
            if self.accelerator.is_main_process:
                logger.warning(
                    f"trl-scale: every reward function ({', '.join(self.reward_func_names)}) returned None or NaN for "
                    f"all {rewards_per_func.size(0)} completions of this batch: there is nothing to learn from (zero "
                    "advantages, no gradient), and the step trains on nothing. Fix: make at least one reward function "
                    "return a float for these completions (None means 'does not apply to this one'). Said once."
                )
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        with self._data_parallel_gathers():
            batch = super()._generate_and_score_completions(inputs)
        self._log_raw_importance_ratios(batch)
        return batch

    def _log_raw_importance_ratios(self, batch: dict) -> None:
        """The correction's ratios before TRL clips them (`sampling/importance_sampling_ratio_raw/*`), the share
        clipped, and the share of completions generated across a weight sync (streaming: tokens of two versions)."""
        from ..rollout.correction import raw_ratio_statistics, record_ratio_statistics

        if "importance_sampling_ratio" not in batch or "sampling_per_token_logps" not in batch:
            return
        mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
        stats = raw_ratio_statistics(
            batch["old_per_token_logps"],
            batch["sampling_per_token_logps"],
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        metrics = self._metrics["train" if self.model.training else "eval"]
        record_ratio_statistics(metrics, self.accelerator.gather, stats)
        spans = getattr(getattr(self, "vllm_generation", None), "last_version_spans", None)
        if spans:
            spanning = torch.tensor(sum(first != newest for first, newest in spans) / len(spans), device=mask.device)
            metrics["rollout/completions_overlapping_a_sync"].append(self.accelerator.gather(spanning).mean().item())

    def __init__(self, *args, **kwargs):
        arguments = trl_arguments(self, args, kwargs)
        model, config = arguments["model"], arguments.get("args")
        check_output_dir(config)
        check_model_arguments(arguments)
        # TRL reads `prompt` unless an environment owns the data (its `reset()` then supplies the prompt).
        prompt_column = () if arguments.get("environment_factory") is not None else ("prompt",)
        check_train_dataset(arguments.get("train_dataset"), prompt_column, type(self).__name__)
        if config is not None and getattr(config, "weight_sync", None) == "lora" and uses_server_rollout(config):
            from accelerate.utils import is_peft_model

            if arguments.get("peft_config") is None and not (not isinstance(model, str) and is_peft_model(model)):
                raise ValueError(
                    "weight_sync='lora' sends only a LoRA adapter to the servers, but this policy has none. Fix: pass "
                    "peft_config=LoraConfig(...) (or a PeftModel), or use weight_sync='nccl' / 'shared_dir' (full "
                    "weights)"
                )
        reward_funcs = remote_reward_funcs(arguments.get("reward_funcs"), config)
        arguments["reward_funcs"] = checked_reward_funcs(reward_funcs)
        server = config is not None and uses_server_rollout(config)
        remote_reference = wants_remote_reference(config, model, arguments.get("peft_config"))
        images = image_columns(arguments.get("train_dataset"), arguments.get("eval_dataset"))
        if remote_reference and images:
            raise ValueError(
                f"this dataset has image columns {images}, and reference_placement puts the reference model on a Ray "
                "group that scores token rows only: its KL would ignore the images. Fix: reference_placement=None "
                "(the reference stays in the trainer and gets the images, as in TRL)"
            )
        # With server rollout, TRL's vLLM path stays off while it builds: no vLLM import, no CUDA-only communicator.
        # With a remote reference, TRL builds none (beta=0 while it builds) and the reference group stands in.
        with (
            overridden(config if server else None, use_vllm=False),
            overridden(config if remote_reference else None, beta=0.0),
            colocated(self, config),
        ):
            super().__init__(**arguments)
        self._check_completion_length()
        self._check_dynamic_sampling()
        if server:
            self._install_server_rollout(logprobs=True)
        self._install_packed_scoring(self.temperature, ("entropy",), self.args.padding_free)
        if remote_reference:
            self.beta = config.beta
            self.ref_model = self._start_remote_reference()

    # ---- lengths the model can take -----------------------------------------------------------------------

    def _context_length(self) -> int | None:
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        return getattr(config, "max_position_embeddings", None)

    def _check_completion_length(self) -> None:
        context = self._context_length()
        if context is not None and self.args.max_completion_length >= context:
            raise ValueError(
                f"max_completion_length={self.args.max_completion_length} leaves no room for a prompt in this model's "
                f"context of {context} tokens (max_position_embeddings). Fix: lower max_completion_length"
            )

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then a check that every prompt plus `max_completion_length` fits the model's context:
        past it, positions the model never learned (or an index error, with learned positions) would train
        silently on garbage."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        limits = [(self._context_length(), "the model's context", "max_position_embeddings")]
        served = getattr(getattr(self, "vllm_generation", None), "server_max_model_len", None)
        if served is not None:  # vLLM would answer 400 for the whole batch
            limits.append((served, "the rollout servers' context", "their --max-model-len"))
        limits = [limit for limit in limits if limit[0] is not None]
        if limits:
            context, what, source = min(limits)
            for index, ids in enumerate(prompt_ids):
                if len(ids) + self.args.max_completion_length > context:
                    raise ValueError(
                        f"prompt {index} of this batch has {len(ids)} tokens; with max_completion_length="
                        f"{self.args.max_completion_length} that exceeds {what} of {context} tokens ({source}). "
                        "Nothing was trained on it, and earlier checkpoints are intact. Fix: drop or shorten long "
                        "prompts (dataset.filter on their token count, at most "
                        f"{context - self.args.max_completion_length}), or lower max_completion_length"
                    )
        return (prompt_ids, *rest)

    def _start_remote_reference(self) -> RayReference:
        """The reference on its group, loaded as TRL would load it: from the policy's path, in the policy's dtype
        and attention implementation, scored with the same head (temperature, fp32 cast, packing)."""
        from trl.trainer.utils import get_config_model_id

        args = self.args
        init_kwargs = args.model_init_kwargs or {}
        dtype = init_kwargs.get("dtype", self.model.dtype)
        mixed = {"bf16": "bfloat16", "fp16": "float16"}.get(str(self.accelerator.mixed_precision))
        settings = ReferenceWorkerSettings(
            dtype=str(dtype).removeprefix("torch."),  # "auto" passes through, as TRL passes it
            attn_implementation=init_kwargs.get("attn_implementation", self.model.config._attn_implementation),
            scoring=ScoringSettings.from_config(args, self.temperature),
            autocast_dtype=mixed,
        )
        model_path = get_config_model_id(self.accelerator.unwrap_model(self.model).config)
        return start_reference(model_path, settings, args)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if isinstance(model, RayReference):  # the reference on its Ray group (log-probs only, as TRL asks of it)
            return model.logps(input_ids, attention_mask, logits_to_keep), None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
