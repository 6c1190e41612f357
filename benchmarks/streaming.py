"""Streaming rollout against real vLLM servers, in a long-tailed regime and an even one: GRPO step time and samples/s
for the synchronous run (staleness 0, what TRL does), the prefetch (`async_rollout_mode="ordered"`) and streaming
(`"streaming"`) at staleness 1 and 2, runs alternated, on the same model, data, seed and servers.

Long tail: most answers are short and a few run many times the median, up to the cap. Real vLLM batches
continuously, so a request lasts as long as its own answer while a batch lasts as long as its longest. The lengths
are set per prompt (its `max_tokens`, drawn once from the prompt: 80 % of prompts 12 tokens, 20 % between 96 and 160,
`ignore_eos`), so every mode meets the same answers; the even regime gives every prompt 24 tokens. Two vLLM CPU
servers (`.venv-vllm`, `bash scripts/setup_vllm.sh`) share one core, the trainer has the other (on 2 cores).

Saturating (dynamic sampling): even lengths, and half the prompts' groups get the same reward for every answer (no
signal): sync and streaming with `dynamic_sampling` off and on; "useful samples/s" counts the trained rows of
groups whose rewards differ (non-zero advantage) per second.

Timeline cost (`--timeline`): streaming in the even regime with `rollout_timeline` off and on, runs alternated
(off, on, on, off, ...): the step time with the timeline recorded over the step time without.

Usage: python benchmarks/streaming.py [--quick] [--regimes long-tail,even,saturating] [--timeline]. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests/real_vllm.py: the harness that starts real vLLM servers
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = {  # mode -> (staleness, async_rollout_mode, dynamic_sampling)
    "sync": (0, "ordered", False),
    "prefetch": (1, "ordered", False),
    "streaming": (1, "streaming", False),
    "prefetch_k2": (2, "ordered", False),
    "streaming_k2": (2, "streaming", False),
}
# Saturating: half the prompts' groups get one reward for every answer (all right or all wrong: no signal).
DYNAMIC_MODES = {
    "sync": (0, "ordered", False),
    "sync_dynamic": (0, "ordered", True),
    "streaming": (1, "streaming", False),
    "streaming_dynamic": (1, "streaming", True),
}
REGIME_MODES = {"long-tail": MODES, "even": MODES, "saturating": DYNAMIC_MODES}
GROUP = 8  # completions per prompt
PROMPTS_PER_STEP = 8


def answer_length(prompt: list[int], regime: str) -> int:
    """The answer length of this prompt, the same in every run (a hash of its tokens)."""
    if regime in ("even", "saturating"):
        return 24
    draw = zlib.crc32(bytes(str(prompt), "utf8")) % 100
    return 12 if draw < 80 else 96 + (draw - 80) * 3  # 80 % short; 20 % long, up to 153


def saturating_reward(prompts, completion_ids, **kwargs) -> list[float]:
    """Half the prompts (by a hash of their text) saturate: every answer gets 1. The others: a number that differs
    whenever the answers do."""
    return [
        1.0 if zlib.crc32(prompt.encode()) % 2 else (sum((i + 1) * t for i, t in enumerate(ids)) % 97) / 97
        for prompt, ids in zip(prompts, completion_ids)
    ]


def run(
    model_path: str, urls: list[str], mode: str, regime: str, steps: int, warmup: int, out: str, timeline: bool = False
) -> dict:
    from transformers import AutoTokenizer, TrainerCallback

    import trl_scale
    from trl_scale.toy import counting_prompts, counting_reward

    staleness, async_mode, dynamic = REGIME_MODES[regime][mode]
    ends, generating, syncing = [], [], [0.0]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            generating.append(trainer.phase_seconds["generate"] - syncing[0])  # so far, the weight syncs apart

    trainer = trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=saturating_reward if regime == "saturating" else counting_reward,
        args=trl_scale.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS_PER_STEP * GROUP,
            num_generations=GROUP,
            max_completion_length=160,
            max_steps=steps,
            learning_rate=1e-4,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_urls=urls,
            async_rollout_staleness=staleness,
            async_rollout_mode=async_mode,
            rollout_request_timeout=600,
            weight_sync_timeout=300,
            generation_kwargs={"ignore_eos": True},
            dynamic_sampling=dynamic,
            **({"dynamic_sampling_max_oversampling": 4.0} if dynamic else {}),  # read only with dynamic sampling
            rollout_timeline=timeline,
        ),
        train_dataset=counting_prompts(4096, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.add_callback(Clock())
    client = trainer.vllm_generation.client
    complete = client.complete

    def long_tailed(prompt, n=1, model=None, on_dispatch=None, **sampling):
        return complete(prompt, n, model, on_dispatch, **{**sampling, "max_tokens": answer_length(prompt, regime)})

    client.complete = long_tailed
    sync = trainer.vllm_generation.sync_weights

    def timed_sync():
        start = time.perf_counter()
        try:
            sync()
        finally:
            syncing[0] += time.perf_counter() - start

    trainer.vllm_generation.sync_weights = timed_sync
    trainer.train()
    streamer = getattr(trainer.vllm_generation.ahead, "streamer", None)  # no read-ahead (synchronous): None
    dropped = streamer.counts["dropped_stale"] if streamer is not None else 0
    client.close()
    intervals = [b - a for a, b in zip(ends, ends[1:])][warmup:]
    step = statistics.mean(intervals)
    # the trainer waiting on generation, per step (synchronous run: the whole generation of a batch, sync apart)
    generate = statistics.mean([b - a for a, b in zip(generating, generating[1:])][warmup:])
    # useful: rows of groups whose rewards differ (a non-zero advantage), of the steps timed
    logs = [h for h in trainer.state.log_history if "frac_reward_zero_std" in h][warmup + 1 :]
    useful = statistics.mean(1 - h["frac_reward_zero_std"] for h in logs) if logs else float("nan")
    return {
        "step_s": step,
        "samples_per_s": PROMPTS_PER_STEP * GROUP / step,
        "useful_samples_per_s": useful * PROMPTS_PER_STEP * GROUP / step,
        "dropped_stale_groups": dropped,
        "generate_s": generate,
    }


def timeline_cost(quick: bool) -> None:
    """Streaming (even regime) with the timeline off and on, alternated; one JSON line."""
    from pinned_vllm import pinned_vllm_servers

    steps, warmup, pairs = (8, 2, 2) if quick else (14, 3, 3)
    runs: dict[bool, list[float]] = {False: [], True: []}
    work_dir: list[str] = []  # the last traced run's output
    with pinned_vllm_servers("timeline-bench-") as (model_path, urls, work):
        for pair in range(pairs):
            for traced in (False, True) if pair % 2 == 0 else (True, False):
                out = os.path.join(work, f"{'traced' if traced else 'plain'}-{pair}")
                result = run(model_path, urls, "streaming", "even", steps, warmup, out, timeline=traced)
                runs[traced].append(result["step_s"])
                print("timeline" if traced else "plain", pair, result, flush=True)
                if traced:
                    assert os.path.exists(os.path.join(out, "timeline", "trace.json"))
                    work_dir[:] = [out]
    plain, traced = statistics.mean(runs[False]), statistics.mean(runs[True])
    print(f"streaming step time: {plain:.3f} s without the timeline, {traced:.3f} s with it ({traced / plain:.3f}x)")
    # Below the runs' spread, a bound: the events one step records, times what recording one costs here.
    with open(os.path.join(work_dir[0], "timeline", "trace.json")) as handle:
        events = sum(1 for e in json.load(handle)["traceEvents"] if e["ph"] in ("X", "b", "i"))
    per_event = recording_cost()
    summary = {
        "step_s": {"plain": plain, "timeline": traced},
        "runs": {str(k): v for k, v in runs.items()},
        "events_per_step": events / steps,
        "recording_s_per_step": events / steps * per_event,
        "recording_share_of_step": events / steps * per_event / plain,
    }
    print(json.dumps({"benchmark": "streaming_timeline", "quick": quick, "cost": traced / plain - 1, **summary}))


def recording_cost() -> float:
    """Seconds to record one event (a request's span and a phase segment, alternately), best of 5."""
    from trl_scale.timeline import Timeline

    timeline, count, best = Timeline(), 20000, float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(count // 2):
            timeline.overlapping("http://server", "request", 1.0, 2.0, status=200)
            timeline.span("trainer", "scoring", "scoring", 1.0, 2.0)
        best = min(best, (time.perf_counter() - start) / count)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--regimes", default="long-tail,even")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the regime's modes (sync always)")
    parser.add_argument("--timeline", action="store_true", help="measure the rollout timeline's cost instead")
    args = parser.parse_args()
    if args.timeline:
        return timeline_cost(args.quick)
    from pinned_vllm import pinned_vllm_servers

    steps, warmup, repeats = (8, 2, 1) if args.quick else (14, 3, 2)
    with pinned_vllm_servers("streaming-bench-") as (model_path, urls, work):
        wanted = None if args.modes is None else {"sync", *args.modes.split(",")}
        results = {
            regime: {mode: [] for mode in REGIME_MODES[regime] if wanted is None or mode in wanted}
            for regime in args.regimes.split(",")
        }
        for regime, by_mode in results.items():
            for repeat in range(repeats):
                order = list(by_mode) if repeat % 2 == 0 else list(reversed(by_mode))
                for mode in order:
                    out = os.path.join(work, f"{regime}-{mode}-{repeat}")
                    by_mode[mode].append(run(model_path, urls, mode, regime, steps, warmup, out))
                    print(regime, mode, repeat, by_mode[mode][-1], flush=True)
    summary = {}
    for regime, by_mode in results.items():
        step = {mode: statistics.mean(r["step_s"] for r in runs) for mode, runs in by_mode.items()}
        summary[regime] = {
            "step_s": step,
            "samples_per_s": {mode: PROMPTS_PER_STEP * GROUP / s for mode, s in step.items()},
            "useful_samples_per_s": {
                mode: statistics.mean(r["useful_samples_per_s"] for r in runs) for mode, runs in by_mode.items()
            },
            "vs_sync": {mode: step[mode] / step["sync"] for mode in step},
            "dropped_stale_groups": sum(r["dropped_stale_groups"] for r in by_mode.get("streaming", [])),
        }
        if "sync" in by_mode and regime != "saturating":
            # At staleness 1 a group sent at sync V must be trained at V + 1, and the batch trained at V + 1 holds
            # (unbiased: no group dropped for being slow) a batch's worth of groups sent at V: a step cannot be
            # shorter than generating one batch (G, the synchronous run's wait on generation, syncs apart), nor than
            # the rest of the step (S - G). k = 2: G / 2.
            generate = statistics.mean(r["generate_s"] for r in by_mode["sync"])
            rest = step["sync"] - generate
            summary[regime]["generate_s_sync"] = generate
            summary[regime]["lower_bound_vs_sync"] = {
                "k1": max(generate, rest) / step["sync"],
                "k2": max(generate / 2, rest) / step["sync"],
            }
        ratios = summary[regime]["vs_sync"]
        shown = ", ".join(f"{mode} {ratio:.2f}" for mode, ratio in ratios.items())
        print(f"{regime}: sync {step['sync']:.2f} s/step; step time vs sync: {shown}")
    print(json.dumps({"benchmark": "streaming", "quick": args.quick, "regimes": summary}))


if __name__ == "__main__":
    main()
