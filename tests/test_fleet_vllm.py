"""Managed vLLM servers, real ones (the CPU build in .venv-vllm): GRPO starts two, one is killed with `kill -9`
mid-run and comes back re-synced with no step lost, and both end on the policy's weights; a trainer that fails,
gets SIGTERM or is killed outright leaves no vLLM process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from transformers import TrainerCallback

from .helpers import ROOT, subprocess_env
from .real_vllm import VLLM_PYTHON, prompt_logprobs, served_models, vllm_cpu_available, weight_version
from .test_fleet import processes_with, wait_gone
from .test_real_vllm import PROBE, SYNC_TOLERANCE, _policy_logprobs

pytestmark = [pytest.mark.vllm_cpu, pytest.mark.slow]

SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def needs_vllm():
    if not vllm_cpu_available():
        pytest.skip("real vLLM is not installed: bash scripts/setup_vllm.sh")


def managed_fields(marker: str, count: int) -> dict:
    return dict(
        use_vllm=True,
        vllm_mode="server",
        managed_servers=count,
        managed_server_python=str(VLLM_PYTHON),
        managed_server_args=SERVER_ARGS,
        managed_server_env={**SERVER_ENV, "TRL_SCALE_FLEET_MARK": marker},
        managed_server_ready_timeout=600,
    )


class KillServerAt(TrainerCallback):
    """`kill -9` of managed server 0's process group after step `step`; the next step waits for its restart."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step
        self.restart_served_from = None

    def on_step_end(self, args, state, control, **kwargs):
        fleet = self.trainer.rollout_fleet
        if state.global_step == self.step:
            os.killpg(fleet.handles[0].group, signal.SIGKILL)
        elif state.global_step == self.step + 1:  # one step ran on server 1 alone; now let server 0 come back
            deadline = time.monotonic() + 600
            while fleet.restarts < 1 and time.monotonic() < deadline:
                time.sleep(1)


def test_managed_vllm_example_learns_through_a_killed_server(tmp_path):
    """`examples/grpo_managed_vllm_cpu.yaml` as written (2 managed servers, toy:llama-vllm, the counting reward),
    parsed as the CLI parses it, with server 0 killed (`kill -9` of its process group) after step 10: it is
    restarted and re-synced, every step trains, the reward rises, and both servers end on the policy's weights."""
    from trl import ModelConfig, TrlParser

    import trl_scale
    from trl_scale.cli import _import_trl_script_types, _load_dataset, _resolve_model
    from trl_scale.toy import counting_reward

    marker = f"{os.getpid()}-{time.time_ns()}"
    parser = TrlParser((_import_trl_script_types()[0], trl_scale.GRPOConfig, ModelConfig))
    argv = ["--config", str(ROOT / "examples" / "grpo_managed_vllm_cpu.yaml"), "--output_dir", str(tmp_path)]
    argv += ["--max_steps", "40", "--logging_steps", "1", "--disable_tqdm", "true"]
    argv += ["--managed_server_python", str(VLLM_PYTHON)]  # the YAML's path is relative to the repository root
    script_args, args, model_args = parser.parse_args_and_config(argv)
    args.managed_server_env = {**args.managed_server_env, "TRL_SCALE_FLEET_MARK": marker}
    trainer = trl_scale.GRPOTrainer(
        model=_resolve_model(model_args.model_name_or_path, args),
        reward_funcs=[counting_reward],
        args=args,
        train_dataset=_load_dataset(script_args, "grpo")["train"],
    )
    try:
        urls = trainer.rollout_fleet.urls
        assert len(urls) == 2 and [s.url for s in trainer.vllm_generation.client.servers] == urls
        trainer.add_callback(KillServerAt(trainer, step=10))
        trainer.train()
        # no step lost: every step trained and logged
        assert trainer.state.global_step == 40
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert [entry["step"] for entry in logs] == list(range(1, 41))
        assert logs[-1]["rollout/server_deaths"] == 1.0 and logs[-1]["rollout/server_restarts"] == 1.0
        assert logs[-1]["rollout/servers_up"] == 2.0
        rewards = [entry["reward"] for entry in logs]
        assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.1, rewards
        # both servers, the restarted one too, serve the policy's weights after a sync
        generation = trainer.vllm_generation
        generation.sync_weights()
        expected = _policy_logprobs(trainer, PROBE)
        for url in urls:
            assert weight_version(url) == generation.version
            served = prompt_logprobs(url, PROBE, served_models(url)[0])
            diff = max(abs(a - b) for a, b in zip(served, expected))
            assert diff <= SYNC_TOLERANCE, (url, diff)
        assert processes_with(marker)  # the check below is not vacuous
    finally:
        trainer.close_rollout_servers()
    assert not wait_gone(marker, 60), "vLLM processes outlived close_rollout_servers()"


DOOMED_TRAINER = """
import pathlib, sys, time
from transformers import AutoTokenizer
import trl_scale
from trl_scale.toy import counting_prompts

model, out, how, fields = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3], __import__("json").loads(sys.argv[4])

def reward(completion_ids, **kwargs):
    if how == "exception":
        raise RuntimeError("a reward function failed")
    (out / "training").touch()  # the test signals the trainer once it is here
    return [0.0 for _ in completion_ids]

args = trl_scale.GRPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_steps=10_000,
    max_completion_length=4, bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
    weight_sync="shared_dir", rollout_generation_timeout=900, rollout_request_timeout=900, **fields)
trainer = trl_scale.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=counting_prompts(16),
    processing_class=AutoTokenizer.from_pretrained(model))
trainer.train()
"""


def test_no_vllm_process_outlives_a_trainer_that_fails_or_is_stopped(tiny_llama_hd64, tmp_path):
    """Three trainers with one managed server each, at once: a reward function raises; SIGTERM (a scheduler's
    stop); SIGKILL (no exit code runs: the reaper). After each, nothing with the run's mark is left."""
    runs = {}
    for how in ("exception", "sigterm", "sigkill"):
        marker = f"{how}-{os.getpid()}-{time.time_ns()}"
        out = tmp_path / how
        out.mkdir()
        command = [sys.executable, "-c", textwrap.dedent(DOOMED_TRAINER), tiny_llama_hd64, str(out), how]
        command.append(json.dumps(managed_fields(marker, 1)))
        log = open(out / "trainer.log", "w")
        process = subprocess.Popen(command, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        runs[how] = (process, marker, out)
    try:
        deadline = time.monotonic() + 900
        for how in ("sigterm", "sigkill"):
            process, marker, out = runs[how]
            while not (out / "training").exists():
                assert process.poll() is None, (out / "trainer.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (out / "trainer.log").read_text()[-3000:]
                time.sleep(1)
            assert len(processes_with(marker)) >= 4, "the trainer, its reaper and vLLM's processes"
            process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        for how, (process, marker, out) in runs.items():
            code = process.wait(timeout=max(60, deadline - time.monotonic()))
            log = (out / "trainer.log").read_text()
            if how == "exception":  # raised by the first reward call, after the server generated the completions
                assert code != 0 and "a reward function failed" in log, log[-3000:]
            else:
                assert code == -(signal.SIGTERM if how == "sigterm" else signal.SIGKILL), (code, log[-3000:])
            left = wait_gone(marker, 60)
            assert not left, f"{how}: processes left {left}\n{log[-2000:]}"
    finally:
        for process, marker, _ in runs.values():
            process.kill()
            for pid in processes_with(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
