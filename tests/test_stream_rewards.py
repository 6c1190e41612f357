"""Rewards in the stream (`stream_rewards=True`, `trl_scale/trainers/stream_rewards.py`) over real `trl-scale serve`
processes: each prompt group's rewards are computed as soon as it finishes, on the stream's threads (recorded per
call), and the step's rewards equal TRL's `_calculate_rewards` run on the same rows and completions, to the bit
(several functions with weights, an async one, one returning None, a reward model that stays in the step), for GRPO,
RLOO and PPO; dynamic sampling reads them instead of scoring again; a raising function names itself and the group;
bad settings are refused naming the field and the fix."""

import asyncio
import threading

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts
from trl_scale.trainers.reward_checks import RewardFunctionError
from trl_scale.trainers.stream_rewards import GroupRewards, _check_pairing

from .helpers import cpu_args, start_servers, token_parity_reward

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def urls(tiny_llama):
    servers = start_servers(tiny_llama, 2)
    yield [server.url for server in servers]
    for server in servers:
        server.stop()


class Calls:
    """Where each reward function call ran: (function, thread name), the step's reference calls left out."""

    def __init__(self):
        self.seen: list[tuple[str, str]] = []
        self.rows: dict[str, int] = {}
        self.reference = threading.local()

    def record(self, name: str, rows: int = 0) -> None:
        if not getattr(self.reference, "on", False):
            self.seen.append((name, threading.current_thread().name))
            self.rows[name] = self.rows.get(name, 0) + rows


def reward_functions(calls: Calls) -> list:
    """A length reward, one returning None for every other completion (NaN for TRL), and an async one."""

    def length_reward(completion_ids, **kwargs):
        calls.record("length_reward", len(completion_ids))
        return [len(ids) / 8 for ids in completion_ids]

    def sometimes_none(completion_ids, **kwargs):
        calls.record("sometimes_none")
        return [None if ids[0] % 2 else float(ids[-1] % 3) for ids in completion_ids]

    async def async_parity(completion_ids, **kwargs):
        calls.record("async_parity")
        await asyncio.sleep(0.001)
        return token_parity_reward(completion_ids)

    return [length_reward, sometimes_none, async_parity]


def compared_with_trl(monkeypatch, trainer_class, calls: Calls) -> list[tuple]:
    """TRL's `_calculate_rewards`, patched to run also on the trainer's own reward functions (TRL's computation, in
    the step, on the very rows and completions) after each call: (what the step got, TRL's) per call."""
    trl_class = next(c for c in trainer_class.__mro__ if c.__module__.startswith("trl."))
    original = trl_class._calculate_rewards
    pairs = []

    def both(self, inputs, prompts, completions, completion_ids_list):
        got = original(self, inputs, prompts, completions, completion_ids_list)
        replayed = self.reward_funcs
        self.reward_funcs = functions_of[id(self)]
        calls.reference.on = True
        try:
            expected = original(self, inputs, prompts, completions, completion_ids_list)
        finally:
            calls.reference.on = False
            self.reward_funcs = replayed
        pairs.append((got.clone(), expected))
        return got

    functions_of = {}
    monkeypatch.setattr(trl_class, "_calculate_rewards", both)
    return pairs, functions_of


