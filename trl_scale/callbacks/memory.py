"""Peak memory between logs: GPU allocated (CUDA) and the process's resident set (always)."""

from __future__ import annotations

import resource

import torch
from transformers import TrainerCallback


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class MemoryCallback(TrainerCallback):
    """Logs `memory/rss_gib`, `memory/peak_rss_gib` and, on CUDA, `memory/peak_allocated_gib` since the last log."""

    def trl_scale_metrics(self, trainer, logs) -> dict[str, float]:
        metrics = {"memory/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
        try:
            metrics["memory/rss_gib"] = _rss_gib()
        except OSError:  # no /proc (macOS)
            pass
        if torch.cuda.is_available():
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        return metrics
