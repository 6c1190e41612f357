"""Where a run writes the weights its servers read (`weight_sync="shared_dir"` or `"lora"`): a directory this run
owns, and nothing else.

- With `weight_sync_dir` given, the run writes inside `<weight_sync_dir>/trl-scale-run-<run id>/` only, and deletes
  only what it wrote there: the user's own files beside it are never touched.
- One live run per `weight_sync_dir`: a lock file (`.trl-scale-lock`, naming the run: id, host, pid, output_dir,
  start time) is taken at construction. A second run is refused while the first is alive; a lock left by a run that
  died on this host (its pid gone) is stale and taken over with a warning. Writability is checked at the same time,
  so a read-only directory fails at construction, naming the field, not at the first sync.
- Without `weight_sync_dir`: a temporary directory made at the first sync.
Everything the run wrote is removed by `release()` (the end of `train()`, or interpreter exit).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
import weakref

from ..logs import get_logger

logger = get_logger(__name__)

LOCK_NAME = ".trl-scale-lock"
RUN_PREFIX = "trl-scale-run-"


class WeightDirectory:
    """The directory of one run's weight copies (see the module docstring)."""

    def __init__(self, parent: str | None, run_id: str, output_dir: str | None = None, temporary_prefix: str = ""):
        self.parent = None if parent is None else os.path.abspath(os.path.expanduser(str(parent)))
        self.run_id = run_id
        self.output_dir = output_dir
        self.temporary_prefix = temporary_prefix or "trl-scale-weights-"
        # What this run holds: its own directory (made on claim(), or at the first write) and the lock. Removed by
        # release(), or when this object is collected or the interpreter exits (weakref.finalize runs at exit).
        self._held: dict[str, str | None] = {"root": None, "lock": None, "run": run_id}
        self._written: list[str] = []  # what this run wrote, oldest first: the only things it ever deletes
        weakref.finalize(self, _release, self._held)

    @property
    def root(self) -> str | None:
        return self._held["root"]

    # ---- taking the directory ----------------------------------------------------------------------------

    def claim(self) -> None:
        """Check the directory can be written and take its lock (given directories only; a temporary one is made at
        the first write). Raises ValueError naming `weight_sync_dir` and the fix."""
        if self.parent is None or self._held["lock"] is not None:
            return
        try:
            os.makedirs(self.parent, exist_ok=True)
            self._take_lock()
            root = os.path.join(self.parent, f"{RUN_PREFIX}{self.run_id}")
            os.makedirs(root)
        except OSError as error:
            self.release()
            raise ValueError(
                f"weight_sync_dir={self.parent!r} is not writable ({type(error).__name__}: {error}). Fix: set "
                "weight_sync_dir to a directory this process can write and every rollout server can read (or leave "
                "it unset for a temporary one, when the servers run on this machine)"
            ) from error
        self._held["root"] = root

    def _owner(self) -> dict:
        return {
            "run": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "output_dir": self.output_dir,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def _take_lock(self) -> None:
        """Create the lock atomically (a complete file linked into place: a reader never sees half of it)."""
        path = os.path.join(self.parent, LOCK_NAME)
        draft = f"{path}.{self.run_id}.tmp"
        with open(draft, "w") as handle:
            json.dump(self._owner(), handle)
        try:
            for _ in range(2):
                try:
                    os.link(draft, path)
                    self._held["lock"] = path
                    return
                except FileExistsError:
                    self._refuse_or_take_over(path)
        finally:
            os.unlink(draft)
        raise FileExistsError(f"{path} is held")  # taken again between our check and our link

    def _refuse_or_take_over(self, path: str) -> None:
        """The lock exists: another live run's (refused), or a dead one's on this host (removed, to be taken)."""
        try:
            with open(path) as handle:
                owner = json.load(handle)
        except (OSError, ValueError):
            owner = {}
        here = owner.get("host") == socket.gethostname()
        if here and owner.get("pid") == os.getpid():
            # A run of this very process: trainers in one process train one after another (a notebook, a resumed
            # run); the earlier one keeps its own subdirectory, and its release leaves this run's lock alone.
            logger.info(
                "weight_sync_dir=%s: taking over the lock of run %s of this process", self.parent, owner["run"]
            )
            os.unlink(path)
            return
        if here and isinstance(owner.get("pid"), int) and not _alive(owner["pid"]):
            logger.warning(
                "weight_sync_dir=%s: taking over the lock of run %s (pid %s, output_dir %s), which ended without "
                "releasing it; its weight copies, if any, are left in %s",
                self.parent,
                owner.get("run"),
                owner.get("pid"),
                owner.get("output_dir"),
                os.path.join(self.parent, f"{RUN_PREFIX}{owner.get('run')}"),
            )
            os.unlink(path)
            return
        where = f"pid {owner.get('pid')} on host {owner.get('host')}" if owner else "an unreadable lock"
        alive = "alive on this host" if here else "on another host, so this process cannot tell whether it is alive"
        raise ValueError(
            f"weight_sync_dir={self.parent!r} is in use by another trl-scale run (run {owner.get('run')}, {where}, "
            f"output_dir {owner.get('output_dir')}, since {owner.get('started')}; {alive}). Two runs sharing one "
            "weight_sync_dir would feed each other's servers. Fix: give each run its own weight_sync_dir (e.g. "
            f"{os.path.join(self.parent, 'run-2')!r}); if that run has ended, delete {path}"
        )

    # ---- writing weights ---------------------------------------------------------------------------------

    def new_version(self, name: str) -> str:
        """A fresh, empty directory for one sync's files, inside the run's own directory."""
        if self.root is None:
            if self.parent is None:
                self._held["root"] = tempfile.mkdtemp(prefix=self.temporary_prefix)
            else:
                self.claim()
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        self._written.append(path)
        return path

    @property
    def written(self) -> list[str]:
        """This run's copies still on disk, oldest first."""
        return list(self._written)

    def keep_only(self, *paths: str) -> None:
        """Delete this run's copies but `paths` (what the servers may still read); nothing it did not write."""
        for old in [p for p in self._written if p not in paths]:
            shutil.rmtree(old, ignore_errors=True)
        self._written = [p for p in self._written if p in paths]

    @property
    def temporary(self) -> bool:
        return self.parent is None

    def release(self) -> None:
        """Remove the run's own directory and its lock (the end of `train()`; again at exit, harmlessly). The next
        sync claims the directory afresh."""
        _release(self._held)
        self._written = []


def _release(held: dict) -> None:
    root, lock = held["root"], held["lock"]
    held["root"] = held["lock"] = None
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
    if lock is not None:
        try:
            with open(lock) as handle:
                ours = json.load(handle).get("run") == held["run"]
            if ours:  # not a lock another run of this process took over since
                os.unlink(lock)
        except (OSError, ValueError):
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
