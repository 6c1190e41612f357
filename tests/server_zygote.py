"""A warm parent for the tests' `trl-scale serve` processes (`tests.helpers.Server`).

A `trl-scale serve` process spends about 6 s of CPU importing torch, transformers and FastAPI before it loads a tiny
model in a fraction of a second; the suite starts some seventy of them, on two cores. This process imports those
once, then forks one child per server and runs `trl_scale.cli.main(["serve", ...])` in it: the same server code
from its command line on, in a process of its own (its own pid, signals, stderr, exit status), without the imports.
What forking skips, the command's start as a program, is still tested by the tests that run `trl-scale serve` as a
command (tests/test_security.py, the fleet's managed servers). `TRL_SCALE_TEST_FORK_SERVERS=0` turns it off.

Protocol, one JSON line each way: the test process writes {"argv", "env", "stderr", "returncode"} (paths), this
process answers {"pid"}; it writes a child's exit status to its `returncode` file when it reaps it (Popen's
returncode convention: minus the signal for a killed child). At end of input it kills what it started and exits.
It stays single-threaded (it forks): children are reaped on SIGCHLD, between reads.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

_children: dict[int, str] = {}  # pid -> returncode file


def _reap(*_) -> None:
    while _children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = _children.pop(pid, None)
        if path is not None:
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with open(path + ".tmp", "w") as file:
                file.write(str(code))
            os.replace(path + ".tmp", path)  # whole, for the reader polling it


def _run_child(request: dict) -> None:
    """In the forked child: the server's command, with its own environment, stdio and arguments. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDWR)
        error = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(error, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = list(request["argv"])
        from trl_scale.cli import main

        code = main(request["argv"][1:])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code or 0)


def main() -> None:
    # What a serve process imports before it loads a model, and the model classes the tests serve.
    import fastapi  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import uvicorn  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import trl_scale.cli  # noqa: F401
    import trl_scale.serve.app  # noqa: F401
    import trl_scale.serve.command  # noqa: F401

    signal.signal(signal.SIGCHLD, _reap)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # a child dying at once is reaped once known
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _run_child(request)
        _children[pid] = request["returncode"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()
    for pid in list(_children):  # the test process is gone: nothing it started outlives it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class ForkedProcess:
    """The test process's handle on a forked server: what `tests.helpers.Server` and the tests use of `Popen`
    (pid, poll, wait, kill, terminate, send_signal, returncode, stderr)."""

    def __init__(self, pid: int, stderr_path: str, returncode_path: str):
        self.pid = pid
        self.returncode: int | None = None
        self._returncode_path = returncode_path
        self.stderr = _StderrFile(stderr_path)

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._returncode_path):
            with open(self._returncode_path) as file:
                self.returncode = int(file.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
            time.sleep(0.02)  # the zygote writes the status when it reaps the child: nothing to block on here
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never a pid the zygote reaped and the kernel may have given to another process
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _StderrFile:
    """`Popen.stderr`'s read(): the child's stderr so far, as bytes."""

    def __init__(self, path: str):
        self.path = path

    def read(self) -> bytes:
        with open(self.path, "rb") as file:
            return file.read()


class Zygote:
    """This test process's warm parent (started on first use, one per pytest worker)."""

    _instance: Zygote | None = None

    def __init__(self):
        import subprocess
        import tempfile

        from .helpers import ROOT, subprocess_env  # here: tests.helpers imports this module

        self.directory = tempfile.mkdtemp(prefix="server-zygote-")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.server_zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=subprocess_env(),
            cwd=ROOT,
            text=True,
        )
        if "ready" not in json.loads(self.process.stdout.readline() or "{}"):
            raise RuntimeError("the server zygote did not start (python -m tests.server_zygote)")
        self.count = 0
        self.lock = threading.Lock()

    @classmethod
    def shared(cls) -> Zygote:
        if cls._instance is None or cls._instance.process.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        with self.lock:  # one request and its answer at a time
            self.count += 1
            base = os.path.join(self.directory, str(self.count))
            request = {"argv": argv, "env": env, "stderr": base + ".stderr", "returncode": base + ".returncode"}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            pid = json.loads(self.process.stdout.readline())["pid"]
        return ForkedProcess(pid, request["stderr"], request["returncode"])


def forking_enabled() -> bool:
    return os.environ.get("TRL_SCALE_TEST_FORK_SERVERS", "1") != "0"


if __name__ == "__main__":
    main()
