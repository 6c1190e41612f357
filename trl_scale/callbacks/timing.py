"""Step-time breakdown: generation, reward scoring, log-prob scoring, weight sync and the rest (training)."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class StepTimeCallback(TrainerCallback):
    """Logs `time/<phase>_s` per optimizer step, averaged since the last log, for the phases the trainer times
    (`generate`, `reward`, `score`, `weight_sync`), and `time/train_s` for the remainder of the step."""

    def __init__(self):
        self._step_seconds = 0.0
        self._steps = 0
        self._step_start: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self._step_seconds += time.perf_counter() - self._step_start
            self._steps += 1

    def trl_scale_metrics(self, trainer, logs) -> dict[str, float]:
        phases = dict(getattr(trainer, "phase_seconds", {}))
        # The step being logged has not reached on_step_end yet; count it as in progress.
        steps = max(1, self._steps)
        metrics = {f"time/{phase}_s": seconds / steps for phase, seconds in phases.items()}
        total = self._step_seconds / steps if self._steps else 0.0
        if total:
            metrics["time/step_s"] = total
            metrics["time/train_s"] = max(0.0, total - sum(metrics.values()))
        if hasattr(trainer, "phase_seconds"):
            trainer.phase_seconds.clear()
        self._step_seconds, self._steps = 0.0, 0
        return metrics
