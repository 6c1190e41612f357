"""Evaluation during training: pass@k (the unbiased estimator) against a plain count over every k-subset, the config
fields' refusals and their YAML, and TRL's `eval_strategy` in a local-generation GRPO run whose logged pass@k per
reward function equals the plain computation over the completions it scored. Server rollout (synchronous, ordered,
streaming) is in tests/test_streaming_servers.py, colocated vLLM in tests/test_colocate.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

import trl_scale
from trl_scale.evaluation import pass_at_k, pass_rates
from trl_scale.toy import TOY_WORDS

from .helpers import cpu_args


def plain_pass_at_k(group: list[float], k: int, threshold: float) -> float:
    """The fraction of the k-subsets of a prompt's samples that hold a passing one (NaN: no pass)."""
    subsets = list(itertools.combinations(group, k))
    return sum(any(value >= threshold for value in subset) for subset in subsets) / len(subsets)


def plain_pass_rates(rewards: list[float], n: int, k: int, threshold: float) -> float | None:
    groups = [rewards[i : i + n] for i in range(0, len(rewards), n)]
    scored = [g for g in groups if not all(math.isnan(v) for v in g)]
    return sum(plain_pass_at_k(g, k, threshold) for g in scored) / len(scored) if scored else None


def test_pass_at_k_is_the_fraction_of_k_subsets_holding_a_pass():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        group = [rng.choice([0.0, 0.5, 1.0, 2.0, math.nan]) for _ in range(n)]
        passed = sum(1 for value in group if value >= 1.0)
        for k in range(1, n + 1):
            assert pass_at_k(n, passed, k) == pytest.approx(plain_pass_at_k(group, k, 1.0), abs=1e-12)
    rewards = [1.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan, math.nan, 0.0, 1.0, 1.0, 0.0]
    rates = pass_rates(rewards, 4, [1, 2, 4], threshold=1.0)
    assert rates == {k: pytest.approx(plain_pass_rates(rewards, 4, k, 1.0)) for k in (1, 2, 4)}
    assert rates[1] == pytest.approx((0.25 + 0.5) / 2)  # the all-NaN group is left out, not counted as failing
    assert pass_rates([math.nan] * 4, 2, [1], 1.0) == {}
    with pytest.raises(ValueError, match="whole groups"):
        pass_rates([1.0] * 5, 2, [1], 1.0)


@pytest.mark.parametrize(
    "value, match",
    [
        ([0], "from 1 to num_generations_eval=4"),
        ([5], "from 1 to num_generations_eval=4"),
        ([1.5], "from 1 to num_generations_eval=4"),
        ([], "non-empty list"),
        (2, "non-empty list"),
        ("2", "non-empty list"),
    ],
)
def test_eval_pass_at_k_outside_one_to_the_completions_per_prompt_is_refused(tmp_path, value, match):
    with pytest.raises(ValueError, match=r"eval_pass_at_k=.*" + match):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, eval_pass_at_k=value))


def test_eval_fields_checked_and_defaults(tmp_path):
    with pytest.raises(ValueError, match="eval_success_threshold=nan: use a finite number"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, eval_success_threshold=float("nan")))
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, num_generations_eval=2))
    assert config.pass_at_ks() == [1, 2]  # num_generations_eval, not num_generations
    rloo = trl_scale.RLOOConfig(**cpu_args(tmp_path, num_generations=4, eval_pass_at_k=[4, 2, 2], do_eval=True))
    assert rloo.pass_at_ks() == [2, 4]
    ppo = trl_scale.PPOConfig(**cpu_args(tmp_path, eval_pass_at_k=[1], do_eval=True))
    assert ppo.pass_at_ks() == [1]


def test_eval_fields_from_the_trainer_yaml_and_the_command_line(tmp_path):
    from trl import ModelConfig, TrlParser

    from trl_scale.cli import _import_trl_script_types

    script_type, _ = _import_trl_script_types()
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nnum_generations: 4\neval_strategy: steps\neval_steps: 5\n"
        "eval_pass_at_k: [1, 4]\neval_success_threshold: 0.5\nuse_cpu: true\nbf16: false\n"
    )
    parser = TrlParser((script_type, trl_scale.GRPOConfig, ModelConfig))
    _, args, _ = parser.parse_args_and_config(["--config", str(config)])
    assert args.eval_pass_at_k == [1, 4] and args.eval_success_threshold == 0.5
    _, args, _ = parser.parse_args_and_config(["--config", str(config), "--eval_pass_at_k", "2"])
    assert args.eval_pass_at_k == [2]
    with pytest.raises(ValueError, match="eval_pass_at_k"):
        parser.parse_args_and_config(["--config", str(config), "--eval_pass_at_k", "8"])


