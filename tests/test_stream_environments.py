"""Environments in the stream (`trl_scale/trainers/stream_environments.py`): a prompt group's episode (its
environments taken from the pool and reset, TRL's tool loop over their methods, rewards with `get_reward`) run in the
stream equals TRL's own step on the same turns (prompts after reset, tokens, masks, log-probs, messages, rewards),
for a sync and an async environment in one multi-environment dataset; over real `trl-scale serve` processes a
streaming run calls no environment from the step, never gives one instance to two live conversations (forced: many
groups at once, slow tools), trains each group once and closes every instance; a hung method is a failing tool, a
failing reset() names the environment and the group; the settings that cannot work are refused."""

import asyncio
import copy
import math
import threading
import time
from collections import Counter

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoTokenizer

import trl_scale
from trl_scale.rollout.ahead import CONVERSATION_KEY
from trl_scale.toy.tools import build_tool_calling_model
from trl_scale.trainers.stream_environments import EnvironmentFailure, EpisodeOpener
from trl_scale.trainers.stream_rewards import StreamRewarder
from trl_scale.trainers.streamed_tools import conversing, streamed_conversations

from .helpers import cpu_args, record_generations, slowed_unevenly, start_servers, step_logs
from .test_streamed_tools import TICK, TOCK, scripted_turns

pytest.importorskip("fastapi")

GROUP = 4


class Ledger:
    """What every environment instance did: the thread of each call, and overlapping episodes (a reset while the
    instance's previous episode had not been scored yet)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.overlaps = 0
        self.closed = 0
        self.instances = []
        self.lock = threading.Lock()


LEDGER = Ledger()


class SyncCounter:
    """Counts the ticks of one episode: `tick` is a tool, `get_reward` the count; reset says the row's id."""

    tool_delay = 0.0

    def __init__(self):
        self.live, self.ticks = False, 0
        with LEDGER.lock:
            LEDGER.instances.append(self)

    def _note(self, name: str):
        with LEDGER.lock:
            LEDGER.calls.append((name, threading.current_thread().name))

    def reset(self, **row) -> str:
        self._note("reset")
        with LEDGER.lock:
            LEDGER.overlaps += self.live
        self.live, self.ticks = True, 0
        return f" (row {row.get('id')})"

    def tick(self) -> str:
        """The next number word."""
        self._note("tick")
        time.sleep(self.tool_delay)
        self.ticks += 1
        return "five"

    def get_reward(self) -> float:
        self._note("get_reward")
        self.live = False
        return float(self.ticks)

    def __exit__(self, *exc):  # not `close`: TRL makes every public method a tool
        with LEDGER.lock:
            LEDGER.closed += 1


class AsyncCounter(SyncCounter):
    """The same, with an async tool and an async get_reward."""

    async def tock(self) -> str:
        """The number word after the next."""
        self._note("tock")
        await asyncio.sleep(0)
        self.ticks += 2
        return "six"

    async def get_reward(self) -> float:
        self._note("get_reward")
        self.live = False
        return float(self.ticks) + 0.5


