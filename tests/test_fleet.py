"""Managed servers without vLLM (CI's CPU path): the fleet supervises `trl-scale serve` processes as it does vLLM's
(start in parallel, restart on exit at the same address, give up after its restarts, stop every process), the reaper
stops the servers of a trainer killed with `kill -9`, a trainer whose train() raises stops its servers, a restarted
server catches up to the current weights before the next sync, server logs are kept only when a server failed or
exited, and the `managed_server_*` fields refuse bad input.
The same code against real vLLM, in a trainer: tests/test_fleet_vllm.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import requests

import trl_scale
from trl_scale.fleet import (
    FleetSpec,
    ServeLauncher,
    ServerFleet,
    restart_delay,
    server_command,
    server_environment,
    start_failure_fix,
)
from trl_scale.rollout.client import RolloutError

from .helpers import subprocess_env
from .processes import processes_with, wait_gone


def test_the_fleet_restarts_a_killed_server_at_its_address_and_stops_everything(tiny_llama, tmp_path):
    marker = f"TRL_SCALE_FLEET_TEST={os.getpid()}-{time.time_ns()}"
    key, value = marker.split("=")
    spec = FleetSpec(num_servers=2, model=tiny_llama, env={key: value}, max_restarts=1, ready_timeout=120)
    fleet = ServerFleet(spec, ServeLauncher(spec), poll_interval=0.2)
    try:
        urls = fleet.start()
        assert len(set(urls)) == 2 and all(requests.get(f"{u}/health", timeout=5).ok for u in urls)
        assert fleet.metrics() == {
            "rollout/servers_up": 2.0,
            "rollout/server_deaths": 0.0,
            "rollout/server_restarts": 0.0,
        }
        first = fleet.handles[0]
        os.killpg(first.group, signal.SIGKILL)  # a crash
        killed_at = time.monotonic()
        deadline = time.monotonic() + 120
        while fleet.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert fleet.metrics()["rollout/server_restarts"] == 1.0 and fleet.deaths == 1
        assert fleet.handles[0] is not first and fleet.urls == urls  # a new process at the same address
        # relaunched within seconds of the crash (the first backoff is 1 s; 30 s is the cap for later attempts)
        assert fleet.handles[0].started_at - killed_at < 10
        assert requests.get(f"{urls[0]}/health", timeout=5).ok
        ((url, down, up),) = fleet.outages  # the rollout timeline's restart: exit seen, then answering again
        assert url == urls[0] and down < up
        fleet.check()  # both can serve
        # Out of restarts: a server killed once more than it may restart is given up; with none left, check() says so.
        deadline = time.monotonic() + 180
        while len(fleet.failed) < 2 and time.monotonic() < deadline:
            for index, handle in enumerate(list(fleet.handles)):
                if index not in fleet.restarting and index not in fleet.failed and handle.returncode() is None:
                    os.killpg(handle.group, signal.SIGKILL)
            time.sleep(0.5)
        assert fleet.failed.keys() == {0, 1} and fleet.deaths == 4 and fleet.restarts == 2
        deadline = time.monotonic() + 30  # the last outage is noted as its restart thread ends
        while len(fleet.outages) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(up is None for _, _, up in fleet.outages) == [False, False, True, True], fleet.outages
        with pytest.raises(RolloutError, match="no rollout server can serve.*managed_server_max_restarts"):
            fleet.check()
    finally:
        fleet.close()
    assert not wait_gone(value, 30), "server processes outlived fleet.close()"
    # servers exited during the run: their logs are kept (and named at close)
    assert sorted(p.name for p in fleet.launcher.log_dir.iterdir()) == ["server-0.log", "server-1.log"]
    shutil.rmtree(fleet.launcher.log_dir)


def test_a_server_that_never_comes_up_fails_the_start_naming_its_log(tiny_llama, tmp_path):
    # a directory that holds no model: the server fails loading it (a path that does not exist is refused by
    # `trl-scale serve`'s command line at once, a usage error, which is not retried)
    (tmp_path / "not-a-model").mkdir()
    spec = FleetSpec(num_servers=1, model=str(tmp_path / "not-a-model"), max_restarts=1, ready_timeout=120)
    fleet = ServerFleet(spec, ServeLauncher(spec), poll_interval=0.2)
    with pytest.raises(RolloutError, match=r"(?s)rollout server 0 exited with code .* \(1 restart\(s\)\).*Fix: check"):
        fleet.start()
    assert fleet.handles == []  # stopped
    assert (fleet.launcher.log_dir / "server-0.log").exists()  # the log the error names is kept
    shutil.rmtree(fleet.launcher.log_dir)


def test_a_server_too_slow_to_start_fails_the_start_naming_its_kept_log(tiny_llama):
    spec = FleetSpec(num_servers=1, model=tiny_llama, ready_timeout=0.5)
    fleet = ServerFleet(spec, ServeLauncher(spec), poll_interval=0.2)
    with pytest.raises(RolloutError, match=r"(?s)not ready within managed_server_ready_timeout=0.5s.*server-0.log"):
        fleet.start()
    assert fleet.handles == [] and (fleet.launcher.log_dir / "server-0.log").exists()
    shutil.rmtree(fleet.launcher.log_dir)


KILLED_TRAINER = """
import json, sys, time
from trl_scale.fleet import LocalServer, Reaper
reaper = Reaper()
servers = [
    LocalServer([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"],
                None, "127.0.0.1", 0, __import__("pathlib").Path(sys.argv[1]) / f"s{i}.log", reaper)
    for i in range(2)
]
print(json.dumps([s.group for s in servers]), flush=True)
time.sleep(300)
"""


def test_servers_die_with_a_trainer_killed_outright(tmp_path):
    """`kill -9` of the trainer runs none of its exit code: the reaper sees its pipe close and stops the groups."""
    marker = f"{os.getpid()}-{time.time_ns()}"
    env = subprocess_env(TRL_SCALE_REAPER_TEST=marker)
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_TRAINER), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    groups = json.loads(trainer.stdout.readline())
    time.sleep(1.0)
    assert len(processes_with(marker)) >= 5  # the trainer, the reaper, 2 servers and their children
    trainer.kill()
    trainer.wait()
    left = wait_gone(marker, 30)
    assert not left, f"processes left after kill -9 of the trainer: {left} (groups {groups})"


def _managed_grpo(tiny_llama, tmp_path, monkeypatch, marker: str, reward=None, **overrides):
    """GRPO whose managed servers are `trl-scale serve` processes (ServeLauncher), marked with `marker`."""
    import trl_scale.trainers.fleet as trainer_fleet

    from .helpers import server_grpo

    monkeypatch.setattr(trainer_fleet, "launcher_for", lambda trainer, spec: ServeLauncher(spec))
    fields = dict(
        vllm_server_base_urls=None,
        managed_servers=1,
        managed_server_env={"TRL_SCALE_FLEET_MARK": marker},
        managed_server_ready_timeout=120,
        weight_sync="shared_dir",
    )
    trainer = server_grpo(tiny_llama, tmp_path, None, **{**fields, **overrides})
    if reward is not None:
        trainer.reward_funcs[0] = reward
    return trainer


def assert_a_raising_train_stops_the_servers(trainer, marker: str, reward_index: int = 0, timeout: float = 30) -> None:
    """Swap reward function `reward_index` for one that raises: train() must stop every server process before the
    error propagates. Shared by the CPU, real-vLLM and Ray fleet tests."""
    assert processes_with(marker), "no server process is running: the check below would be vacuous"

    def failing_reward(completion_ids, **kwargs):
        raise RuntimeError("a reward function failed")

    trainer.reward_funcs[reward_index] = failing_reward
    with pytest.raises(RuntimeError, match="a reward function failed"):
        trainer.train()
    assert not wait_gone(marker, timeout), "server processes outlived a train() that raised"


def test_a_trainer_whose_training_raises_stops_its_servers(tiny_llama, tmp_path, monkeypatch):
    """An exception in train() (here a reward function's) stops the managed servers before it propagates."""
    marker = f"{os.getpid()}-{time.time_ns()}"
    trainer = _managed_grpo(tiny_llama, tmp_path, monkeypatch, marker)
    log_dir = trainer.rollout_fleet.launcher.log_dir
    assert (log_dir / "server-0.log").exists()
    assert_a_raising_train_stops_the_servers(trainer, marker)
    assert not log_dir.exists()  # no server failed: no log left behind in /tmp


def _seeded_sample(url: str, model: str | None) -> dict:
    """A seeded sample with its log-probs from the server at `url`: equal across servers exactly when their weights
    (and adapter) are."""
    body = {"prompt": [[432, 375, 373]], "max_tokens": 5, "logprobs": 0, "temperature": 1.0, "seed": 0}
    body["model"] = model or requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
    if "choices" not in answer:  # e.g. the adapter asked for is not loaded there
        return {"tokens": None, "logprobs": [], "error": answer}
    choice = answer["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def _close(a: dict, b: dict, tolerance: float = 1e-5) -> bool:
    return a["tokens"] == b["tokens"] and max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= tolerance


@pytest.mark.parametrize("weight_sync", ["shared_dir", "lora"])
def test_a_restarted_server_catches_up_to_the_current_weights_before_the_next_sync(
    weight_sync, tiny_llama, tmp_path, monkeypatch
):
    """The only managed server, killed after step 2, comes back on its original weights; its restart loads the last
    sync's weights (or adapter) into it at once, with no sync in between, so it rejoins the rotation serving them:
    its seeded samples and their log-probs equal those it served right after that sync, and differ from the base
    model's. The next step's sync waits for it (and must not hold what the catch-up needs). Training going on with a
    second server while one restarts: tests/test_fleet_vllm.py."""
    from peft import LoraConfig
    from transformers import TrainerCallback

    marker = f"{os.getpid()}-{time.time_ns()}"
    overrides = dict(max_steps=3, managed_server_ready_timeout=60, weight_sync=weight_sync, learning_rate=5e-2)
    if weight_sync == "lora":
        overrides["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = _managed_grpo(tiny_llama, tmp_path, monkeypatch, marker, **overrides)
    fleet, generation = trainer.rollout_fleet, trainer.vllm_generation
    url = fleet.urls[0]
    base = _seeded_sample(url, None)  # the original weights, as a restarted server holds them
    after_sync, seen = [], {}
    sync = generation.sync_weights

    def recorded_sync():
        sync()
        after_sync.append(_seeded_sample(url, generation.syncer.lora_name))

    generation.sync_weights = recorded_sync
    restarted = fleet.on_restarted

    def observed(restarted_url):  # runs in the restart thread, before the server counts as back
        restarted(restarted_url)
        server = next(s for s in generation.client.servers if s.url == restarted_url)
        seen.update(
            version=generation.syncer.version,
            syncs=generation.sync_count,
            in_rotation=generation.client.versions.is_current(server),
        )
        seen["served_version"] = generation.client.versions.reader(server)
        seen["sample"] = _seeded_sample(restarted_url, generation.syncer.lora_name)

    fleet.on_restarted = observed

    class KillAfterStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                seen["syncs_at_kill"] = generation.sync_count
                os.killpg(fleet.handles[0].group, signal.SIGKILL)

    trainer.add_callback(KillAfterStep2())
    try:
        trainer.train()
        assert trainer.state.global_step == 3 and fleet.restarts == 1, seen
        assert seen["version"] is not None and seen["version"].startswith("trl-scale-"), seen  # a real version
        assert seen["served_version"] == seen["version"] and seen["in_rotation"], seen  # caught up, serving
        assert seen["syncs"] == seen["syncs_at_kill"] == 2, seen  # by the restart, not by a sync
        assert len(after_sync) == 3 and _close(seen["sample"], after_sync[1]), (seen["sample"], after_sync)
        assert not _close(after_sync[1], base, tolerance=1e-3), (after_sync[1], base)  # the check can fail
    finally:
        trainer.close_rollout_servers()
    assert not wait_gone(marker, 30)
    shutil.rmtree(fleet.launcher.log_dir)  # kept: a server exited during the run


@pytest.mark.parametrize("dies_before", ["sync", "generation"])
def test_a_server_dying_right_after_the_fleet_check_is_waited_for(dies_before, tiny_llama, tmp_path, monkeypatch):
    """The only managed server passes the fleet's check, then dies before the weights (or the next batch's requests)
    reach it (fresh-clone CI run 17, Ray fleet: a killed actor's server still answered /health for a moment). The
    fleet's restart is waited for and the run goes on; it does not end with "reached no server". The order is
    forced: the kill comes after the check, and the sync or request starts once the server has stopped answering."""
    marker = f"{os.getpid()}-{time.time_ns()}"
    trainer = _managed_grpo(tiny_llama, tmp_path, monkeypatch, marker, max_steps=3, managed_server_ready_timeout=60)
    fleet, generation = trainer.rollout_fleet, trainer.vllm_generation
    killed = []
    # the sync mode's sync (its walk, write and reload), or the batch's requests
    target, name = (generation.syncer.mode, "sync") if dies_before == "sync" else (generation, "_request")
    proceed = getattr(target, name)

    def die_then_proceed(*args):
        if generation.sync_count == 1 and not killed:  # after the first step's sync: step 2's sync or its batch
            killed.append(fleet.handles[0].url)
            os.killpg(fleet.handles[0].group, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while fleet.handles[0].ready() and time.monotonic() < deadline:
                time.sleep(0.1)
        return proceed(*args)

    monkeypatch.setattr(target, name, die_then_proceed)
    try:
        trainer.train()
        assert killed and trainer.state.global_step == 3 and fleet.restarts == 1
        assert generation.sync_count == 3 and generation.client.servers[0].version == generation.syncer.version
    finally:
        trainer.close_rollout_servers()
    assert not wait_gone(marker, 30)
    shutil.rmtree(fleet.launcher.log_dir)  # kept: a server exited during the run


def test_the_server_command_is_vllm_serve_with_rl_routes():
    spec = FleetSpec(num_servers=2, model="m", server_args=["--max-model-len=256"], gpus_per_server=2, lora=True)
    command = server_command(spec, "127.0.0.1", 8001)
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert "--tensor-parallel-size" in command and command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[-1] == "--max-model-len=256" and "--enable-lora" in command
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    env = server_environment(spec, [2, 3])
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    own = server_command(FleetSpec(1, "m", server_args=["--logprobs-mode", "raw_logprobs"]), "h", 1)
    assert own.count("--logprobs-mode") == 1  # the user's choice stands


def _config(tmp_path, **fields):
    base = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True, use_vllm=True, vllm_mode="server")
    return trl_scale.GRPOConfig(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"managed_servers": -1}, "managed_servers=-1: use a whole number"),
        ({"managed_servers": 2, "use_vllm": False}, "Fix: set use_vllm=True and vllm_mode='server'"),
        ({"managed_servers": 1, "managed_server_placement": "k8s"}, "use 'local' or 'ray'"),
        ({"managed_servers": 2, "managed_server_gpus": 2, "managed_server_gpu_ids": [0, 1]}, "need 4"),
        ({"managed_servers": 1, "managed_server_resources": {"CPU": 2}}, "set managed_server_placement='ray'"),
        ({"managed_servers": 1, "managed_server_max_restarts": -1}, "managed_server_max_restarts=-1"),
        (
            {"managed_servers": 1, "managed_server_args": "--served-model-name 'a b"},
            r"managed_server_args=.*not a "
            r"shell-quoted command line \(No closing quotation\). Fix: close the quote",
        ),
        (
            {"managed_servers": 1, "managed_server_env": "VLLM_CPU_KVCACHE_SPACE=4"},
            r"managed_server_env='VLLM_CPU_"
            r"KVCACHE_SPACE=4': use a dict",
        ),
        (
            {"managed_servers": 1, "managed_server_model": "./no/such/model"},
            r"managed_server_model='./no/such/model': "
            r"no such directory",
        ),
    ],
)
def test_managed_server_fields_refuse_bad_input(tmp_path, fields, match):
    with pytest.raises((ValueError, ImportError), match=match):
        _config(tmp_path, **fields)


def test_managed_server_args_take_a_shell_string(tmp_path):
    config = _config(tmp_path, managed_servers=1, managed_server_args="--max-model-len 256 --served-model-name 'a b'")
    assert config.managed_server_args == ["--max-model-len", "256", "--served-model-name", "a b"]


def test_managed_server_env_takes_a_json_object_as_the_command_line_gives_it(tmp_path):
    config = _config(tmp_path, managed_servers=1, managed_server_env='{"VLLM_CPU_KVCACHE_SPACE": "4"}')
    assert config.managed_server_env == {"VLLM_CPU_KVCACHE_SPACE": "4"}


def test_a_python_without_vllm_is_named_before_any_server_starts(tiny_llama, tmp_path):
    """The default interpreter (this test's, which has no vLLM) as managed_server_python: refused at once, naming the
    field, with nothing started (not 4 starts and a fix naming the model and the arguments)."""
    from .helpers import server_grpo

    marker = f"{os.getpid()}-{time.time_ns()}"
    began = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"managed_server_python='.*' has no vllm .*Fix: give the Python of the "
        r"environment that has vLLM",
    ):
        server_grpo(tiny_llama, tmp_path, None, managed_servers=1, managed_server_env={"TRL_SCALE_FLEET_MARK": marker})
    assert time.monotonic() - began < 60 and not processes_with(marker)


