"""Dynamic sampling (DAPO): groups whose rewards are all equal are dropped and the batch topped up; with no such
group the run is TRL's, bit for bit; when the budget runs out the batch is filled and a warning says so. (Streaming
rollout with dynamic sampling, against real servers: `test_streaming_servers.py`.)"""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

import trl_scale
from trl_scale.rollout.dynamic_sampling import CandidateRows, TopUpPrompts, choose_groups, groups_with_signal
from trl_scale.toy import counting_prompts
from trl_scale.trainers.correction import importance_weights
from trl_scale.trainers.dynamic_sampling import DynamicSampling
from trl_scale.trainers.trl_facade import TrlFacade

from .helpers import cpu_args, paired, saved_state, step_logs

# ---- the parts -------------------------------------------------------------------------------------------------


def test_groups_with_signal_uses_the_weighted_sum_of_the_rewards():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.5, float("nan")], [0.5, float("nan")]])
    # group 0 equal; group 1 differs per function but its weighted sum (1, 1) is equal; group 2 equal, NaN as 0
    assert groups_with_signal(rewards, torch.tensor([1.0, 1.0]), 2).tolist() == [False, False, False]
    assert groups_with_signal(rewards, torch.tensor([1.0, 2.0]), 2).tolist() == [False, True, False]


def test_choose_groups_takes_signal_first_in_order_then_fills():
    assert choose_groups([False, True, True, False, True], 2) == ([1, 2], 0)
    assert choose_groups([False, True, False, False], 3) == ([0, 1, 2], 2)
    with pytest.raises(ValueError):
        choose_groups([True], 2)


def test_candidate_rows_select_and_join_keep_rows_together():
    def part(offset, n, extra=True):
        generated = (
            [[offset + i] for i in range(n)],
            [[offset + i, 9] for i in range(n)],
            None,
            [f"c{offset + i}" for i in range(n)],
            [[0.1 * i] for i in range(n)],
            {"env": [offset + i for i in range(n)]},
            None,
            [],
        )
        per_row = {"extra:score": [offset + i for i in range(n)]} if extra else {}
        rows = [{"prompt": f"p{offset + i}"} for i in range(n)]
        return CandidateRows(rows, generated, torch.arange(offset, offset + n).float().unsqueeze(1), per_row)

    joined = CandidateRows.joined([part(0, 2), part(10, 2, extra=False)])
    chosen = joined.select([1, 3])
    assert [row["prompt"] for row in chosen.rows] == ["p1", "p11"]
    assert chosen.generated[1] == [[1, 9], [11, 9]] and chosen.generated[3] == ["c1", "c11"]
    assert chosen.generated[5] == {"env": [1, 11]} and chosen.generated[2] is None and chosen.generated[7] == []
    assert chosen.rewards.squeeze(1).tolist() == [1.0, 11.0]
    assert chosen.per_row == {"extra:score": [1, None]}


def test_top_up_prompts_cover_each_epoch_once_in_a_seeded_order():
    dataset = Dataset.from_list([{"prompt": f"p{i}"} for i in range(5)])
    top_up = TopUpPrompts(dataset, group_size=2, seed=3, process_index=0)
    rows = top_up.draw(5)
    assert [r["prompt"] for r in rows[::2]] == [r["prompt"] for r in rows[1::2]]  # each prompt group_size times
    assert sorted(r["prompt"] for r in rows[::2]) == [f"p{i}" for i in range(5)]  # an epoch: each prompt once
    again = TopUpPrompts(dataset, group_size=2, seed=3, process_index=0)
    again.drawn = 3  # a resume at 3 draws on from there
    assert [r["prompt"] for r in again.draw(2)[::2]] == [r["prompt"] for r in rows[6::2]]
    other = TopUpPrompts(dataset, group_size=2, seed=3, process_index=1).draw(5)
    assert [r["prompt"] for r in other[::2]] != [r["prompt"] for r in rows[::2]]  # each process its own order


# ---- in the trainer ----------------------------------------------------------------------------------------------