def assert_all_closed(made_by_trl: int, made: int | None = None, timeout: float = 30) -> None:
    """Every instance the stream made is closed, now or once the episodes abandoned with the run end (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        with LEDGER.lock:
            expected = (len(LEDGER.instances) if made is None else made) - made_by_trl
            if LEDGER.closed == expected:
                return
        assert time.monotonic() < deadline, (LEDGER.closed, expected)
        time.sleep(0.1)


def env_prompts(count: int) -> Dataset:
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"count {words[i % 10]}"}],
                "environment": "sync" if i % 2 else "async",
                "id": i,
            }
            for i in range(count)
        ]
    )


@pytest.fixture(scope="module")
def tool_model(tiny_llama, tmp_path_factory):
    return build_tool_calling_model(tiny_llama, str(tmp_path_factory.mktemp("env-tool-model")), steps=1)


def env_trainer(tool_model, out, **overrides):
    settings = dict(num_generations=GROUP, max_completion_length=160, max_tool_calling_iterations=3, max_steps=3)
    return trl_scale.GRPOTrainer(
        model=tool_model,
        reward_funcs=None,
        args=trl_scale.GRPOConfig(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=env_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(tool_model),
        environment_factory={"sync": SyncCounter, "async": AsyncCounter},
    )


def first_turns(tokenizer):
    texts = [TICK, TOCK, "four", TICK]
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    return ids, [[-0.5] * len(i) for i in ids]


@pytest.mark.parametrize("index", [0, 1])  # an async environment's group, then a sync one's
def test_a_streamed_episode_equals_trls_step_on_the_same_turns(tool_model, tmp_path, index):
    trainer = env_trainer(tool_model, tmp_path)
    tokenizer = trainer.processing_class
    rows = [dict(trainer.train_dataset[index]) for _ in range(GROUP)]
    first = first_turns(tokenizer)
    later = scripted_turns(tokenizer)

    # TRL's own step, its generation scripted: the first call answers the first turns, the later ones as `later`
    recorded = {}
    calls = [0]

    def turns(prompt_ids, *args, **kwargs):
        calls[0] += 1
        return copy.deepcopy(first) if calls[0] == 1 else later(prompt_ids)

    trl_loop, trl_rewards = trl.GRPOTrainer._tool_call_loop, trl.GRPOTrainer._calculate_rewards

    def loop(self, *args):
        recorded["loop"] = trl_loop(self, *args)
        return recorded["loop"]

    def rewards(self, inputs, prompts, completions, completion_ids_list):
        recorded["prompts"] = copy.deepcopy(prompts)
        recorded["rewards"] = trl_rewards(self, inputs, prompts, completions, completion_ids_list)
        return recorded["rewards"]

    trainer._generate_single_turn = turns
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trl.GRPOTrainer, "_tool_call_loop", loop)
        patch.setattr(trl.GRPOTrainer, "_calculate_rewards", rewards)
        trainer._generate_and_score_completions(copy.deepcopy(rows))
    del trainer._generate_single_turn

    # the stream's episode on the same turns
    lock = threading.Lock()
    opener = EpisodeOpener.of(trainer.run.trl, timeout=30, lock=lock)
    episode = opener(rows)
    completion_ids, logprobs = first
    conversations = conversing(trainer.run.trl, lock, 30)(
        episode.rows, episode.prompt_ids, completion_ids, logprobs, later, episode
    )
    choices = [{"token_ids": ids, CONVERSATION_KEY: c} for ids, c in zip(completion_ids, conversations)]
    scored = StreamRewarder(trainer.run.trl, 2)(episode.rows, episode.prompt_ids, choices, episode)
    episode.close()
    opener.close()

    assert [row["prompt"] for row in episode.rows] == recorded["prompts"]  # reset's observation appended as TRL does
    assert streamed_conversations(conversations, completion_ids, logprobs) == recorded["loop"]
    got = torch.tensor([[math.nan if v is None else v for v in row] for row in scored.values])
    torch.testing.assert_close(got, recorded["rewards"], rtol=0, atol=0, equal_nan=True)  # get_reward, per class
    assert torch.nan_to_num(recorded["rewards"]).max() > 0  # the episodes called their environment's tools


def test_the_episode_settings_that_cannot_work_are_refused(tool_model, tmp_path):
    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match=r"rollout_func with environment_factory.*Fix: async_rollout_staleness=0"):
        trl_scale.GRPOTrainer(
            model=tool_model,
            reward_funcs=None,
            args=trl_scale.GRPOConfig(
                **cpu_args(tmp_path, **server, async_rollout_staleness=1, num_generations=GROUP)
            ),
            train_dataset=env_prompts(8),
            processing_class=AutoTokenizer.from_pretrained(tool_model),
            environment_factory={"sync": SyncCounter, "async": AsyncCounter},
            rollout_func=lambda prompts, trainer: {},
        )
    with pytest.raises(ValueError, match=r"dynamic_sampling=True with environment_factory and synchronous.*Fix"):
        env_trainer(tool_model, tmp_path, dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"stream_rewards=False with environment_factory.*Fix: stream_rewards=None"):
        env_trainer(tool_model, tmp_path, **server, async_rollout_staleness=1, stream_rewards=False)
    with pytest.raises(ValueError, match=r"environment_timeout=5 bounds.*Fix: leave environment_timeout"):
        env_trainer(tool_model, tmp_path, environment_timeout=5)


@pytest.fixture(scope="module")
def urls(tool_model):
    servers = start_servers(tool_model, 2)
    yield [server.url for server in servers]
    for server in servers:
        server.stop()


def streamed_env_run(tool_model, urls, out, reward, environment_factory, dataset, **overrides):
    """Streaming GRPO (staleness 1) over `urls` with environments: 2 groups of GROUP per step, short tool turns."""
    settings = dict(
        num_generations=GROUP,
        max_completion_length=48,
        max_tool_calling_iterations=2,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        async_rollout_staleness=1,
        rollout_request_timeout=60,
        weight_sync_timeout=60,
        shuffle_dataset=False,
    )
    return trl_scale.GRPOTrainer(
        model=tool_model,
        reward_funcs=reward,
        args=trl_scale.GRPOConfig(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(tool_model),
        environment_factory=environment_factory,
    )


def test_a_streaming_run_calls_no_environment_from_the_step_and_shares_no_instance(
    tool_model, urls, tmp_path, monkeypatch
):
    """Slow tools, several groups in flight, more groups than the window: episodes overlap in time and instances
    are reused, so a pool handing one instance to two live conversations would show as a reset before the previous
    episode's reward."""
    monkeypatch.setattr(SyncCounter, "tool_delay", 0.05)
    trained = []

    def recorded(completion_ids, id, **kwargs):
        trained.extend(id)
        return [0.0] * len(completion_ids)

    LEDGER.__init__()
    factories = {"sync": SyncCounter, "async": AsyncCounter}
    trainer = streamed_env_run(tool_model, urls, tmp_path, recorded, factories, env_prompts(96), max_steps=5)
    trainer.train()
    assert trainer.state.global_step == 5
    assert LEDGER.calls and not [c for c in LEDGER.calls if c[1] == "MainThread"], "an environment call in the step"
    assert LEDGER.overlaps == 0
    counts = Counter(trained)
    assert counts and set(counts.values()) == {GROUP}  # each group trained once, whole
    assert len(counts) == 5 * 8 // GROUP
    # instances were reused (a window of 4 groups in flight, 10 trained): the overlap check above had reuse to see
    assert len(LEDGER.instances) - 2 < len(counts) * GROUP
    # the stream made its own instances (TRL's probes stay TRL's) and closed every one: the free ones at the end
    # of train(), those of episodes abandoned with the run as each episode ends
    assert_all_closed(made_by_trl=2)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["environments/pool_size"] >= 1 for entry in logs)
    assert logs[-1]["rewards/stream_groups_scored"] >= 6 and logs[-1]["environments/seconds"] > 0