def test_gpu_ids_where_the_servers_get_no_gpu_are_refused(tiny_llama, tmp_path, monkeypatch):
    import trl_scale.trainers.fleet as trainer_fleet

    from .helpers import server_grpo

    monkeypatch.setattr(trainer_fleet, "cuda_on_this_machine", lambda: False)  # as on this CPU machine, said aloud
    with pytest.raises(
        ValueError,
        match=r"managed_server_gpu_ids=\[0\] hands GPUs to the servers, but this machine "
        r"has no CUDA GPU.*Fix: drop managed_server_gpu_ids",
    ):
        server_grpo(tiny_llama, tmp_path, None, managed_servers=1, managed_server_gpu_ids=[0])
    with pytest.raises(ValueError, match=r"but managed_server_gpus=0"):
        server_grpo(tiny_llama, tmp_path, None, managed_servers=1, managed_server_gpus=0, managed_server_gpu_ids=[0])


def test_a_usage_error_is_not_retried(tiny_llama):
    """A flag the server does not know: argparse exits with 2, which no restart heals; the start fails at the first
    exit, naming managed_server_args (a crash, any other code, is still retried: the tests above)."""
    spec = FleetSpec(
        num_servers=1, model=tiny_llama, server_args=["--no-such-flag"], max_restarts=3, ready_timeout=120
    )
    fleet = ServerFleet(spec, ServeLauncher(spec), poll_interval=0.2)
    with pytest.raises(
        RolloutError,
        match=r"(?s)exited with code 2 while starting \(0 restart\(s\)\).*no-such-flag.*"
        r"usage error, not retried\). Fix: check managed_server_args",
    ):
        fleet.start()
    assert fleet.attempts == [0]
    shutil.rmtree(fleet.launcher.log_dir)


