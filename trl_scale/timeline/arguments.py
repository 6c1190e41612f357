"""The rollout timeline's config field, mixed into the GRPO, RLOO and PPO configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..numbers import check_field_types


@dataclass
class TimelineArguments:
    """Config field of the rollout timeline (GRPO, RLOO, PPO; every rollout mode)."""

    FIELDS_DOC = """
    > Rollout timeline

    rollout_timeline (`bool`, defaults to `False`):
        Record what the run does in time and write it to `<output_dir>/timeline/`: `trace.json` in Chrome's
        trace-event format (open it in ui.perfetto.dev or chrome://tracing), with a lane per rollout server (each
        request, and each pause, weight load and resume of a sync; a managed server's restarts) and per trainer phase
        (waiting for groups, generation, weight sync, rewards, log-prob scoring, backward, optimizer, other), whose
        segments add up to each step's wall time; and `timeline.png`, the last steps' lanes beside the reward curve
        (needs matplotlib). Written when training ends, however it ends, and at each checkpoint. Other ranks write
        `trace-rank<r>.json`. Measured cost: `benchmarks/streaming.py --timeline`.
"""  # its section of each config's docstring (`config_docstring`)

    rollout_timeline: bool = field(
        default=False,
        metadata={
            "help": "Write <output_dir>/timeline/trace.json (Chrome trace events: a lane per rollout server and per "
            "trainer phase; open in ui.perfetto.dev) and timeline.png (the last steps beside the reward curve)."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_field_types(self, TimelineArguments)
