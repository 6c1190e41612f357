"""The docs' pictures, drawn from what the code measured: `benchmarks/results/` (TRL beside trl-scale) and a demo
run's rewards. Called by the docs build (`docs/hooks/figures.py`) into `docs/figures/`, which is not committed: a
picture is never pasted, so it cannot drift from its numbers. `python benchmarks/charts.py DIR` draws them too."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gpu_train_step(path: Path, out: str) -> str:
    """Step time of TRL's padded step, trl-scale's packed step before its defaults, and the defaults, per shape."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in rows if r["figure"] == "train_step" and "step_s" in r]
    shapes = sorted({r["shape"] for r in steps})
    variants = [("trl_padded", "TRL, padded"), ("sdpa_varlen", "trl-scale before"), ("default", "trl-scale default")]
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.2))
    width = 0.26
    for k, (variant, label) in enumerate(variants):
        chosen = [next(r for r in steps if r["shape"] == s and r["variant"] == variant) for s in shapes]
        values, mfu = [r["step_s"] * 1e3 for r in chosen], [r["mfu"] for r in chosen]
        bars = axis.bar([i + (k - 1) * width for i in range(len(shapes))], values, width, label=label)
        for bar, value in zip(bars, mfu):
            axis.annotate(f"{value:.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                          va="bottom", fontsize=8)  # fmt: skip
    axis.set_xticks(range(len(shapes)), shapes)
    axis.set_ylabel("training step, ms (useful MFU on top)")
    axis.set_title(f"One training step on an {steps[0]['device']} (23k packed tokens)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def agents_streaming(path: Path, out: str) -> str:
    """Step time, synchronous vs streaming with the rewards in the step vs in the stream, for the newest runs whose
    verifier was matched to a group generated alone."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    runs = [r for r in rows if r.get("verifier_matched_to") == "alone"]
    modes = [("sync", "synchronous"), ("streaming_rewards_in_step", "streaming, rewards in the step"),
             ("streaming_rewards_in_stream", "streaming, rewards in the stream")]  # fmt: skip
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.2))
    width = 0.26
    names = [f"{r['layers']} layers, {r['generations']} x {r['answer_tokens']} tokens" for r in runs]
    for k, (mode, label) in enumerate(modes):
        places = [i + (k - 1) * width for i in range(len(runs))]
        axis.bar(places, [r["step_s"][mode] for r in runs], width, label=label)
    axis.set_xticks(range(len(runs)), names)
    axis.set_ylabel("seconds per step")
    axis.set_title("GRPO with a verifier as slow as generating a group (2 vLLM CPU servers)", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def demo_rewards(path: Path, out: str) -> str | None:
    """The demo's reward per GRPO step, drawn by the demo's own plot (`trl_scale.toy.demo.plot_rewards`)."""
    from trl_scale.toy.demo import plot_rewards

    result = json.loads(path.read_text())
    return plot_rewards(result["train_rewards"], out, result["reward_before"], result["reward_after"])


def streaming_timeline(directory: Path, out: str) -> str | None:
    """A streaming run's rollout timeline, as the run drew it (`trl_scale.timeline.render.render_png`), from its
    stored trace (`benchmarks/timeline_example.py`)."""
    from trl_scale.timeline import Timeline, recorded_steps
    from trl_scale.timeline.render import render_png

    timeline = Timeline.read(str(directory / "trace.json"))
    rewards = [tuple(pair) for pair in json.loads((directory / "rewards.json").read_text())["rewards"]]
    return render_png(timeline, recorded_steps(timeline), rewards, out)


def mismatch_servers(path: Path, out: str) -> str:
    """Each server's KL per token (log scale) in the newest mismatch probe against real vLLM, with the budget."""
    record = json.loads(path.read_text().splitlines()[-1])
    names = list(record["servers"])
    values = [max(record["servers"][name]["kl"], 1e-12) for name in names]
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 3.0))
    colors = ["tab:red" if value > record["default_budget"] else "tab:green" for value in values]
    axis.bar(range(len(names)), values, color=colors)
    axis.axhline(record["default_budget"], color="black", linestyle="--", linewidth=1)
    axis.annotate(f"default budget {record['default_budget']:g}", (-0.4, record["default_budget"]),
                  ha="left", va="bottom", fontsize=8)  # fmt: skip
    axis.set_yscale("log")
    served_by = {"fp32": "fp32 (vLLM)", "bf16": "bfloat16 (trl-scale serve)"}
    served_by["other_revision"] = "other revision (vLLM)"
    axis.set_xticks(range(len(names)), [served_by.get(name, name) for name in names])
    axis.set_ylabel("KL per token, nats (log scale)")
    axis.set_title("The mismatch probe before step 1: three servers of one policy, an fp32 trainer", fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def draw_all(directory: str) -> list[str]:
    """Every picture the docs show, into `directory`."""
    os.makedirs(directory, exist_ok=True)
    return [
        gpu_train_step(RESULTS / "gpu_h200_train_run3.jsonl", os.path.join(directory, "gpu-train-step.png")),
        agents_streaming(RESULTS / "agents_cpu.jsonl", os.path.join(directory, "agents-streaming.png")),
        demo_rewards(RESULTS / "demo_cpu.json", os.path.join(directory, "demo-rewards.png")),
        streaming_timeline(RESULTS / "timeline_streaming", os.path.join(directory, "timeline.png")),
        mismatch_servers(RESULTS / "mismatch_cpu.jsonl", os.path.join(directory, "mismatch-servers.png")),
    ]


if __name__ == "__main__":
    print("\n".join(draw_all(sys.argv[1] if len(sys.argv) > 1 else "figures")))