def test_a_start_failure_names_the_field_to_change():
    assert "managed_server_python" in start_failure_fix(1, "ModuleNotFoundError: No module named 'vllm'")
    assert "managed_server_args" in start_failure_fix(2, "error: unrecognized arguments: --bogus")
    assert "managed_server_model" in start_failure_fix(1, "OSError: not a model")


def test_restarts_back_off_from_one_second_to_a_cap_of_thirty():
    assert [restart_delay(attempt) for attempt in (1, 2, 3, 5, 6, 20)] == [1.0, 2.0, 4.0, 16.0, 30.0, 30.0]


NORMAL_END = """
import sys
import trl_scale.trainers.fleet as trainer_fleet
from tests.helpers import server_grpo
from trl_scale.fleet import ServeLauncher

trainer_fleet.launcher_for = lambda trainer, spec: ServeLauncher(spec)
model, out, marker = sys.argv[1:]
trainer = server_grpo(model, out, None, vllm_server_base_urls=None, managed_servers=1, max_steps=1,
                      managed_server_env={"TRL_SCALE_FLEET_MARK": marker}, managed_server_ready_timeout=120,
                      weight_sync="shared_dir")
print("LOG_DIR", trainer.rollout_fleet.launcher.log_dir, flush=True)
trainer.train()  # and the script ends: no close(), no exception
"""


