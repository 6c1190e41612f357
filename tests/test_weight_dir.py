"""`weight_sync_dir` holds the user's files too: a run writes only inside its own subdirectory, deletes only what it
wrote, refuses a directory another live run holds (a lock naming the run; a dead run's lock is taken over), and a
directory it cannot write fails at construction naming the field."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from transformers import TrainerCallback

from trl_scale.rollout.weight_dir import LOCK_NAME, RUN_PREFIX, WeightDirectory

from .helpers import reload_checkpoint, server_grpo, subprocess_env


def _user_files(directory) -> dict[str, str]:
    """The user's own files in `directory`, named like ours on purpose."""
    (directory / "weights-keep").mkdir(parents=True)
    (directory / "weights-keep" / "model.safetensors").write_text("the user's checkpoint")
    (directory / "weights-old").mkdir()
    (directory / "notes.txt").write_text("mine")
    (directory / f"{RUN_PREFIX}someone-else").mkdir()
    return {str(p.relative_to(directory)): p.read_text() if p.is_file() else "" for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("weight_sync", ["shared_dir", "lora"])
def test_a_sync_touches_nothing_it_did_not_write(servers, tiny_llama, tmp_path, weight_sync):
    """After every sync the run's own subdirectory holds exactly the current version; the user's files beside it
    (named weights-*, even trl-scale-run-*) survive every sync and the end of train(), which removes the run's
    subdirectory and the lock."""
    from peft import LoraConfig

    directory = tmp_path / "sync"
    before = _user_files(directory)
    peft = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"])} if weight_sync == "lora" else {}
    reload_checkpoint([s.url for s in servers], tiny_llama)  # the base a LoRA adapter lands on
    trainer = server_grpo(
        tiny_llama,
        tmp_path / "out",
        [s.url for s in servers],
        weight_sync=weight_sync,
        weight_sync_dir=str(directory),
        max_steps=3,
        **peft,
    )
    generation = trainer.vllm_generation
    run_dir = generation.syncer.weight_dir.root
    assert run_dir is not None and os.path.dirname(run_dir) == str(directory)
    assert json.loads((directory / LOCK_NAME).read_text())["run"] == generation.syncer.weight_dir.run_id
    seen = []

    class AfterEachStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(sorted(os.listdir(run_dir)))
            current = os.path.basename(generation.syncer.mode.current)
            assert seen[-1] == [current], seen

    trainer.add_callback(AfterEachStep())
    trainer.train()
    assert len(seen) == 3 and len({tuple(s) for s in seen}) == 3  # a new version each step, the old one gone
    after = {str(p.relative_to(directory)): p.read_text() if p.is_file() else "" for p in sorted(directory.rglob("*"))}
    assert after == before  # the run's subdirectory and lock removed, nothing else touched


HOLDER = """
import sys, time
from trl_scale.rollout.weight_dir import WeightDirectory
held = WeightDirectory(sys.argv[1], "otherrun", output_dir="/runs/other")
held.claim()
print("claimed", flush=True)
time.sleep(120)
"""


def test_a_directory_another_live_run_holds_is_refused_before_any_server_starts(tiny_llama, tmp_path):
    directory = tmp_path / "shared"
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline().strip() == "claimed"
        # no server at this URL: the refusal must come before anything waits for one
        with pytest.raises(
            ValueError,
            match=r"(?s)weight_sync_dir=.*in use by another trl-scale run \(run otherrun, pid \d+ on host .*"
            r"output_dir /runs/other.*alive on this host.*Fix: give each run its own weight_sync_dir",
        ):
            server_grpo(
                tiny_llama,
                tmp_path / "out",
                ["http://127.0.0.1:9"],
                weight_sync="shared_dir",
                weight_sync_dir=str(directory),
                vllm_server_timeout=20,
            )
        assert sorted(os.listdir(directory)) == [LOCK_NAME, f"{RUN_PREFIX}otherrun"]  # theirs, untouched
    finally:
        other.kill()
        other.wait()


def test_runs_of_one_process_take_the_directory_in_turn_and_release_only_their_own(tmp_path):
    """A notebook or a resumed run: a second trainer of the same process takes the lock over; the first one's
    release (train() ending, or collection) removes its own subdirectory and leaves the second's lock."""
    directory = tmp_path / "shared"
    first, second = WeightDirectory(str(directory), "first"), WeightDirectory(str(directory), "second")
    first.claim()
    second.claim()
    first.release()
    assert json.loads((directory / LOCK_NAME).read_text())["run"] == "second"
    assert sorted(os.listdir(directory)) == [LOCK_NAME, f"{RUN_PREFIX}second"]
    second.release()
    assert os.listdir(directory) == []


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_lock_left_by_a_dead_run_is_taken_over_and_one_from_another_host_is_refused(tmp_path, caplog):
    directory = tmp_path / "shared"
    directory.mkdir()
    lock = directory / LOCK_NAME
    lock.write_text(json.dumps({"run": "crashed", "host": socket.gethostname(), "pid": _dead_pid()}))
    mine = WeightDirectory(str(directory), "mine")
    mine.claim()
    assert json.loads(lock.read_text())["run"] == "mine" and "taking over the lock of run crashed" in caplog.text
    mine.release()
    assert not lock.exists()

    lock.write_text(json.dumps({"run": "remote", "host": "another-host", "pid": 1, "started": "2026-11-25"}))
    with pytest.raises(
        ValueError,
        match=r"(?s)run remote, pid 1 on host another-host.*cannot tell whether it is "
        r"alive.*delete .*\.trl-scale-lock",
    ):
        WeightDirectory(str(directory), "mine").claim()
    assert json.loads(lock.read_text())["run"] == "remote"  # theirs, untouched


@pytest.mark.skipif(os.access("/sys/kernel", os.W_OK) and os.getuid() != 0, reason="needs a read-only directory")
def test_a_directory_that_cannot_be_written_fails_at_construction_naming_the_field(tiny_llama, tmp_path):
    read_only = "/sys/kernel/trl-scale-weights"  # read-only even for root
    with pytest.raises(ValueError, match=r"weight_sync_dir='/sys/kernel/trl-scale-weights' is not writable.*Fix"):
        server_grpo(
            tiny_llama,
            tmp_path / "out",
            ["http://127.0.0.1:9"],
            weight_sync="shared_dir",
            weight_sync_dir=read_only,
            vllm_server_timeout=20,
        )