def flat_or_varied(completion_ids, flat, **kwargs) -> list[float]:
    """0.5 for every completion of a `flat` prompt (a group without a signal); for the others a number that differs
    whenever the completions do (token parity alone is often equal across a group of a random model's answers)."""
    return [
        0.5 if f else (sum((i + 1) * t for i, t in enumerate(ids)) % 97) / 97 for f, ids in zip(flat, completion_ids)
    ]


def _dataset(flat_every: int | None):
    prompts = counting_prompts(64, seed=0)["prompt"]
    flat = [flat_every is not None and i % flat_every == 0 for i in range(len(prompts))]
    return Dataset.from_dict({"prompt": prompts, "flat": flat})


def _build(method, model_path, out, dataset, reward=flat_or_varied, **overrides):
    from transformers import AutoTokenizer

    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
    }[method]
    config = config_cls(**cpu_args(out, num_generations=4, max_completion_length=8, beta=0.05, **overrides))
    return trainer_cls(
        model=model_path,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def _run(method, model_path, out, dataset, reward=flat_or_varied, **overrides):
    trainer = _build(method, model_path, out, dataset, reward, **overrides)
    trainer.train()
    return trainer


def _logged(trainer, key) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_dynamic_sampling_trains_only_groups_with_a_signal(method, tiny_llama, tmp_path):
    """Every second prompt's group has equal rewards: without dynamic sampling TRL trains on them (zero std
    logged), with it every trained group has a signal and the dropped ones are counted. (A budget of 8x: with half
    the prompts flat, 3x runs out about one step in eight.)"""
    dataset = _dataset(flat_every=2)
    plain = _run(method, tiny_llama, tmp_path / "off", dataset)
    dynamic = _run(
        method, tiny_llama, tmp_path / "on", dataset, dynamic_sampling=True, dynamic_sampling_max_oversampling=8.0
    )
    assert max(_logged(plain, "frac_reward_zero_std")) > 0
    assert _logged(dynamic, "frac_reward_zero_std") == [0.0] * 3
    dropped = _logged(dynamic, "dynamic_sampling/groups_dropped")
    assert len(dropped) == 3 and sum(dropped) > 0
    assert max(_logged(dynamic, "dynamic_sampling/oversampling")) > 1
    assert _logged(dynamic, "dynamic_sampling/filled_without_signal") == [0.0] * 3
    assert dynamic.features.get(DynamicSampling).top_up.drawn > 0


def test_dynamic_sampling_without_flat_groups_is_trl_bit_for_bit(tiny_llama, tmp_path):
    """No group without a signal: the step trains the batch TRL would, from the same generation and rewards."""
    dataset = _dataset(flat_every=None)
    keys = ("loss", "grad_norm", "reward", "kl", "entropy", "completions/mean_length")
    plain = _run("grpo", tiny_llama, tmp_path / "off", dataset)
    dynamic = _run("grpo", tiny_llama, tmp_path / "on", dataset, dynamic_sampling=True)
    assert _logged(plain, "frac_reward_zero_std") == [0.0] * 3  # else this would not test the claim
    for expected, got in paired(step_logs(plain, keys), step_logs(dynamic, keys)):
        assert got == expected
    assert _logged(dynamic, "dynamic_sampling/oversampling") == [1.0] * 3


def test_spent_budget_fills_the_batch_and_warns_once(tiny_llama, tmp_path, caplog):
    """Every group flat: the budget (2x) is spent each step, the batch is trained filled with flat groups (zero
    advantages, the right size), and the warning comes once."""
    dataset = _dataset(flat_every=1)
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        trainer = _run(
            "grpo", tiny_llama, tmp_path, dataset, dynamic_sampling=True, dynamic_sampling_max_oversampling=2.0
        )
    assert _logged(trainer, "dynamic_sampling/oversampling") == [2.0] * 3
    assert _logged(trainer, "dynamic_sampling/filled_without_signal") == [1.0] * 3
    assert _logged(trainer, "frac_reward_zero_std") == [1.0] * 3
    assert sum("dynamic_sampling_max_oversampling" in r.getMessage() for r in caplog.records) == 1


def test_dynamic_sampling_refusals(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_oversampling"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4), dynamic_sampling_max_oversampling=0.5)
    # 2 processes x 6 rows hold whole groups of 4 for TRL, not per process: what one process can check
    two_processes = SimpleNamespace(
        args=SimpleNamespace(dynamic_sampling=True, per_device_train_batch_size=6, steps_per_generation=1),
        num_generations=4,
        environment_factories=None,
    )
    with pytest.raises(ValueError, match="whole groups"):
        DynamicSampling().check(SimpleNamespace(trl=TrlFacade(two_processes)))
    two_processes.num_generations = 1  # PPO's default
    with pytest.raises(ValueError, match="num_generations >= 2"):
        DynamicSampling().check(SimpleNamespace(trl=TrlFacade(two_processes)))
    two_processes.num_generations = 3
    two_processes.environment_factories = {"env": object}
    with_environments = DynamicSampling(environments=True)  # as the run's plan builds it with environment_factory
    with pytest.raises(ValueError, match="environment_factory and synchronous rollout.*Fix: async_rollout_staleness"):
        with_environments.check(SimpleNamespace(trl=TrlFacade(two_processes)))
    streamed = DynamicSampling(environments=True, asynchronous=True)  # async_rollout_staleness >= 1, in the plan
    streamed.check(SimpleNamespace(trl=TrlFacade(two_processes)))  # the stream runs the top-ups' episodes


def test_a_resume_draws_top_ups_on_from_where_the_checkpoint_was(tiny_llama, tmp_path):
    """The top-up source's position is saved with checkpoints: a resumed run draws the same new prompts the
    uninterrupted run drew after the checkpoint, not the first ones again. (Every group flat: each step draws.)"""
    dataset = _dataset(flat_every=1)

    def drawing(trainer):
        drawn = []
        feature = trainer.features.get(DynamicSampling)
        top_up_rows = feature.top_up_rows

        def recording(trainer, num_rows):
            rows = top_up_rows(trainer, num_rows)
            drawn.append((trainer.state.global_step, [row["prompt"] for row in rows]))
            return rows

        feature.top_up_rows = recording
        return drawn

    settings = dict(dynamic_sampling=True, dynamic_sampling_max_oversampling=2.0, max_steps=3)
    whole = _build("grpo", tiny_llama, tmp_path / "whole", dataset, save_strategy="steps", save_steps=1, **settings)
    whole_draws = drawing(whole)
    whole.train()
    state = saved_state(tmp_path / "whole" / "checkpoint-1", "dynamic_sampling")
    assert state["drawn"] == sum(len(rows) for step, rows in whole_draws if step == 0) // 4
    resumed = _build("grpo", tiny_llama, tmp_path / "resumed", dataset, **settings)
    resumed_draws = drawing(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-1"))
    after = [entry for entry in whole_draws if entry[0] >= 1]
    assert after and resumed_draws == after


@pytest.mark.slow
def test_two_processes_top_up_as_the_one_missing_most_and_score_their_own_candidates(tiny_llama, tmp_path):
    """2 data-parallel processes (gloo): rank 1's groups never have a signal, rank 0's mostly do. Both run the
    top-up rounds rank 1 needs (the process missing the most decides, or the other would leave it alone in a
    collective), and each judges its own candidates (with rank 0's rewards, rank 1 would see a signal and stop):
    every step generates the whole budget, 3 x the groups trained, and at least rank 1's half is filled without one."""

    from .helpers import ROOT, accelerate_launch, run_to_completion

    out = tmp_path / "two"
    command = ["-m", "trl_scale.cli", "grpo", "--config", str(ROOT / "examples" / "grpo_tiny_cpu.yaml")]
    command += ["--model_name_or_path", tiny_llama, "--output_dir", str(out), "--max_steps", "2"]
    command += ["--logging_steps", "1", "--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", "2"]
    command += ["--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "8"]
    command += ["--reward_funcs", "tests.helpers.flat_on_rank_1_reward", "--dynamic_sampling", "true"]
    command += ["--dynamic_sampling_max_oversampling", "3"]
    run_to_completion(accelerate_launch(2) + command)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["dynamic_sampling/oversampling"] == pytest.approx(3.0)
        assert entry["dynamic_sampling/filled_without_signal"] >= 0.5


def test_rloo_with_dynamic_sampling_corrects_the_chosen_rows_with_their_own_sampler_logprobs():
    """RLOO's asynchronous correction reads the generation backend's sampler log-probs of the rows TRL's step
    scores. With dynamic sampling those rows were chosen across rounds (here the top-up's group, not the batch's):
    TRL's `_generate` answered from them must leave the chosen rows' log-probs on the backend, or each sequence is
    weighted with another row's ratio."""
    import math

    from trl_scale.rollout.record import RECORD_KEY, GeneratedBatch
    from trl_scale.rollout.step_state import StepState
    from trl_scale.trainers.dynamic_sampling import RECORD_ROW

    from .helpers import rloo_correction_view

    def round_of(prompt: str, sampler: float, count: int = 2) -> CandidateRows:
        rows = [{"prompt": prompt} for _ in range(count)]
        generated = ([[1]] * count, [[5, 6]] * count, [f"{prompt}!"] * count)  # RLOO's three
        per_row = {RECORD_ROW: [GeneratedBatch(((0, 0),), ([sampler, sampler],))] * count}
        return CandidateRows(rows, generated, torch.zeros(count, 1), per_row)

    # the batch's own group (sampler log-probs -1 per token) had no signal; the top-up's (-2 per token) is chosen
    chosen = CandidateRows.joined([round_of("flat", -1.0), round_of("varied", -2.0)]).select([2, 3])
    step = StepState()
    step.records.add(GeneratedBatch(((0, 0),) * 2, ([-9.0, -9.0],) * 2))  # the last round's call left other values
    trainer = rloo_correction_view(SimpleNamespace(), clip_min=None, clip_max=100.0, mode="sequence_truncate")
    feature = DynamicSampling(server=True)
    step.chosen_completions.give(chosen)

    def not_generated(prompts):
        raise AssertionError("TRL's _generate ran: the chosen rows were not served")

    assert (
        feature.generate(SimpleNamespace(trl=TrlFacade(trainer), step=step), not_generated, ["varied", "varied"])
        == chosen.generated
    )
    batch = {
        "completion_ids": torch.ones(2, 2, dtype=torch.long),
        "completion_mask": torch.ones(2, 2),
        "old_logps": torch.tensor([-3.0, -3.0]),  # each sequence's old log-prob, summed over its 2 tokens
        RECORD_KEY: step.records.newest(),  # as the rollout feature hands the batch's record out
    }
    weights = importance_weights(TrlFacade(trainer), batch)
    assert torch.allclose(weights, torch.full((2,), math.exp(-3.0 + 4.0)))  # the chosen rows' -2 + -2


def test_a_batchs_build_never_reads_an_earlier_batchs_record():
    """`StepScope.opened`: a build starts with a state of its own (a batch whose generation added no record, e.g.
    served from elsewhere, must not read the previous batch's versions and sampler log-probs as its own, nor take
    its streamed batch or chosen rows); a frame inside the open build shares its state; the last closed build's
    records stay readable afterwards."""
    from trl_scale.rollout.record import GeneratedBatch
    from trl_scale.rollout.step_state import StepScope

    steps = StepScope()
    first, second, third = (GeneratedBatch(((n, n),)) for n in range(3))
    with steps.opened() as state:
        state.records.add(first)
        state.chosen_rewards.give("left behind by a failed step")
    assert steps.current is None and steps.newest_record() is first
    with steps.opened() as state:
        assert state.records.newest() is None and state.chosen_rewards.take_if_given() is None
        with steps.opened() as inner:
            assert inner is state
    with steps.opened() as state:
        state.records.add(second)
        state.records.add(third)
    assert steps.newest_record() is third