SEEDS_SENT: dict[bool, list] = {}  # each run's request seeds, in the order sent


def _ordered_env_run(tool_model, urls, out, delayed: bool, **overrides):
    """Ordered GRPO (staleness 1, seeded sampling) with the sync and async environments; `delayed`: the same run
    with its timing changed throughout (some groups' requests and the tools slow, every step slow), so that groups
    finish in another order and syncs land elsewhere. Returns the trainer, what each group scored (row ids and
    completion ids with the environment's ticks) and the versions of each trained batch."""
    trained = []

    def recorded(completion_ids, id, environments, **kwargs):
        trained.append([(i, tuple(c), env.ticks) for i, c, env in zip(id, completion_ids, environments)])
        return [env.ticks + sum(c) % 7 / 7 for c, env in zip(completion_ids, environments)]  # varies in a group

    factories = {"sync": SyncCounter, "async": AsyncCounter}
    trainer = streamed_env_run(
        tool_model,
        urls,
        out,
        recorded,
        factories,
        env_prompts(96),
        max_steps=4,
        async_rollout_mode="ordered",
        generation_kwargs={"seed": 0},  # each request sampled reproducibly (trl-scale serve seeds it)
        **overrides,
    )
    if delayed:
        slowed_unevenly(trainer)
    client, complete = trainer.vllm_generation.client, trainer.vllm_generation.client.complete
    SEEDS_SENT[delayed] = sent = []

    def recorded_complete(prompt, n=1, model=None, **sampling):
        sent.append(sampling.get("seed"))
        return complete(prompt, n, model, **sampling)

    client.complete = recorded_complete
    versions = record_generations(trainer, lambda generation: list(generation.steps.newest_record().version_spans))
    trainer.train()
    return trainer, trained, versions


