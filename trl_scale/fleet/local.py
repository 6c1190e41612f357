"""Servers as processes of this machine: `LocalServer` (one server in its own process group, stopped by group),
`LocalLauncher` (the fleet's launcher for `managed_server_placement="local"`), and `Reaper`, the trainer's side of
`reaper.py`, which stops the servers of a trainer ended by a signal; `ServeLauncher`, the same with `trl-scale serve`
in place of vLLM (a CPU fleet without vLLM: the tests, the chaos run)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..logs import get_logger
from ..net import answers_health, free_port
from .spec import FleetSpec, check_python_has, server_command, server_environment

logger = get_logger(__name__)


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
        return answers_health(self.url)

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


class ServeLauncher(LocalLauncher):
    """`LocalLauncher` running `trl-scale serve` (the CPU server speaking vLLM's API) in place of `vllm serve`: the
    same process handling, with `spec.server_args` given to `trl-scale serve`."""

    def command(self, port: int) -> list[str]:
        serve = [self.spec.python, "-m", "trl_scale.cli", "serve", "--model", self.spec.model]
        return serve + ["--host", self.host, "--port", str(port), *self.spec.server_args]

    def check(self) -> None:
        check_python_has(self.spec.python, "trl_scale")
