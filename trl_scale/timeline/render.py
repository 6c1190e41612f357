"""The timeline's PNG: the last steps' lanes (each server's requests and sync calls, the trainer's phases) on the
left, the reward curve of the whole run on the right (with each server's mismatch per step, where measured).
matplotlib, without a display."""

from __future__ import annotations

from .phases import PHASES, STEP_LANE, TRAINER, StepRecord
from .recorder import MISMATCH_COUNTER, Timeline

COLORS = {
    "wait for groups": "#d62728",
    "generate": "#1f77b4",
    "weight sync": "#9467bd",
    "rewards": "#2ca02c",
    "scoring": "#ff7f0e",
    "backward": "#8c564b",
    "optimizer": "#e377c2",
    "other": "#7f7f7f",
    "request": "#17becf",
}


def render_png(
    timeline: Timeline, steps: list[StepRecord], rewards: list[tuple[int, float]], path: str, last: int = 5
) -> str | None:
    """Draw the last `last` steps and the reward curve into `path`; None when no step was recorded."""
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = steps[-last:]
    start, end = shown[0].start - timeline.began, shown[-1].end - timeline.began
    spans = [s for s in timeline.spans() if s[4] >= start and s[3] <= end]
    servers = sorted({group for group, *_ in spans if group != TRAINER})
    lanes = [*servers, *(p for p in PHASES if p != STEP_LANE)]
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 0.45 * len(lanes) + 2), width_ratios=[3, 1])
    for row, lane in enumerate(lanes):
        if lane in servers:
            bars = [(s[3], s[4] - s[3]) for s in spans if s[0] == lane]
            colors = [COLORS["request"] if s[2] == "request" else "#000000" for s in spans if s[0] == lane]
            alphas = 0.25
        else:
            bars = [(s[3], s[4] - s[3]) for s in spans if s[0] == TRAINER and s[1] == lane]
            colors, alphas = COLORS.get(lane, "#333333"), 0.9
        if bars:
            left.broken_barh(bars, (row - 0.4, 0.8), facecolors=colors, alpha=alphas)
    for record in shown:
        left.axvline(record.end - timeline.began, color="#444444", linewidth=0.6, linestyle=":")
    left.set_yticks(range(len(lanes)), [_label(lane) for lane in lanes])
    left.set_ylim(len(lanes) - 0.5, -0.5)
    left.set_xlim(start, end)
    left.set_xlabel("seconds since the timeline began, when the trainer was built (dotted: step ends)")
    left.set_title(f"steps {shown[0].step}-{shown[-1].step}: servers (requests; black: sync calls), trainer phases")
    if rewards:
        right.plot([s for s, _ in rewards], [r for _, r in rewards], marker=".", color=COLORS["rewards"])
    right.set_xlabel("step")
    right.set_ylabel("reward")
    right.set_title("reward")
    _draw_mismatch(right, timeline)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _draw_mismatch(axis, timeline: Timeline) -> None:
    """Each server's mismatch KL per step (the gate's counter), on the reward panel's second axis."""
    measured = [(group, values) for group, name, _, values in timeline.counters() if name == MISMATCH_COUNTER]
    if not measured:
        return
    twin = axis.twinx()
    for group in sorted({group for group, _ in measured}):
        points = [(values["step"], max(values["kl"], 1e-12)) for g, values in measured if g == group]
        twin.plot([s for s, _ in points], [k for _, k in points], marker="x", linestyle="--", label=_label(group))
    twin.set_yscale("log")
    twin.set_ylabel("mismatch KL/token (per server)")
    twin.legend(fontsize=7, loc="lower right")
    axis.set_title("reward; each server's mismatch")


def _label(lane: str) -> str:
    return lane.replace("http://", "") if lane.startswith("http") else lane