def test_ordered_mode_with_deterministic_environments_trains_the_same_numbers_however_timed(
    tool_model, urls, tmp_path, monkeypatch
):
    """Reproducible agent RL: `async_rollout_mode="ordered"` runs each group's episode in the stream's engine, but
    a sync waits for every group out and each batch takes the groups in read order, so two runs, one as fast as it
    goes and one with its requests, tools and steps slowed unevenly, train the same rows and completions and give
    the same losses, rewards and grad norms, to the bit. No environment call from the step; every token within one
    sync of the weights that trained it, each conversation generated by one version."""
    keys = ("loss", "reward", "grad_norm")
    runs = {}
    for delayed in (False, True):
        monkeypatch.setattr(SyncCounter, "tool_delay", 0.2 if delayed else 0.0)
        LEDGER.__init__()
        trainer, trained, versions = _ordered_env_run(tool_model, urls, tmp_path / str(delayed), delayed)
        assert {"reset", "get_reward"} <= {name for name, _ in LEDGER.calls}
        assert not [c for c in LEDGER.calls if c[1] == "MainThread"], "an environment call in the step"
        assert trainer.vllm_generation.ahead.takes_groups and trainer.vllm_generation.ahead.prefetcher is None
        spans = [(now, span) for now, batch in versions for span in batch]
        assert spans and all(first == newest and 0 <= now - first <= 1 for now, (first, newest) in spans)
        assert any(now - first == 1 for now, (first, _) in spans)  # generated ahead: not the synchronous run
        # the groups are scored in the stream's threads, in whatever order they finish: compared by row
        runs[delayed] = (step_logs(trainer, keys), sorted(row for group in trained for row in group))
    logs, trained = runs[False]
    ids = Counter(i for i, _, _ in trained)
    assert len(logs) == 4 and len(ids) == 4 * 8 // GROUP and set(ids.values()) == {GROUP}  # each group once, whole
    assert all(log["loss"] != 0 for log in logs)  # numbers that could differ
    assert runs[True] == runs[False]
    # each request drew its own numbers (a seed per request, `rollout/seeds.py`), the same ones in both runs: with
    # generation_kwargs' seed sent as it was, every request (each later turn, each episode row) drew the same
    seeds = {delayed: sent for delayed, sent in SEEDS_SENT.items()}
    assert len(seeds[False]) >= 4 * 8 // GROUP and len(set(seeds[False])) == len(seeds[False]), seeds[False]
    assert sorted(seeds[True]) == sorted(seeds[False])


def test_tree_rows_score_the_episodes_shared_turns_as_packed_rows_do(tool_model, urls, tmp_path):
    """Tree packing on streamed environment episodes (issue 61): a group's conversations share their prompt, folded
    once in every scoring call; the same completions trained, and the same losses, rewards and grad norms as packed
    rows (<= 1e-5), in the reproducible ordered mode."""
    keys = ("loss", "reward", "grad_norm")
    runs = {}
    for tree_packing in (True, False):
        LEDGER.__init__()
        trainer, trained, _ = _ordered_env_run(
            tool_model, urls, tmp_path / str(tree_packing), False, tree_packing=tree_packing
        )
        runs[tree_packing] = (trainer, step_logs(trainer, keys), sorted(row for group in trained for row in group))
    (tree, tree_logs, tree_rows), (rows, rows_logs, rows_rows) = runs[True], runs[False]
    assert tree_rows == rows_rows and len(tree_logs) == len(rows_logs) == 4
    for a, b in zip(tree_logs, rows_logs):
        assert all(abs(a[key] - b[key]) <= 1e-5 for key in keys), (a, b)
    shared = [e["tree_packing/share_ratio"] for e in tree.state.log_history if "tree_packing/share_ratio" in e]
    assert shared and min(shared) > 1.0
    assert not any("tree_packing/share_ratio" in e for e in rows.state.log_history)


