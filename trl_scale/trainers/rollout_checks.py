"""A `rollout_func`'s output checked where it returns (in the step, and streamed per group): its sampler log-probs,
which the importance-sampling correction divides by, must be one number per completion token."""

from __future__ import annotations

import functools
import numbers

import torch


def check_rollout_output(output: dict) -> None:
    """`logprobs` (unless None) hold one real number per token of each completion: a nested list (the top-k
    log-probs per token that `vllm_generation.generate` returns) trained on wrong ratios, a short one failed deep in
    TRL."""
    logprobs, completions = output.get("logprobs"), output.get("completion_ids")
    if logprobs is None or completions is None:
        return
    for index, (ids, values) in enumerate(zip(completions, logprobs)):
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        first_bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Real)), None)
        if isinstance(first_bad, (list, tuple, torch.Tensor)):
            raise ValueError(
                f"rollout_func returned nested logprobs for completion {index} (a list per token, as "
                "vllm_generation.generate gives them: each token's top-k log-probs, the sampled token's first). The "
                "correction needs one log-prob per token. Fix: keep the sampled token's, as TRL's own generation "
                "does: logprobs = [[lp[0] for lp in seq] for seq in logprobs]"
            )
        if first_bad is not None:
            raise ValueError(
                f"rollout_func returned {first_bad!r} ({type(first_bad).__name__}) among the logprobs of completion "
                f"{index}: each is the sampler's log-prob (a float) of one completion token"
            )
        if len(values) != len(ids):
            raise ValueError(
                f"rollout_func returned {len(values)} logprobs for completion {index}'s {len(ids)} tokens: one "
                "sampler log-prob per completion token, in order (the prompt's not included)"
            )


def checked_rollout_func(function):
    """`function` with its output checked (`check_rollout_output`); the same once wrapped."""
    if function is None or hasattr(function, "__trl_scale_checked__"):
        return function

    @functools.wraps(function)
    def checked(prompts, trl_trainer):  # TRL hands the user's function its trainer
        output = function(prompts, trl_trainer)
        if isinstance(output, dict):
            check_rollout_output(output)
        return output

    checked.__trl_scale_checked__ = function
    return checked
