"""Which features' hooks ran, and how often, since the last training log (`HookTrace`; Composer's per-batch trace
of `<algorithm>/<event>`).

A feature is built only where it acts (`Feature.build`), but some decide per call (an evaluation batch, a batch with
no images): the trace is what shows, every log, which hooks each feature entered, and how often one of those that
decide per call stepped aside (`stepped_aside`: TRL's method ran as if the feature were not there). The adapter logs
it at `logging_steps` (`trl-scale trace since the last log: ...`) and starts a new one.
"""

from __future__ import annotations

import threading
from collections import Counter


class HookTrace:
    """Counts of (feature, hook) entries; safe from the stream's threads (TRL's tool loop runs there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._aside: Counter[tuple[str, str]] = Counter()

    def entered(self, feature: str, hook: str) -> None:
        with self._lock:
            self._counts[(feature, hook)] += 1

    def stepped_aside(self, feature: str, hook: str) -> None:
        """`feature`, entered on `hook`, decided not to act on this call."""
        with self._lock:
            self._aside[(feature, hook)] += 1

    def taken(self) -> dict[str, dict[str, int]]:
        """Per hook, each feature's entries since the last call (outermost first, as entered), and a new count."""
        return self.taken_with_asides()[0]

    def taken_with_asides(self) -> tuple[dict[str, dict[str, int]], dict[tuple[str, str], int]]:
        """`taken()`, with how often each (feature, hook) stepped aside; both counts start again."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
            aside, self._aside = self._aside, Counter()
        hooks: dict[str, dict[str, int]] = {}
        for (feature, hook), count in counts.items():
            hooks.setdefault(hook, {})[feature] = count
        return hooks, dict(aside)

    @staticmethod
    def line(hooks: dict[str, dict[str, int]], aside: dict[tuple[str, str], int] | None = None) -> str:
        """One log line: `hook: feature x count (aside x n), ...; ...` ("none" where no feature's hook ran)."""
        aside = aside or {}

        def entry(hook: str, feature: str, count: int) -> str:
            skipped = aside.get((feature, hook), 0)
            return f"{feature} x{count}" + (f" (aside x{skipped})" if skipped else "")

        parts = [
            f"{hook}: " + ", ".join(entry(hook, feature, count) for feature, count in features.items())
            for hook, features in hooks.items()
        ]
        return "; ".join(parts) or "none"
