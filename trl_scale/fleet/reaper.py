"""The reaper: a tiny process that kills the process groups of the servers a trainer started once that trainer is
gone, however it went (a normal exit, an exception, `kill -9`, the OOM killer).

The trainer holds the write end of the reaper's stdin and sends `add PGID` / `remove PGID` lines. When the trainer
dies the kernel closes that pipe; the reaper reads end-of-file and sends SIGTERM, then SIGKILL, to every group still
listed. It runs in its own session and detached (no one's child), so a Ctrl-C to the trainer's terminal, a kill of the
trainer's process group, or Ray killing an actor's children does not take it down first. Standard library only,
run as a script (`python reaper.py`).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _signal_groups(groups: set[int], sig: int) -> set[int]:
    """Send `sig` to each group; the groups that still exist."""
    alive = set()
    for group in groups:
        try:
            os.killpg(group, sig)
            alive.add(group)
        except (ProcessLookupError, PermissionError):
            continue
    return alive


def reap(groups: set[int], grace: float = 10.0) -> None:
    """SIGTERM to every group, up to `grace` seconds for them to exit, then SIGKILL to whatever is left."""
    alive = _signal_groups(groups, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = _signal_groups(alive, 0)
    _signal_groups(alive, signal.SIGKILL)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe's end (or SIGTERM) ends it
    groups: set[int] = set()
    signal.signal(signal.SIGTERM, lambda *_: (reap(groups), sys.exit(0)))
    for line in sys.stdin:
        command, _, value = line.strip().partition(" ")
        if command == "add" and value.isdigit():
            groups.add(int(value))
        elif command == "remove" and value.isdigit():
            groups.discard(int(value))
    reap(groups)


if __name__ == "__main__":
    # Detached: the process that started it exits at once, so the reaper is no one's child. Ray kills an actor's
    # child processes with the actor; a reaper that is a child would die before it could stop the server's group.
    if os.fork():
        os._exit(0)
    main()
