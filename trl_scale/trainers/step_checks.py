"""Checks on what an online step is given, as trainer features: prompts that fit the context, rewards that say
something."""

from __future__ import annotations

import torch

from ..logs import get_logger
from .feature import Feature

logger = get_logger(__name__)


def context_length(trl) -> int | None:
    config = trl.accelerator.unwrap_model(trl.model).config.get_text_config()
    return getattr(config, "max_position_embeddings", None)


class ContextLength(Feature):
    """Every prompt plus `max_completion_length` fits the model's context (and the servers'): past it, positions the
    model never learned (or an index error, with learned positions) would train silently on garbage."""

    name = "context_length"

    def check(self, run) -> None:
        context = context_length(run.trl)
        if context is not None and run.trl.args.max_completion_length >= context:
            raise ValueError(
                f"max_completion_length={run.trl.args.max_completion_length} leaves no room for a prompt in this "
                f"model's context of {context} tokens (max_position_embeddings). Fix: lower max_completion_length"
            )

    def tokenize_prompts(self, run, proceed, prompts: list):
        prompt_ids, *rest = proceed(prompts)
        completion = run.trl.args.max_completion_length
        limits = [(context_length(run.trl), "the model's context", "max_position_embeddings")]
        served = run.trl.vllm_generation.server_max_model_len if run.plan.rollout.server else None
        if served is not None:  # vLLM would answer 400 for the whole batch
            limits.append((served, "the rollout servers' context", "their --max-model-len"))
        limits = [limit for limit in limits if limit[0] is not None]
        if limits:
            context, what, source = min(limits)
            for index, ids in enumerate(prompt_ids):
                if len(ids) + completion > context:
                    raise ValueError(
                        f"prompt {index} of this batch has {len(ids)} tokens; with max_completion_length="
                        f"{completion} that exceeds {what} of {context} tokens ({source}). Nothing was trained on "
                        "it, and earlier checkpoints are intact. Fix: drop or shorten long prompts (dataset.filter "
                        f"on their token count, at most {context - completion}), or lower max_completion_length"
                    )
        return (prompt_ids, *rest)


class EmptyRewardsWarning(Feature):
    """Every reward function returned None or NaN for a whole batch: TRL trains on it with zero advantages and logs
    the reward as nan, a run that learns nothing, silently. Said once."""

    name = "empty_rewards_warning"

    def __init__(self):
        self.warned = False

    def rewards(self, run, proceed, *args):
        rewards_per_func = proceed(*args)
        if not self.warned and torch.isnan(rewards_per_func).all():
            self.warned = True
            if run.trl.accelerator.is_main_process:
                logger.warning(
                    f"trl-scale: every reward function ({', '.join(run.trl.reward_func_names)}) returned None or NaN "
                    f"for all {rewards_per_func.size(0)} completions of this batch: there is nothing to learn from "
                    "(zero advantages, no gradient), and the step trains on nothing. Fix: make at least one reward "
                    "function return a float for these completions (None means 'does not apply to this one'). Said "
                    "once."
                )
        return rewards_per_func