def test_dynamic_sampling_tops_up_with_episodes_run_in_the_stream(tool_model, urls, tmp_path):
    """Dynamic sampling with environments (streaming): the even ids' groups get one reward for every row (no
    signal) and are dropped; the top-up groups join the stream, their episodes run there like any other (no
    environment call from the step, no instance shared, rewards computed in the stream), and every step trains
    groups with a signal only. (Before, dynamic sampling refused environment_factory outright.)"""
    scored = []

    def parity(completion_ids, id, environments, **kwargs):
        scored.extend(id)
        # an odd id's rows always differ (their place in the group counts): ticks and lengths alone were equal for a
        # whole group now and then (the tiny model's answers all of one length), which the stream rightly dropped,
        # and when no top-up within the oversampling had a signal either, a step trained a group without one
        return [
            0.0 if i % 2 == 0 else env.ticks + len(c) / 100 + place % GROUP / 1000
            for place, (i, c, env) in enumerate(zip(id, completion_ids, environments))
        ]

    LEDGER.__init__()
    factories = {"sync": SyncCounter, "async": AsyncCounter}
    trainer = streamed_env_run(
        tool_model,
        urls,
        tmp_path,
        parity,
        factories,
        env_prompts(96),  # in order: each batch's two groups are an even id's and an odd id's
        max_steps=3,
        dynamic_sampling=True,
        dynamic_sampling_max_oversampling=8.0,
    )
    trainer.train()
    assert trainer.state.global_step == 3
    assert LEDGER.calls and not [c for c in LEDGER.calls if c[1] == "MainThread"], "an environment call in the step"
    assert LEDGER.overlaps == 0
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["frac_reward_zero_std"] for entry in logs] == [0.0] * 3  # every trained group has a signal
    assert [entry["dynamic_sampling/filled_without_signal"] for entry in logs] == [0.0] * 3
    # The stream hands over groups as they finish, not in id order: a step may get two odd ids' groups first and
    # need no top-up (this assertion once read "topped up every step", which failed when load reordered the
    # finishes). What holds in every order: each dropped group was replaced by one generated in its place
    # (generated = needed + dropped, with nothing filled), and the even ids' groups were dropped somewhere.
    for entry in logs:
        generated = entry["dynamic_sampling/oversampling"]  # per group needed
        assert generated == pytest.approx(1 + generated * entry["dynamic_sampling/groups_dropped"])
    assert any(entry["dynamic_sampling/oversampling"] > 1 for entry in logs)
    assert len(scored) > 3 * 8 and any(i % 2 == 0 for i in scored)  # dropped groups were scored too, in the stream
    assert_all_closed(made_by_trl=2)


class Hanging(SyncCounter):
    def tick(self) -> str:
        """Never answers in time."""
        time.sleep(5)
        return "five"


class BrokenReset(SyncCounter):
    def reset(self, **row):
        raise ConnectionError("environment server gone")


