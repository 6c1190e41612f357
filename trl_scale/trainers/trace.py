"""Which features' hooks ran, and how often, since the last training log (`HookTrace`; Composer's per-batch trace
of `<algorithm>/<event>`).

A feature is built only where it acts (`Feature.build`), but some decide per call (an evaluation batch, a batch with
no images): the trace is what shows, every log, which hooks each feature entered. The adapter logs it at
`logging_steps` (`trl-scale trace: ...`) and starts a new one.
"""

from __future__ import annotations

import threading
from collections import Counter


class HookTrace:
    """Counts of (feature, hook) entries; safe from the stream's threads (TRL's tool loop runs there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def entered(self, feature: str, hook: str) -> None:
        with self._lock:
            self._counts[(feature, hook)] += 1

    def taken(self) -> dict[str, dict[str, int]]:
        """Per hook, each feature's entries since the last call (outermost first, as entered), and a new count."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
        hooks: dict[str, dict[str, int]] = {}
        for (feature, hook), count in counts.items():
            hooks.setdefault(hook, {})[feature] = count
        return hooks

    @staticmethod
    def line(hooks: dict[str, dict[str, int]]) -> str:
        """One log line: `hook: feature x count, ...; ...` ("none" where no feature's hook ran)."""
        parts = [
            f"{hook}: " + ", ".join(f"{feature} x{count}" for feature, count in features.items())
            for hook, features in hooks.items()
        ]
        return "; ".join(parts) or "none"