def streamed_run(method, model_path, out, urls, reward_funcs, **overrides):
    trainer_class, config_class = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    settings = dict(
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        weight_sync_timeout=60,
        rollout_request_timeout=60,
        async_rollout_staleness=1,
        stream_rewards=True,
    )
    if method == "ppo":
        settings.update(num_generations=1, num_ppo_epochs=1, num_mini_batches=1)
    return trainer_class(
        model=model_path,
        reward_funcs=reward_funcs,
        args=config_class(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo"])
def test_rewards_in_the_stream_equal_trls_on_the_same_completions(
    monkeypatch, tiny_llama, tiny_reward_model, urls, tmp_path, method
):
    calls = Calls()
    trainer_class = {"grpo": trl_scale.GRPOTrainer, "rloo": trl_scale.RLOOTrainer, "ppo": trl_scale.PPOTrainer}
    pairs, functions_of = compared_with_trl(monkeypatch, trainer_class[method], calls)
    functions = [tiny_reward_model, *reward_functions(calls)]  # the reward model stays in the step
    if method == "ppo":  # PPO refuses a missing reward (its critic needs every return)
        functions.pop(2)
    weights = [0.5, 1.0, 2.0, -1.0][: len(functions)]
    trainer = streamed_run(method, tiny_llama, tmp_path, urls, functions, reward_weights=weights)
    functions_of[id(trainer)] = list(trainer.reward_funcs)
    trainer.train()
    assert trainer.state.global_step == 3 and len(pairs) == 3
    for got, expected in pairs:
        assert got.shape == expected.shape == (8, len(functions))
        assert not torch.isnan(expected[:, 0]).any()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    # A missing reward (None: a completion whose first token is odd) came through somewhere in the run. Not asked of
    # each call: a call's 8 sampled first tokens are all even now and then (measured 1 to 6 odd of 8 per call), and
    # the per-call form of this check failed in the suite about once in ten runs.
    assert method == "ppo" or any(torch.isnan(expected[:, 2]).any() for _, expected in pairs)
    # every call of every function ran in the stream, none in the trainer's thread
    names = {name for name, _ in calls.seen}
    assert names == {"length_reward", "async_parity"} | ({"sometimes_none"} if method != "ppo" else set())
    threads = {thread for _, thread in calls.seen}
    assert "MainThread" not in threads, threads
    assert any(thread.startswith("reward") for thread in threads), threads
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert calls.rows["length_reward"] >= 3 * 8  # every trained row scored in the stream (some read ahead too)
    scored = [entry["rewards/stream_groups_scored"] for entry in logs]
    assert scored == sorted(scored) and scored[0] > 0 and logs[-1]["rewards/stream_seconds"] > 0
    assert all("rollout/stream_groups_scoring" in entry for entry in logs)


def test_a_group_paired_with_another_groups_rows_is_refused():
    rows = [{"prompt": f"p{i}"} for i in range(4)]
    groups = [
        GroupRewards(rows[:2], [[1], [2]], ["a", "b"], (0,), [[1.0], [0.0]]),
        GroupRewards(rows[2:], [[3], [4]], ["c", "d"], (0,), [[0.5], [0.25]]),
    ]
    _check_pairing(groups, rows, ["a", "b", "c", "d"], [[1], [2], [3], [4]])
    with pytest.raises(RuntimeError, match="not the ones whose rewards were computed in the stream"):
        _check_pairing(groups[::-1], rows, ["a", "b", "c", "d"], [[1], [2], [3], [4]])
    with pytest.raises(RuntimeError, match="not the ones whose rewards were computed in the stream"):
        _check_pairing(groups, rows, ["a", "b", "c", "d"], [[1], [2], [4], [3]])
    # the same rows and ids, other completions (a conversation's messages the step parsed otherwise): refused
    with pytest.raises(RuntimeError, match="not the ones whose rewards were computed in the stream"):
        _check_pairing(groups, rows, ["a", "b", "c", "x"], [[1], [2], [3], [4]])
    # equal rows that are not the step's own objects (copies of another batch's): refused
    with pytest.raises(RuntimeError, match="not the ones whose rewards were computed in the stream"):
        _check_pairing(groups, [dict(row) for row in rows], ["a", "b", "c", "d"], [[1], [2], [3], [4]])


def test_dynamic_sampling_reads_the_rewards_of_the_stream(tiny_llama, urls, tmp_path):
    from .helpers import half_flat_reward

    threads = []

    def recorded(prompts, completion_ids, **kwargs):
        threads.append(threading.current_thread().name)
        return half_flat_reward(prompts, completion_ids)

    trainer = streamed_run("grpo", tiny_llama, tmp_path, urls, [recorded], dynamic_sampling=True, max_steps=2)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and max(entry["dynamic_sampling/oversampling"] for entry in logs) > 1.0  # it topped up
    assert threads and "MainThread" not in threads, threads  # no round scored again in the step


def test_a_raising_reward_function_names_itself_and_the_group(tiny_llama, urls, tmp_path):
    def broken_verifier(completion_ids, **kwargs):
        raise ZeroDivisionError("the verifier divided by zero")

    trainer = streamed_run("grpo", tiny_llama, tmp_path, urls, [broken_verifier])
    match = r"reward function 'broken_verifier' raised ZeroDivisionError.*computed in the stream, for the prompt group"
    with pytest.raises(RewardFunctionError, match=match):
        trainer.train()


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(stream_rewards=True), r"stream_rewards=True .* async_rollout_staleness=0.*Fix: async_rollout_staleness"),
        (
            dict(stream_rewards=True, async_rollout_staleness=1, async_rollout_mode="ordered"),
            r"async_rollout_mode='ordered'.*Fix",
        ),
        (dict(stream_reward_workers=2), r"stream_reward_workers=2 .*Fix: stream_rewards=True"),
        (dict(stream_rewards=True, async_rollout_staleness=1, stream_reward_workers=0), r"stream_reward_workers=0"),
    ],
)
def test_bad_stream_reward_settings_name_the_field_and_the_fix(tmp_path, fields, match):
    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match=match):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, **server, **fields))


def test_the_trainer_yaml_and_the_command_line_set_the_stream_settings(tmp_path):
    import yaml
    from trl import TrlParser

    from trl_scale.rollout.settings import AsyncRollout

    base = dict(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True, vllm_mode="server", report_to="none"
    )
    base.update(vllm_server_base_urls=["http://127.0.0.1:1"], async_rollout_staleness=1)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**base, "stream_rewards": True, "environment_timeout": 45}))
    (from_yaml,) = TrlParser((trl_scale.GRPOConfig,)).parse_args_and_config(["--config", str(path)])
    assert AsyncRollout.from_config(from_yaml).stream_rewards_asked and from_yaml.environment_timeout == 45
    path.write_text(yaml.safe_dump(base))
    argv = ["--config", str(path), "--stream_rewards", "true", "--stream_reward_workers", "2"]
    (from_cli,) = TrlParser((trl_scale.GRPOConfig,)).parse_args_and_config([*argv, "--environment_timeout", "30"])
    settings = AsyncRollout.from_config(from_cli)
    assert settings.stream_rewards_asked and settings.reward_workers == 2 and from_cli.environment_timeout == 30


