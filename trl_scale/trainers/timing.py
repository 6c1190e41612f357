"""Phase timing as a trainer feature: wall time per phase of an online step (generation, reward scoring, log-prob
scoring), accumulated between logs and read by `trl_scale.callbacks.StepTimeCallback`."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

from .feature import Feature


class PhaseTiming(Feature):
    """Times TRL's `_generate`, `_calculate_rewards` and `_get_per_token_logps_and_entropies` as run (inside
    dynamic sampling, so its rounds are timed where they compute and its served answers are not)."""

    name = "phase_timing"

    def __init__(self):
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def generate(self, trainer, proceed, prompts):
        with self.timed("generate"):
            return proceed(prompts)

    def rewards(self, trainer, proceed, *args):
        with self.timed("reward"):
            return proceed(*args)

    def scoring(self, trainer, proceed, *args, **kwargs):
        with self.timed("score"):
            return proceed(*args, **kwargs)
