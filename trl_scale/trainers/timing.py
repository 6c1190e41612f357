"""Phase timing as a trainer feature: wall time per phase of an online step (generation, reward scoring, log-prob
scoring), accumulated between logs and read by `trl_scale.callbacks.StepTimeCallback`; the trainer thread's phases
clocked step by step (`trl_scale.timeline.PhaseClock`: also a weight sync, a wait for streamed groups, the backward
and the optimizer step), which gives `time/to_first_step_s`; and with `rollout_timeline` the run's timeline, written
to `<output_dir>/timeline/` (`trl_scale.timeline`)."""

from __future__ import annotations

import functools
import os
import time
from collections import defaultdict
from contextlib import contextmanager

from transformers import TrainerCallback

from ..logs import get_logger
from ..timeline import PhaseClock, Timeline
from .feature import Feature, Patch

logger = get_logger(__name__)

# The share of the step's time rewards computed in the step may take before the hint about stream_rewards
SLOW_REWARD_SHARE = 0.25
# PhaseTiming's phase -> the timeline's lane
LANES = {"generate": "generate", "reward": "rewards", "score": "scoring"}


class PhaseTiming(Feature):
    """Times TRL's `_generate`, `_calculate_rewards` and `_get_per_token_logps_and_entropies` as run (inside
    dynamic sampling, so its rounds are timed where they compute and its served answers are not)."""

    name = "phase_timing"
    PATCHES = (Patch("accelerator.backward", "setup (timed as the backward phase)", "never", "trainers/timing.py"),)

    def __init__(self, timeline: bool = False, may_hint: bool = False):
        self.may_hint = may_hint  # where rewards computed in the step may be slow enough to hint at the switch
        self.wants_timeline = timeline  # rollout_timeline
        self.seconds: defaultdict[str, float] = defaultdict(float)
        # the run's clock and timeline (`Run.clock`), taken at setup; a clock of its own until then
        self.clock = PhaseClock()
        self.timeline: Timeline | None = None
        self.train_began: float | None = None
        self.first_step_seconds: float | None = None  # from train() to the end of the first step
        self._first_step_logged = False
        self._outages_drawn = 0
        self.reward_seconds = 0.0  # in the step's reward calls, since the run began
        self._since: tuple[float, float] | None = None  # (time, reward_seconds) at the last log
        self._hinted = False

    @classmethod
    def build(cls, plan) -> PhaseTiming:
        rollout = plan.rollout
        # the hint on slow rewards: a streamed step computing them, stream_rewards left at None, no environments
        may_hint = rollout.takes_groups and not (rollout.rewards_in_stream or rollout.stream_rewards_chosen)
        return cls(plan.timeline, may_hint and not rollout.environments)

    def check(self, run) -> None:
        if not self.wants_timeline:
            return
        try:
            import matplotlib  # noqa: F401
        except ImportError as error:
            raise ValueError(
                "rollout_timeline=True draws timeline.png with matplotlib, which is not installed. Fix: pip install "
                "'trl-scale[timeline]' (or matplotlib), or rollout_timeline=False"
            ) from error

    def setup(self, run) -> None:
        # the rollout client was given the same clock and timeline when it was built (`ServerRollout`)
        self.clock, self.timeline = run.clock, run.clock.timeline
        run.trl.add_callback(StepClock(self))
        # The backward has no hook of TRL's or the Trainer's: the accelerator's, on this trainer's accelerator only.
        backward = run.trl.accelerator.backward

        @functools.wraps(backward)
        def timed_backward(*args, **kwargs):
            with self.clock.phase("backward"):
                return backward(*args, **kwargs)

        run.trl.accelerator.backward = timed_backward

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            with self.clock.phase(LANES[phase]):
                yield
        finally:
            seconds = time.perf_counter() - start
            self.seconds[phase] += seconds
            if phase == "reward":
                self.reward_seconds += seconds

    def generate(self, run, proceed, prompts):
        with self.timed("generate"):
            return proceed(prompts)

    def rewards(self, run, proceed, *args):
        with self.timed("reward"):
            return proceed(*args)

    def scoring(self, run, proceed, *args, **kwargs):
        with self.timed("score"):
            return proceed(*args, **kwargs)

    def train(self, run, proceed, *args, **kwargs):
        self.train_began = time.perf_counter()
        self.clock.start()
        try:
            return proceed(*args, **kwargs)
        finally:
            self.clock.stop()
            if self.timeline is not None:
                self.write(run.trl, draw=True)

    def log(self, run, logs: dict[str, float]) -> None:
        if self.first_step_seconds is not None and not self._first_step_logged:
            logs["time/to_first_step_s"] = self.first_step_seconds
            self._first_step_logged = True
        self._hint_slow_rewards()

    def _hint_slow_rewards(self) -> None:
        """Once: where rewards computed in the step (streaming, `stream_rewards=None`, no environment) take a large
        share of the steps since the last log, say that the switch exists and what it changes. The default stays
        (a reward function may look across the whole batch); the first log's interval (start-up) is not judged."""
        now, since = time.perf_counter(), self._since
        self._since = (now, self.reward_seconds)
        if self._hinted or since is None or now <= since[0]:
            return
        share = (self.reward_seconds - since[1]) / (now - since[0])
        if self.may_hint and share >= SLOW_REWARD_SHARE:
            self._hinted = True
            logger.warning(
                "rewards took %.0f%% of the last steps' time, computed in the step once the stream's groups arrive "
                "(stream_rewards=None: off without environments). stream_rewards=True computes each group's rewards "
                "in the stream as it finishes, beside generation (with a verifier as slow as generating a group, "
                "a streamed step took 0.40x as long: docs/agents.md). Reward functions then see one group at a "
                "time, not the whole batch. (Said once.)",
                100 * share,
            )

    def save_state(self, run, output_dir: str) -> None:
        if self.timeline is not None:
            self.write(run.trl, draw=False)

    def step_ended(self, step: int) -> None:
        record = self.clock.step_end(step)
        if record is not None and self.first_step_seconds is None and self.train_began is not None:
            self.first_step_seconds = record.end - self.train_began

    def write(self, trl, draw: bool) -> None:
        """The trace (each rank its own file) and, on the main process when `draw`, the PNG. A failure to write is
        logged, never raised: the run's own outcome stands."""
        directory = os.path.join(trl.args.output_dir, "timeline")
        rank = trl.accelerator.process_index
        try:
            self._draw_outages(trl.rollout_fleet)
            self.timeline.write(os.path.join(directory, "trace.json" if rank == 0 else f"trace-rank{rank}.json"))
            if draw and rank == 0:
                from ..timeline.render import render_png

                history = trl.state.log_history
                rewards = [(e["step"], e["reward"]) for e in history if "reward" in e and "step" in e]
                render_png(self.timeline, self.clock.steps, rewards, os.path.join(directory, "timeline.png"))
        except Exception as error:  # a full disk must not turn a finished run into a failed one
            logger.warning("rollout timeline: could not write %s: %r", directory, error)

    def _draw_outages(self, fleet) -> None:
        """A managed server's restarts (exit seen to answering again) as spans on its lane."""
        outages = list(getattr(fleet, "outages", None) or [])
        for url, down, up in outages[self._outages_drawn :]:
            name = "restart" if up is not None else "down"
            self.timeline.span(url, "restarts", name, down, up or time.perf_counter())
        self._outages_drawn = len(outages)


class StepClock(TrainerCallback):
    """The Trainer's step boundaries and optimizer step, told to the phase clock."""

    def __init__(self, timing: PhaseTiming):
        self.timing = timing

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timing.clock.enter("optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timing.clock.exit()

    def on_step_end(self, args, state, control, **kwargs):
        self.timing.step_ended(state.global_step)