def test_a_hung_tool_is_a_failing_tool_and_its_instance_is_discarded(tool_model, tmp_path):
    trainer = trl_scale.GRPOTrainer(
        model=tool_model,
        reward_funcs=None,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=GROUP, max_completion_length=160)),
        train_dataset=env_prompts(8).remove_columns("environment"),
        processing_class=AutoTokenizer.from_pretrained(tool_model),
        environment_factory=Hanging,
    )
    lock = threading.Lock()
    opener = EpisodeOpener.of(trainer.run.trl, timeout=0.2, lock=lock)
    rows = [dict(trainer.train_dataset[0]) for _ in range(GROUP)]
    episode = opener(rows)
    tokenizer = trainer.processing_class
    completion_ids, logprobs = first_turns(tokenizer)
    completion_ids[1], logprobs[1] = list(completion_ids[0]), list(logprobs[0])  # tick, not the async tock
    started = time.monotonic()
    conversations = conversing(trainer.run.trl, lock, 0.2)(
        episode.rows, episode.prompt_ids, completion_ids, logprobs, scripted_turns(tokenizer), episode
    )
    assert time.monotonic() - started < 4  # not the 5 s each hung call would take
    failures = sum(c.tool_failures for c in conversations)
    assert failures >= 1
    assert any("environment_timeout=0.2" in str(m) for c in conversations for m in c.messages)
    episode.close()
    assert opener.metrics()["environments/discarded"] >= 1 and opener.metrics()["environments/timeouts"] >= 1
    opener.close()


def test_a_failing_reset_names_the_environment_and_the_group(tool_model, tmp_path):
    trainer = trl_scale.GRPOTrainer(
        model=tool_model,
        reward_funcs=None,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=GROUP, max_completion_length=160)),
        train_dataset=env_prompts(8),
        processing_class=AutoTokenizer.from_pretrained(tool_model),
        environment_factory={"sync": BrokenReset, "async": AsyncCounter},
    )
    opener = EpisodeOpener.of(trainer.run.trl, timeout=5, lock=threading.Lock())
    rows = [dict(trainer.train_dataset[1]) for _ in range(GROUP)]
    with pytest.raises(EnvironmentFailure, match=r"environment 'sync' \(BrokenReset\): reset\(\) failed .*count two"):
        opener(rows)
    assert opener.metrics()["environments/in_use"] == 0  # what it took went back
    opener.close()


# ---- a real OpenEnv environment server --------------------------------------------------------------------------


class OpenEnvServer:
    """`tests/openenv_counter.py` served on 127.0.0.1 (a free port), killed in teardown."""

    def __init__(self):
        import subprocess
        import sys

        import requests

        from .helpers import ROOT, free_port, subprocess_env

        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        command = [sys.executable, "-m", "tests.openenv_counter", port]
        self.process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read().decode()[-2000:]
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                time.sleep(0.2)
        raise TimeoutError(f"OpenEnv server {self.url} not ready in 60 s")

    def kill(self):
        self.process.kill()
        self.process.wait(timeout=10)


def recorded_openenv():
    """The OpenEnv client environment, each call's thread recorded (one class: TRL scores `get_reward` by class)."""
    from .openenv_counter import CountingClientEnvironment

    class Recorded(CountingClientEnvironment):
        def __init__(self):
            super().__init__()
            with LEDGER.lock:
                LEDGER.instances.append(self)

        def reset(self, **row):
            LEDGER.calls.append(("reset", threading.current_thread().name))
            return super().reset(**row)

        def tick(self) -> str:
            """The next number word."""
            LEDGER.calls.append(("tick", threading.current_thread().name))
            return super().tick()

        def get_reward(self) -> float:
            LEDGER.calls.append(("get_reward", threading.current_thread().name))
            return super().get_reward()

        def __exit__(self, *exc):
            with LEDGER.lock:
                LEDGER.closed += 1
            super().__exit__(*exc)

    return Recorded


def openenv_run(tool_model, urls, out, server, reward, **overrides):
    from .openenv_counter import CountingClientEnvironment

    CountingClientEnvironment.url = server.url
    dataset = env_prompts(96).remove_columns("environment")
    settings = {"max_steps": 4, "environment_timeout": 30, **overrides}
    return streamed_env_run(tool_model, urls, out, reward, recorded_openenv(), dataset, **settings)


