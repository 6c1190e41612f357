"""`PPOTrainer`: PPO with a critic, on TRL 1.16's online machinery.

TRL removed its PPOTrainer in 1.13. This one subclasses trl-scale's `GRPOTrainer`, so generation (transformers
or vLLM), reward functions and models, the reference model (or disabled PEFT adapter), dataset handling, packed
scoring, metrics and `push_to_hub` are TRL's own. It overrides two hooks:

- `_generate_and_score_completions`: after TRL's rollout and scoring, add the critic's values, the KL-shaped
  per-token rewards and GAE, and return per-token advantages, which TRL's batch layout already carries.
- `_compute_loss`: the clipped policy loss on those advantages, and the clipped value loss, stepped on the
  critic's own optimizer and scheduler.
"""

from __future__ import annotations

import inspect
import os
from functools import partial

import torch
from transformers import (
    PreTrainedModel,
)

from .. import ppo_core
from ..critic import CriticBatch, build_critic
from ..critic.holders import (
    CRITIC_DEEPSPEED_DIR,
    CRITIC_OPTIMIZER_NAME,
)
from ..handoff import Handoff
from ..model_paths import check_model_path
from .construction import image_columns, overridden
from .grpo_trainer import GRPOTrainer
from .hub import TRL_SCALE_TAG
from .packing import PackedScoring
from .ppo_config import PPOConfig

VALUE_MODEL_DIR = "value_model"


def _image_input_names() -> tuple[str, ...]:
    """The image inputs TRL's GRPO keeps in a rollout batch and passes to every log-prob forward: the parameters of
    its `_get_per_token_logps_and_entropies` after `compute_aux_loss` (a registered seam), read from TRL itself so a
    TRL that adds one passes it on here too."""

    from trl import GRPOTrainer as TRLGRPOTrainer

    names = list(inspect.signature(TRLGRPOTrainer._get_per_token_logps_and_entropies).parameters)
    return tuple(names[names.index("compute_aux_loss") + 1 :])


# Model inputs, and the row-slicing fields (`critic.base.ROW_SLICING_FIELDS`) that say how to split them by rows.
MULTIMODAL_FIELDS = _image_input_names()


