"""The processes a run started, found by a marker in their environment (every process a server or trainer starts
inherits it): what the fleet tests and the chaos run (benchmarks/chaos.py) check is gone at the end."""

from __future__ import annotations

import time
from pathlib import Path


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (every process a server started inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_gone(marker: str, timeout: float = 60) -> list[str]:
    """Processes with `marker` still alive after `timeout` seconds, described (pid, parent, command line)."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [_describe(pid) for pid in left]


def _describe(pid: int) -> str:
    try:
        parent = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]
        command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        return f"{pid} (parent {parent}): {command}"
    except OSError:
        return str(pid)
