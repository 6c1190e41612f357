"""The trainer thread's phases, as segments that tile its time.

Phases nest (a weight sync inside a generation, a log-prob forward inside a loss): a segment is recorded for the
phase running at each moment, the innermost, so the segments of every lane together cover the trainer's time once,
and each step's phases sum to its wall time (from the end of the step before, or the start of training, to its own
end: fetching the batch, logging and evaluating between steps are in it, as "other" where no phase names them).
Only the thread that runs the steps is clocked: the stream's threads are not the trainer's time."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

from .recorder import Timeline

TRAINER = "trainer"
OTHER = "other"  # the step's time no named phase covers (the forward of the loss, advantages, logging, ...)
STEP_LANE = "step"
# The trainer's lanes, in the order drawn.
PHASES = (
    STEP_LANE,
    "wait for groups",
    "generate",
    "weight sync",
    "rewards",
    "scoring",
    "backward",
    "optimizer",
    OTHER,
)


@dataclass
class StepRecord:
    step: int
    start: float  # perf_counter seconds
    end: float
    phases: dict[str, float] = field(default_factory=dict)  # seconds each phase ran in it (exclusive)


class PhaseClock:
    def __init__(self, timeline: Timeline | None = None, clock: Callable[[], float] = time.perf_counter):
        self.timeline = timeline
        self.clock = clock
        self.steps: list[StepRecord] = []
        self._stack: list[list] = []  # [phase, start of its current segment]
        self._owner: int | None = None
        self._step_start: float | None = None
        self._current: defaultdict[str, float] = defaultdict(float)
        if timeline is not None:
            for lane in PHASES:  # the lanes in their order, before any event
                timeline.lane_id(TRAINER, lane)

    def start(self) -> None:
        """Training starts on this thread: the first step's time runs from now."""
        self._owner = threading.get_ident()
        self._stack = [[OTHER, self.clock()]]
        self._step_start = self._stack[0][1]
        self._current.clear()

    @contextmanager
    def phase(self, name: str):
        """`name` runs in the block (on the training thread; elsewhere, or before `start`, nothing is clocked)."""
        if self._owner != threading.get_ident() or not self._stack:
            yield
            return
        self.enter(name)
        try:
            yield
        finally:
            self.exit()

    def enter(self, name: str) -> None:
        """`name` starts now (on the training thread, once started; elsewhere nothing)."""
        if self._owner != threading.get_ident() or not self._stack:
            return
        now = self.clock()
        if self._stack:
            self._close_segment(now)
        self._stack.append([name, now])

    def exit(self) -> None:
        """The phase entered last ends now (never the step's own)."""
        if self._owner != threading.get_ident() or len(self._stack) < 2:
            return
        now = self.clock()
        self._close_segment(now)
        self._stack.pop()
        if self._stack:
            self._stack[-1][1] = now

    def step_end(self, step: int) -> StepRecord | None:
        """Step `step` ended now: its record (None before `start`); the next step's time starts. A phase still
        open (none should be) goes on into the next step."""
        if self._owner != threading.get_ident() or self._step_start is None or not self._stack:
            return None
        now = self.clock()
        self._close_segment(now)
        self._stack[-1][1] = now
        record = StepRecord(step, self._step_start, now, dict(self._current))
        if self.timeline is not None:
            self.timeline.span(TRAINER, STEP_LANE, f"step {step}", self._step_start, now, step=step)
        self.steps.append(record)
        self._step_start = now
        self._current.clear()
        return record

    def stop(self) -> None:
        """Training ended (or failed): nothing more is clocked."""
        self._owner, self._stack, self._step_start = None, [], None

    def _close_segment(self, now: float) -> None:
        name, began = self._stack[-1]
        if now > began:
            self._current[name] += now - began
            if self.timeline is not None:
                self.timeline.span(TRAINER, name, name, began, now)


def recorded_steps(timeline: Timeline) -> list[StepRecord]:
    """The trainer's steps as a timeline holds them (its step lane, and each phase's segments within each step): what
    `PhaseClock.steps` was, for a timeline read back from its trace (`Timeline.read`)."""
    spans = timeline.spans(TRAINER)
    steps = [StepRecord(args["step"], start, end) for _, lane, _, start, end, args in spans if lane == STEP_LANE]
    for _, lane, _, start, end, _ in spans:
        if lane == STEP_LANE:
            continue
        for step in steps:
            if step.start <= start < step.end:
                step.phases[lane] = step.phases.get(lane, 0.0) + (end - start)
                break
    return sorted(steps, key=lambda step: step.step)