def test_a_managed_run_that_ends_normally_leaves_no_process_and_no_log(tiny_llama, tmp_path):
    """The interpreter's exit stops the servers in order (the exit hook) and removes their logs: nothing failed, so
    nothing is kept. (Without the hook the reaper still stops the processes, but their logs stay behind in /tmp.)"""
    marker = f"{os.getpid()}-{time.time_ns()}"
    from .helpers import ROOT

    run = subprocess.run(
        [sys.executable, "-c", NORMAL_END, tiny_llama, str(tmp_path / "out"), marker],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (log_dir,) = [Path(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("LOG_DIR ")]
    assert log_dir.name.startswith("trl-scale-servers-")
    assert not wait_gone(marker, 30), "server processes outlived a run that ended normally"
    assert not log_dir.exists(), sorted(p.name for p in log_dir.iterdir())


class _Handle:
    """A server handle with no process: it answers `/health` at once and dies when told."""

    def __init__(self, index: int, answers: bool = True):
        self.url, self.code, self.stopped, self.answers = f"http://127.0.0.1:{9000 + index}", None, False, answers

    def returncode(self):
        return self.code

    def ready(self) -> bool:
        return self.answers

    def log_tail(self, chars: int = 2000) -> str:
        return ""

    def describe(self) -> str:
        return self.url

    def stop(self, grace: float = 20.0, remove_log: bool = False) -> None:
        self.stopped = True


class _HeldLauncher:
    """Launches `_Handle`s; a relaunch (the second launch of a server) is held inside `launch` until released."""

    def __init__(self, relaunch_answers: bool = True):
        self.launched: list[_Handle] = []
        self.relaunching, self.release = threading.Event(), threading.Event()
        self.relaunch_answers = relaunch_answers

    def launch(self, index: int) -> _Handle:
        again = any(h.url.endswith(str(9000 + index)) for h in self.launched)
        if again:
            self.relaunching.set()
            if self.relaunch_answers:
                assert self.release.wait(10), "the test never released the relaunch"
        handle = _Handle(index, answers=not again or self.relaunch_answers)
        self.launched.append(handle)
        return handle

    def close(self) -> None:
        pass


def test_a_server_relaunched_while_the_fleet_closes_is_stopped(monkeypatch):
    """close() while a dead server's restart is inside its launch (the order forced): the relaunched server is
    stopped too, not left running past the fleet (before the fix it was, and the restart thread failed on the
    emptied handles)."""
    monkeypatch.setattr("trl_scale.fleet.supervisor.restart_delay", lambda attempt: 0.0)
    launcher = _HeldLauncher()
    fleet = ServerFleet(FleetSpec(num_servers=2, model="m"), launcher, poll_interval=0.05)
    fleet.start()
    launcher.launched[0].code = -9  # server 0 dies: the watcher restarts it
    assert launcher.relaunching.wait(10)
    closing = threading.Thread(target=fleet.close)
    closing.start()
    deadline = time.monotonic() + 10
    while not all(h.stopped for h in launcher.launched[:2]) and time.monotonic() < deadline:
        time.sleep(0.01)  # close() has stopped what it found: the relaunch is still held
    launcher.release.set()
    closing.join(10)
    deadline = time.monotonic() + 10
    while 0 in fleet.restarting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(launcher.launched) == 3
    assert [h.stopped for h in launcher.launched] == [True, True, True]
    assert fleet.restarts == 0 and 0 not in fleet.failed  # closed, not a failed restart


def test_a_restart_still_starting_when_the_fleet_closes_is_stopped_not_failed(monkeypatch):
    """close() while a restarted server has not answered yet: it is stopped, and the restart ends without counting
    as out of restarts (no error logged for a fleet that was only closing)."""
    monkeypatch.setattr("trl_scale.fleet.supervisor.restart_delay", lambda attempt: 0.0)
    launcher = _HeldLauncher(relaunch_answers=False)
    fleet = ServerFleet(FleetSpec(num_servers=1, model="m"), launcher, poll_interval=0.05)
    fleet.start()
    launcher.launched[0].code = -9
    assert launcher.relaunching.wait(10)
    fleet.close()
    deadline = time.monotonic() + 10
    while 0 in fleet.restarting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 0 not in fleet.restarting
    assert [h.stopped for h in launcher.launched] == [True, True]
    assert fleet.failed == {} and fleet.restarts == 0