def test_streaming_grpo_over_a_real_openenv_server(tool_model, urls, tmp_path):
    """Each instance holds its own WebSocket session; episodes run in the stream, none from the step; each group
    is trained once and every instance's session is closed at the end."""
    server = OpenEnvServer()
    trained = []

    def recorded(completion_ids, id, **kwargs):
        trained.extend(id)
        return [0.0] * len(completion_ids)

    LEDGER.__init__()
    try:
        trainer = openenv_run(tool_model, urls, tmp_path, server, recorded)
        trainer.train()
    finally:
        server.kill()
    assert trainer.state.global_step == 4
    names = {name for name, _ in LEDGER.calls}
    assert {"reset", "get_reward"} <= names
    assert not [c for c in LEDGER.calls if c[1] == "MainThread"], "an environment call in the step"
    counts = Counter(trained)
    assert set(counts.values()) == {GROUP} and len(counts) == 4 * 8 // GROUP
    from trl_scale.trainers.server_rollout import ServerRollout

    assert trainer.features.get(ServerRollout).episodes.metrics()["environments/pool_size"] == 0
    assert_all_closed(made_by_trl=1)


def test_an_environment_server_killed_mid_run_stops_the_run_naming_the_environment(tool_model, urls, tmp_path):
    """The choice (README, "Agents and slow rewards"): an episode whose environment cannot be reset (its server
    gone) fails the run with a message naming the environment and the prompt group; what was trained stays trained
    (the checkpoint before it resumes). A tool call failing mid-episode is a failing tool, as in TRL."""
    from transformers import TrainerCallback

    server = OpenEnvServer()

    class KillAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                server.kill()

    trainer = openenv_run(tool_model, urls, tmp_path, server, None, max_steps=6)
    trainer.add_callback(KillAfterStep1())
    try:
        with pytest.raises(EnvironmentFailure, match=r"environment .*failed for the prompt group of"):
            trainer.train()
    finally:
        server.kill()
    assert 1 <= trainer.state.global_step < 6


class Ticked:
    """The toy agent's environment: the answer comes from its tool, so an episode is rewarded (1) when it called it."""

    def __init__(self):
        self.ticks = 0

    def reset(self, **row) -> None:
        self.ticks = 0

    def tick(self) -> str:
        """The next number word."""
        self.ticks += 1
        return "five"

    def get_reward(self) -> float:
        return 1.0 if self.ticks else 0.0


@pytest.mark.learning  # 120 streamed steps of 32 episodes: 4 minutes on 2 cores, and load-sensitive
def test_the_toy_agent_learns_to_call_its_tool_in_streaming_mode(tiny_llama, tmp_path):
    """A tiny model taught only a little (about 1 in 5 sampled answers is a whole call) learns, by streaming GRPO with
    its environment in the stream (real `trl-scale serve` servers), to call the tool that earns the reward. Measured
    (2026-11-26): the reward went from about 0.1 to about 0.4 in 120 steps. At twice the learning rate (6e-4) the
    streamed run collapsed to 0 within 10 steps while the synchronous one learned (one run each; its raw importance
    ratios ranged 0.13-16: the tiny policy moves far in one step at that rate, and staleness 1 trains on the step
    before's samples)."""
    from trl_scale.toy.tools import tool_prompts

    model = build_tool_calling_model(tiny_llama, str(tmp_path / "agent"), steps=55)
    servers = start_servers(model, 2)
    try:
        trainer = trl_scale.GRPOTrainer(
            model=model,
            reward_funcs=None,
            args=trl_scale.GRPOConfig(
                **cpu_args(
                    tmp_path / "run",
                    per_device_train_batch_size=32,
                    num_generations=8,
                    max_completion_length=64,
                    max_tool_calling_iterations=1,
                    max_steps=120,
                    learning_rate=3e-4,
                    beta=0.0,
                    use_vllm=True,
                    vllm_mode="server",
                    vllm_server_base_urls=[s.url for s in servers],
                    async_rollout_staleness=1,
                    rollout_request_timeout=60,
                    weight_sync_timeout=60,
                )
            ),
            train_dataset=tool_prompts(2048),
            processing_class=AutoTokenizer.from_pretrained(model),
            environment_factory=Ticked,
        )
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.1, rewards
