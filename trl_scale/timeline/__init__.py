"""The rollout timeline: what the run did in time, as Chrome trace events (open in ui.perfetto.dev or
chrome://tracing) and a PNG. `Timeline` records the events of one process (each server's requests and weight-sync
calls, the trainer's phases); `PhaseClock` turns the trainer thread's nested phases into segments that tile its
time; `render_png` draws the last steps beside the reward curve. `TimelineArguments` holds the switch."""

from .arguments import TimelineArguments
from .phases import TRAINER, PhaseClock, StepRecord, recorded_steps
from .recorder import MISMATCH_COUNTER, Timeline

__all__ = [
    "MISMATCH_COUNTER",
    "TRAINER",
    "PhaseClock",
    "StepRecord",
    "Timeline",
    "TimelineArguments",
    "recorded_steps",
]