def test_the_readmes_defaults_for_agents_are_the_configs():
    """docs/agents.md, "Agents and slow rewards": the numbers it states are the config's defaults."""
    import dataclasses
    import pathlib
    import re

    section = (pathlib.Path(__file__).parent.parent / "docs" / "agents.md").read_text()
    defaults = {f.name: f.default for f in dataclasses.fields(trl_scale.GRPOConfig)}
    assert f"`environment_timeout` ({defaults['environment_timeout']:g} s)" in section
    assert re.search(rf"`stream_reward_workers` threads \({defaults['stream_reward_workers']};", section)
    assert defaults["stream_rewards"] is None and "on by default with environments" in section


def test_reward_workers_are_accepted_where_an_environment_streams_its_rewards_by_default(tmp_path, tiny_llama):
    """stream_rewards=None streams rewards where an environment streams: stream_reward_workers=2 there was refused by
    the config, which cannot see environments. The config accepts it with streaming; the trainer, which knows, refuses
    it without an environment and takes it with one."""
    from trl_scale.rollout.settings import AsyncRollout

    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, **server, async_rollout_staleness=1, stream_reward_workers=2))
    settings = AsyncRollout.from_config(config)
    assert settings.unread_reward_workers(None, environments=True) is None
    assert "Fix: stream_rewards=True" in settings.unread_reward_workers(None, environments=False)
    assert "Fix: stream_rewards=True" in settings.unread_reward_workers(False, environments=True)
    with pytest.raises(ValueError, match=r"stream_reward_workers=2 .*Fix: stream_rewards=True"):
        trl_scale.GRPOTrainer(
            model=tiny_llama, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(16)
        )
    with pytest.raises(ValueError, match=r"stream_reward_workers=2 .*Fix: stream_rewards=True"):
        trl_scale.GRPOConfig(
            **cpu_args(tmp_path, **server, async_rollout_staleness=1, stream_reward_workers=2, stream_rewards=False)
        )


def test_the_step_checks_its_rows_and_replays_the_streams_logs():
    """`StreamRewards.rewards` in the step (a stand-in trainer): the streamed groups' rows must be the step's (the
    check's call, not only the check, is what a planted bug dropped), and what the reward functions logged in the
    stream (`log_extra`, `log_metric`) reaches TRL's logs, in the batch's order."""
    from types import SimpleNamespace

    from trl_scale.rollout.step_state import StepState
    from trl_scale.trainers.stream_rewards import StreamRewards
    from trl_scale.trainers.trace import HookTrace
    from trl_scale.trainers.trl_facade import TrlFacade

    rows = [{"prompt": f"p{i}"} for i in range(4)]
    groups = [
        GroupRewards(rows[:2], [[1], [2]], ["a", "b"], (0,), [[1.0], [0.0]], [("judge", ["x", "y"])], [("m", 1.0)]),
        GroupRewards(rows[2:], [[3], [4]], ["c", "d"], (0,), [[0.5], [0.25]], [("judge", ["z", "w"])], [("m", 3.0)]),
    ]
    logged = []
    trainer = SimpleNamespace(
        reward_funcs=[token_parity_reward],
        _log_completion_extra=lambda column, values: logged.append((column, values)),
        _log_metric=lambda name, value: logged.append((name, value)),
    )

    def proceed(inputs, prompts, completions, completion_ids):
        return [f(prompts=prompts, completions=completions) for f in trainer.reward_funcs]

    run = SimpleNamespace(trl=TrlFacade(trainer), step=StepState(), trace=HookTrace())
    run.step.streamed_rewards.give(groups)
    (rewards,) = StreamRewards().rewards(run, proceed, rows, ["p"] * 4, ["a", "b", "c", "d"], [[1], [2], [3], [4]])
    assert rewards == [1.0, 0.0, 0.5, 0.25]
    assert logged == [("judge", ["x", "y"]), ("m", 1.0), ("judge", ["z", "w"]), ("m", 3.0)]
    run.step.streamed_rewards.give(groups)
    with pytest.raises(RuntimeError, match="not the ones whose rewards were computed in the stream"):
        StreamRewards().rewards(run, proceed, rows, ["p"] * 4, ["a", "b", "c", "d"], [[1], [2], [4], [3]])


def test_reward_workers_with_ordered_environments_are_accepted_by_the_config(tmp_path):
    """Ordered mode with environments streams each episode's rewards too (`ahead._ordered`): the config, which
    cannot see environments, leaves the decision to the trainer (it refused stream_reward_workers there)."""
    from trl_scale.rollout.settings import AsyncRollout

    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    fields = dict(async_rollout_staleness=1, async_rollout_mode="ordered", stream_reward_workers=2)
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, **server, **fields))
    assert AsyncRollout.from_config(config).unread_reward_workers(None, environments=True) is None
    with pytest.raises(ValueError, match=r"stream_reward_workers=2 .*Fix"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, **server, stream_reward_workers=2))  # synchronous: nothing streams
