"""A `rollout_func`'s sampler log-probs checked where it returns: nested per token (as `vllm_generation.generate`
gives them) trained on wrong importance ratios when the rows per device equalled the completion width, and failed
deep in TRL otherwise; one short failed deep in TRL. The trainer wraps the function once, so the streamed path
(`trainers/stream_rollout_func.py`, which calls `trainer.rollout_func` per group) is checked by the same wrapper."""

import pytest

import trl_scale
from trl_scale.toy import counting_prompts
from trl_scale.trainers.rollout_checks import check_rollout_output

from .helpers import cpu_args, token_parity_reward

GOOD = {"prompt_ids": [[1, 2], [1, 2]], "completion_ids": [[3, 4, 5], [6]], "logprobs": [[-0.1, -0.2, -0.3], [-1.0]]}


@pytest.mark.parametrize(
    "logprobs, message",
    [
        ([[[-0.1], [-0.2], [-0.3]], [[-1.0]]], r"nested logprobs for completion 0 .*Fix: keep the sampled token's"),
        ([[-0.1, -0.2], [-1.0]], r"2 logprobs for completion 0's 3 tokens"),
        ([[-0.1, -0.2, -0.3], []], r"0 logprobs for completion 1's 1 tokens"),
        ([[-0.1, "x", -0.3], [-1.0]], r"'x' \(str\) among the logprobs of completion 0"),
    ],
)
def test_a_rollout_funcs_logprobs_must_be_one_number_per_completion_token(logprobs, message):
    with pytest.raises(ValueError, match=message):
        check_rollout_output({**GOOD, "logprobs": logprobs})


def test_what_is_right_passes_and_none_means_no_sampler_logprobs():
    check_rollout_output(GOOD)
    check_rollout_output({**GOOD, "logprobs": None})


def test_the_trainer_checks_its_rollout_func(tiny_llama, tmp_path):
    def rollout(prompts, trainer):
        return {**GOOD, "logprobs": [[[-0.1], [-0.2], [-0.3]], [[-1.0]]]}

    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=2, max_completion_length=4)),
        train_dataset=counting_prompts(8, seed=0),
        rollout_func=rollout,
    )
    assert trainer.rollout_func.__trl_scale_checked__ is rollout
    with pytest.raises(ValueError, match="nested logprobs"):
        trainer.rollout_func(["a", "b"], trainer)