# ---- a run ----------------------------------------------------------------------------------------------------------


def first_token_even(completion_ids, **kwargs) -> list[float]:
    return [1.0 if ids and ids[0] % 2 == 0 else 0.0 for ids in completion_ids]


def long_prompts_only(prompts, completion_ids, **kwargs) -> list[float | None]:
    """Scores only prompts of three words (None, "does not apply", for the rest): pass@k leaves those out."""
    scored = zip(prompts, completion_ids)
    return [None if len(p.split()) != 3 else float(len(ids) and ids[-1] % 3 == 0) for p, ids in scored]


class Recorded:
    """Wraps a reward function and keeps what it returned in evaluation (the trainer's model not training)."""

    def __init__(self, func):
        self.func, self.__name__, self.trainer, self.evaluated = func, func.__name__, None, []

    def __call__(self, **kwargs):
        values = self.func(**kwargs)
        if not self.trainer.model.training:
            self.evaluated.append([math.nan if v is None else v for v in values])
        return values


def eval_dataset() -> Dataset:
    return Dataset.from_list([{"prompt": " ".join(TOY_WORDS[i : i + 2 + i % 2])} for i in range(4)])


def eval_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "eval_reward" in log]


def check_pass_at_k(trainer, recorded: list[Recorded], n: int, ks: list[int], evaluations: int) -> None:
    """Each evaluation's logged pass@k per function equals the plain computation over what the function returned."""
    logs = eval_logs(trainer)
    assert len(logs) == evaluations, trainer.state.log_history
    for reward in recorded:
        assert len(reward.evaluated) == evaluations  # one evaluation batch each
        for log, rewards in zip(logs, reward.evaluated):
            for k in ks:
                expected = plain_pass_rates(rewards, n, k, 1.0)
                assert log[f"eval_rewards/{reward.__name__}/pass@{k}"] == pytest.approx(expected, abs=1e-6), (k, log)
    # the figures are not constant: some prompt passes and some does not somewhere
    values = {log[f"eval_rewards/{recorded[0].__name__}/pass@1"] for log in logs}
    assert values - {0.0, 1.0} or len(values) > 1, values


@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo"])
def test_local_generation_evaluates_with_pass_at_k_per_reward_function(tiny_llama, tmp_path, method):
    """TRL's own generation (no vLLM): GRPO and RLOO sample 4 completions per evaluation prompt while training on 2;
    PPO samples one (as it trains: `num_generations_eval` defaults to its `num_generations`, 1), pass@1 its
    success rate."""
    from trl_scale.toy import counting_prompts

    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    n, ks = (1, [1]) if method == "ppo" else (4, [1, 2, 4])
    sampling = dict(num_generations=2, num_generations_eval=n)
    if method == "ppo":
        sampling = dict(num_ppo_epochs=1, num_mini_batches=1)
    rewards = [Recorded(first_token_even)]
    if method != "ppo":  # PPO needs a score for every completion: no None
        rewards.append(Recorded(long_prompts_only))
    args = cpu_args(
        tmp_path,
        max_completion_length=4,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4 * n,
        eval_pass_at_k=None if method == "ppo" else ks,  # PPO: the default, [1]
        **sampling,
    )
    trainer = trainer_cls(
        model=tiny_llama,
        reward_funcs=rewards,
        args=config_cls(**args),
        train_dataset=counting_prompts(64),
        eval_dataset=eval_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    for reward in rewards:
        reward.trainer = trainer
    trainer.train()
    check_pass_at_k(trainer, rewards, n=n, ks=ks, evaluations=2)


def test_pass_at_k_without_any_evaluation_is_refused(tmp_path):
    """eval_pass_at_k is logged by evaluation: with eval_strategy='no' (TRL's default) nothing reads it."""
    with pytest.raises(ValueError, match=r"eval_pass_at_k=\[1\] is logged by evaluation, and eval_strategy='no'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, eval_pass_at_k=[1]))
    trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, eval_pass_at_k=[1], do_eval=True))  # evaluate()


def test_a_prompt_scored_for_some_of_its_samples_counts_in_pass_at_k():
    """NaN (the function does not score that sample) is no pass; a prompt with some samples scored counts, one with
    none is left out (a planted bug dropped the partly scored ones)."""
    from trl_scale.evaluation.pass_at_k import pass_rates

    nan = float("nan")
    rewards = [1.0, nan, nan, 0.0] + [nan] * 4 + [0.0] * 4
    rates = pass_rates(rewards, group_size=4, ks=[1, 4], threshold=1.0)
    assert rates == {1: pytest.approx((1 / 4 + 0.0) / 2), 4: pytest.approx((1.0 + 0.0) / 2)}