class PPOTrainer(GRPOTrainer):
    """PPO with a value model (critic), GAE and clipped policy and value losses.

    Args:
        model: the policy, a model id/path or a `PreTrainedModel` (as in GRPO).
        reward_funcs: as in GRPO: callables and/or sequence-classification reward models (objects or paths).
        value_model: the critic, a path or a `AutoModelForSequenceClassification` with one label. By default it is
            initialised from the first reward model in `reward_funcs`, else from the policy's backbone with a new
            scalar head. It must share the policy's tokenizer (it reads the policy's token ids). With an image
            dataset (a vision-language policy) it gets the prompts' images, so its backbone must take
            `pixel_values` (a critic built from a Gemma 3 policy does).
        args: a `PPOConfig`.

    Other arguments are GRPO's.
    """

    _tag_names = ["trl", TRL_SCALE_TAG, "ppo"]
    _name = "PPO"

    def __init__(
        self,
        model,
        reward_funcs,
        value_model: str | PreTrainedModel | None = None,
        args: PPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        callbacks=None,
        **kwargs,
    ):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = PPOConfig(f"{name.split('/')[-1]}-PPO")
        if not isinstance(args, PPOConfig):
            raise TypeError(f"PPOTrainer needs a PPOConfig, got {type(args).__name__}")
        check_model_path(value_model, "value_model")
        images = image_columns(train_dataset, eval_dataset)
        reward_list = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
        # GRPO creates a reference model only when beta != 0; PPO needs it for the KL in the reward, not in the loss.
        with overridden(args, beta=args.kl_coef):
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                peft_config=peft_config,
                callbacks=callbacks,
                **kwargs,
            )
        self.beta = 0.0  # the KL goes into the reward, not the loss
        # The critic, local (replicated or sharded as the launcher shards the policy) or on its Ray group.
        built = build_critic(
            args, self.accelerator, self.processing_class, self.model, value_model, model, reward_list, images
        )
        self.critic, self.value_model, self.critic_config = built.critic, built.model, built.config
        sequence_parallel = self.features.get(PackedScoring).sequence_parallel
        if sequence_parallel is not None:
            self._shard_critic_sequences(sequence_parallel)
        self._critic_update = Handoff("PPOTrainer's pending critic update (from _compute_loss)")

    def _shard_critic_sequences(self, sequence_parallel) -> None:
        """Sequence parallelism: the critic's values through the sharded engine too (a critic in the trainer's
        processes, held as the launcher holds the policy; its gradients are averaged over them as the policy's)."""
        from ..critic.updater import CriticUpdater
        from ..scoring.sequence_parallel import enable_sequence_parallel

        sp_size = sequence_parallel.size
        if not isinstance(self.critic, CriticUpdater):
            raise ValueError(
                f"sequence_parallel_size={sp_size} shards the critic's rows in the trainer's processes; this "
                "critic is on a Ray group, which scores whole rows. Fix: critic_placement=None (the critic in the "
                "trainer), or sequence_parallel_size=1"
            )
        enable_sequence_parallel(self.value_model, sp_size)
        self.critic.holder.module.sequence_parallel = sequence_parallel

    def card_features(self) -> list[str]:
        return [*super().card_features(), "value-model"]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self.critic.scheduler is None:
            self.critic.set_scheduler(
                self.args.lr_scheduler_type,
                self.args.get_warmup_steps(num_training_steps),
                num_training_steps,
                self.args.lr_scheduler_kwargs,
            )
        return scheduler

    # ---- rollout: values, KL-shaped rewards, GAE -----------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        bad = torch.isnan(rewards_per_func)
        if bad.any():
            names = [name for i, name in enumerate(self.reward_func_names) if bad[:, i].any()]
            raise ValueError(
                f"reward function(s) {names} returned None or NaN for {int(bad.any(1).sum())} completion(s). PPO "
                "needs a score for every completion (a critic cannot learn from a missing return). Fix: return a "
                "float for every completion (e.g. 0.0 for unparsable output)."
            )
        self.run.step.rewards_per_func.give(rewards_per_func)  # TRL's code between here and the caller drops them
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        # The step's state opens here, outside the adapter's frame: this one reads the rewards after TRL's returns.
        # beta != 0 while TRL scores the batch: it then computes the reference log-probs (model, or disabled adapter)
        with self.run.steps.opened() as step, self.run.trl.beta_replaced(self.args.kl_coef):
            batch = super()._generate_and_score_completions(inputs)
            rewards_per_func = step.rewards_per_func.take()
        args = self.args
        device = self.accelerator.device
        prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
        input_ids, attention_mask, mask = _rollout_rows(batch)
        logits_to_keep = completion_ids.size(1)
        images = _multimodal_inputs(batch)

        with torch.no_grad():
            if batch.get("old_per_token_logps") is None:
                batch["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=args.per_device_train_batch_size,
                    **images,
                )
            old_logps = batch["old_per_token_logps"]
            ref_logps = batch.pop("ref_per_token_logps", None)
            if ref_logps is None:
                ref_logps = old_logps  # kl_coef == 0: no reference model, no penalty
            values = self.critic.values(
                input_ids, attention_mask, prompt_ids.size(1), logits_to_keep, _critic_inputs(images)
            )
            values = values * mask

            process_slice = slice(
                self.accelerator.process_index * len(prompt_ids),
                (self.accelerator.process_index + 1) * len(prompt_ids),
            )
            weights = self.reward_weights.to(device).unsqueeze(0)
            scores = (rewards_per_func * weights).nansum(dim=1)[process_slice]
            if args.missing_eos_penalty is not None:
                # EOS counts where it ends the completion (its last real token), not inside a tool turn or as padding
                ends_with_eos = ppo_core.ends_with(completion_ids, batch["completion_mask"], self.eos_token_ids)
                scores = scores - args.missing_eos_penalty * (~ends_with_eos).float()

            kl = ppo_core.kl_penalty(old_logps, ref_logps, args.kl_estimator) * mask
            rewards, non_score = ppo_core.shaped_rewards(scores, kl, mask, args.kl_coef)
            # Whitened over the whole batch (all ranks), as one process would: results do not depend on world size.
            sum_across_ranks = partial(self.accelerator.reduce, reduction="sum")
            if args.whiten_rewards:
                rewards = ppo_core.masked_whiten(rewards, mask, False, sum_across_ranks) * mask
            advantages, returns = ppo_core.compute_gae(rewards, values, mask, args.gamma, args.lam)
            advantages = ppo_core.masked_whiten(advantages, mask, sum_across_ranks=sum_across_ranks) * mask

        batch["advantages"] = advantages
        batch["values"] = values
        batch["returns"] = returns
        self._log_objective(scores, kl, non_score, old_logps, mask)
        return batch

    def _log_objective(self, scores, kl, non_score, old_logps, mask) -> None:
        gather = self.accelerator.gather
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["objective/kl"].append(gather(kl.sum(1)).mean().item())
        metrics["objective/entropy"].append(gather((-old_logps * mask).sum(1)).mean().item())
        metrics["objective/non_score_reward"].append(gather(non_score.sum(1)).mean().item())
        metrics["objective/rlhf_reward"].append(gather(scores + non_score.sum(1)).mean().item())
        metrics["objective/scores"].append(gather(scores).mean().item())

    # ---- update: clipped policy loss + critic step ---------------------------------------------------------

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        input_ids, attention_mask, mask = _rollout_rows(inputs)
        logits_to_keep = inputs["completion_ids"].size(1)
        images = _multimodal_inputs(inputs)
        token_weight = self._token_weight(inputs, mask, mode)
        # The critic's update starts first: on a Ray group it runs while the policy's forward/backward runs here.
        batch = CriticBatch(
            input_ids,
            attention_mask,
            inputs["prompt_ids"].size(1),
            inputs["values"],
            inputs["returns"],
            mask,
            multimodal_inputs=_critic_inputs(images),
            loss_scale=token_weight,
        )
        critic_update = self.critic.step_async(batch, train=mode == "train")

        logps, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy=True, **images
        )
        per_token_loss, stats = ppo_core.clipped_policy_loss(
            logps, inputs["old_per_token_logps"], inputs["advantages"], mask, self.epsilon_low, self.epsilon_high
        )
        if self.use_vllm and self.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            # TRL's truncated importance weights for the sampler/trainer mismatch (as GRPO applies them)
            per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]
        policy_loss = ppo_core.masked_mean(per_token_loss, mask)
        # Like GRPO's token-mean losses, scaled here for gradient accumulation (loss_is_scaled_for_ga).
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if mode == "train":  # collected after the policy's backward (training_step), which it overlaps
            self._critic_update.give(critic_update)
        else:
            self._log_critic(*critic_update.result(), mode)

        reduce = self.accelerator.gather
        metrics = self._metrics[mode]
        metrics["policy/approxkl"].append(reduce(stats["approxkl"]).mean().item())
        metrics["policy/clipfrac"].append(reduce(stats["clipfrac"]).mean().item())
        metrics["policy/entropy"].append(reduce(ppo_core.masked_mean(entropies.detach(), mask)).mean().item())
        metrics["val/ratio"].append(reduce(stats["ratio"]).mean().item())
        metrics["loss/policy"].append(reduce(policy_loss.detach()).mean().item())
        return policy_loss * token_weight / normalizer

    def _token_weight(self, inputs, mask: torch.Tensor, mode: str) -> float:
        """What turns this micro-batch's token mean (divided by the accumulation steps, as `bnpo`) into its share of
        the step's token mean over every process and micro-batch (`dapo`): its tokens over the average micro-batch's
        (TRL's `dapo` normaliser: the generation batch's tokens per process and accumulation window)."""
        if self.loss_type == "bnpo":
            return 1.0
        per_process = inputs["num_items_in_batch"].float().clamp(min=1.0).item() / self.accelerator.num_processes
        if mode == "train":  # the generation batch spans steps_per_generation micro-batches, GA per window
            per_micro_batch = per_process / self.args.steps_per_generation
            return mask.sum().item() / per_micro_batch
        return mask.sum().item() / per_process

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._critic_update.clear()
        loss = super().training_step(model, inputs, num_items_in_batch)
        pending = self._critic_update.take_if_given()
        if pending is not None:
            self._log_critic(*pending.result(), "train")
        return loss

    def _log_critic(self, value_loss, value_stats, mode: str) -> None:
        reduce = self.accelerator.gather
        self._metrics[mode]["loss/value"].append(reduce(value_loss).mean().item())
        for key, value in value_stats.items():
            self._metrics[mode][key].append(reduce(value).mean().item())
        grad_norm = self.critic.grad_norm if mode == "train" else None
        if grad_norm is None:  # no optimizer step of the critic ended this micro-step (or it is remote)
            return
        # Its gradient norm, and what each rank holds of it (sharding shows as 1/world of one process's): once per
        # critic optimizer step, in one gather, averaged over ranks.
        held = self.critic.shard_bytes()
        figures = [grad_norm, float(held["parameters"]), float(held["optimizer"])]
        means = reduce(torch.tensor([figures], device=self.accelerator.device)).mean(0).tolist()
        names = ("critic/grad_norm", "critic/parameters_bytes_per_rank", "critic/optimizer_bytes_per_rank")
        for name, value in zip(names, means):
            self._metrics[mode][name].append(value)

    # ---- saving, checkpoints, resuming ---------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Save the policy as TRL does, and the critic beside it in `value_model/` (with a model card)."""
        super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        weights = self.critic.weights()  # wherever it lives (sharded: gathered; a Ray worker: fetched)
        if self.accelerator.is_main_process:
            critic_dir = os.path.join(output_dir, VALUE_MODEL_DIR)
            from safetensors.torch import save_file

            os.makedirs(critic_dir, exist_ok=True)
            self.critic_config.save_pretrained(critic_dir)
            weights = {k: v.contiguous() for k, v in weights.items()}
            save_file(weights, os.path.join(critic_dir, "model.safetensors"), metadata={"format": "pt"})
            if self.processing_class is not None:
                self.processing_class.save_pretrained(critic_dir)
            with open(os.path.join(critic_dir, "README.md"), "w") as f:
                f.write(
                    "---\nlibrary_name: transformers\ntags:\n- trl\n- trl-scale\n- ppo\n- value-model\n---\n\n"
                    "# Value model (critic)\n\nThe PPO critic trained beside the policy in the parent folder with "
                    "[trl-scale](https://github.com/trl-scale/trl-scale)'s `PPOTrainer`. Load it with "
                    "`AutoModelForSequenceClassification.from_pretrained(path, subfolder='value_model')`.\n"
                )

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        self.critic.save_training_state(output_dir, self.accelerator.is_main_process)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        weights = os.path.join(checkpoint, VALUE_MODEL_DIR, "model.safetensors")
        if not os.path.isfile(weights):
            names = (CRITIC_OPTIMIZER_NAME, CRITIC_DEEPSPEED_DIR)
            critic_files = [name for name in names if os.path.exists(os.path.join(checkpoint, name))]
            if critic_files:  # PPOTrainer saved it, with the critic's optimizer: its weights went missing since
                why = (
                    f"its critic's weights ({VALUE_MODEL_DIR}/model.safetensors) are missing, though PPOTrainer saved "
                    f"them (its critic state {critic_files[0]} is there): deleted or not copied"
                )
            else:
                why = f"it has no critic ({VALUE_MODEL_DIR}/): it was not saved by PPOTrainer (a GRPO checkpoint?)"
            raise FileNotFoundError(
                f"cannot resume from {checkpoint}: {why}. Nothing was trained, and the checkpoint is left as it is. "
                f"Fix: restore {VALUE_MODEL_DIR}/ from a copy, or resume from another PPO checkpoint"
            )
        from safetensors.torch import load_file

        self.critic.load_training_state(checkpoint, load_file(weights))


def _rollout_rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's whole rows (prompt and completion ids, their attention mask) and the completion tokens that are
    the policy's (a float mask; tool output excluded)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mask = batch["completion_mask"].float()
    if "tool_mask" in batch:
        mask = mask * batch["tool_mask"]
    return input_ids, attention_mask, mask


def _multimodal_inputs(batch: dict) -> dict:
    """The rollout batch's image inputs, as TRL's GRPO passes them to a log-prob forward."""
    return {key: batch[key] for key in MULTIMODAL_FIELDS if batch.get(key) is not None}


def _critic_inputs(images: dict) -> dict | None:
    """What the critic gets of them: all, the row-slicing fields too (a critic on a Ray group splits the images by
    rows over its workers; a critic's forward leaves those out: `critic.base.forward_images`)."""
    return dict(images) or None
