"""The rollout timeline (`rollout_timeline`): the trainer thread's nested phases tile each step (a clock driven by
the test), the trace is Chrome's trace-event JSON (metadata, complete events, paired async events), the switch from
Python, YAML and the command line and its refusal without matplotlib, and a local GRPO run whose trace accounts for
each step's wall time and whose PNG is drawn. Server rollout: tests/test_streaming_servers.py (streaming over
`trl-scale serve`) and tests/test_real_vllm.py (streaming over real vLLM: syncs inside running requests)."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
from transformers import AutoTokenizer, TrainerCallback

import trl_scale
from trl_scale.timeline import TRAINER, PhaseClock, Timeline

from .helpers import cpu_args, token_parity_reward

STEP_TOLERANCE = 0.05  # the trainer lanes' sum against each step's wall time


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_tile_each_step_and_other_threads_are_not_clocked():
    timeline, clock = Timeline(), FakeClock()
    timeline.began = 0.0
    phases = PhaseClock(timeline, clock)
    phases.start()
    clock.now = 1.0
    with phases.phase("generate"):
        clock.now = 2.0
        with phases.phase("weight sync"):
            clock.now = 3.0
            elsewhere = threading.Thread(target=lambda: phases.enter("rewards"))  # a stream thread: not clocked
            elsewhere.start()
            elsewhere.join()
        clock.now = 5.0
    clock.now = 6.0
    first = phases.step_end(1)
    assert (first.start, first.end) == (0.0, 6.0)
    assert first.phases == {"other": 2.0, "generate": 3.0, "weight sync": 1.0}  # exclusive: sums to the step
    phases.enter("optimizer")
    clock.now = 6.5
    phases.exit()
    clock.now = 7.0
    second = phases.step_end(2)
    assert (second.start, second.end, second.phases) == (6.0, 7.0, {"optimizer": 0.5, "other": 0.5})
    lanes = [(lane, start, end) for group, lane, _, start, end, _ in timeline.spans() if group == TRAINER]
    assert ("generate", 1.0, 2.0) in lanes and ("generate", 3.0, 5.0) in lanes and ("weight sync", 2.0, 3.0) in lanes
    assert ("step", 0.0, 6.0) in lanes and ("step", 6.0, 7.0) in lanes
    phases.stop()
    assert phases.step_end(3) is None  # after training: nothing


def test_the_trace_is_chromes_trace_event_json(tmp_path):
    timeline = Timeline()
    t = timeline.began
    timeline.span(TRAINER, "generate", "generate", t + 0.001, t + 0.003)
    for start, end in ((0.001, 0.005), (0.002, 0.004)):  # overlapping requests on one server
        timeline.overlapping("http://127.0.0.1:8000", "request", t + start, t + end, status=200)
    timeline.overlapping("http://127.0.0.1:8000", "pause", t + 0.0025, t + 0.0026)
    path = timeline.write(str(tmp_path / "timeline" / "trace.json"))
    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {TRAINER, "http://127.0.0.1:8000"}
    (complete,) = [e for e in events if e["ph"] == "X"]
    assert complete["ts"] == pytest.approx(1000, abs=0.2) and complete["dur"] == pytest.approx(2000, abs=0.2)
    begins = {e["id"]: e for e in events if e["ph"] == "b"}
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert len(begins) == 3 and begins.keys() == ends.keys()  # each request its own id, begun and ended
    assert all(ends[i]["ts"] > begins[i]["ts"] and ends[i]["cat"] == begins[i]["cat"] for i in begins)
    assert not (tmp_path / "timeline" / "trace.json.partial").exists()


def test_the_switch_is_checked_and_read_from_yaml_and_the_command_line(tmp_path, monkeypatch, tiny_llama):
    from trl import ModelConfig, TrlParser

    from trl_scale.cli import _import_trl_script_types

    with pytest.raises(ValueError, match="rollout_timeline='false': use True or False"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, rollout_timeline="false"))
    script_type, _ = _import_trl_script_types()
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path}\nrollout_timeline: true\nuse_cpu: true\nbf16: false\n")
    for config_cls in (trl_scale.GRPOConfig, trl_scale.RLOOConfig, trl_scale.PPOConfig):
        _, args, _ = TrlParser((script_type, config_cls, ModelConfig)).parse_args_and_config(["--config", str(config)])
        assert args.rollout_timeline is True
    parser = TrlParser((script_type, trl_scale.GRPOConfig, ModelConfig))
    _, args, _ = parser.parse_args_and_config(["--config", str(config), "--rollout_timeline", "false"])
    assert args.rollout_timeline is False
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(
        ValueError, match=r"rollout_timeline=True draws timeline.png with matplotlib.*trl-scale\[timeline\]"
    ):
        local_run(tiny_llama, tmp_path / "out")


class StepEnds(TrainerCallback):
    """perf_counter at each step's end, measured apart from the timeline."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def local_run(model_path: str, out, **overrides):
    from trl_scale.toy import counting_prompts

    settings = dict(num_generations=4, max_completion_length=4, max_steps=4, rollout_timeline=True)
    return trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def trace_steps(trace: dict) -> list[dict]:
    """Per step in the trace: its duration and the trainer lanes' seconds within it, by lane (microseconds)."""
    events = trace["traceEvents"]
    trainer_pid = next(e["pid"] for e in events if e["ph"] == "M" and e.get("args", {}).get("name") == TRAINER)
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == trainer_pid]
    steps = []
    for step in sorted((e for e in spans if lanes[e["tid"]] == "step"), key=lambda e: e["ts"]):
        begin, end = step["ts"], step["ts"] + step["dur"]
        inside: dict[str, float] = {}
        for e in spans:
            if lanes[e["tid"]] != "step" and e["ts"] >= begin - 1 and e["ts"] + e["dur"] <= end + 1:
                inside[lanes[e["tid"]]] = inside.get(lanes[e["tid"]], 0.0) + e["dur"]
        steps.append({"name": step["name"], "dur": step["dur"], "lanes": inside})
    return steps


def check_trace_accounts_for_steps(out, ends: list[float], steps: int) -> list[dict]:
    """The trace in `out/timeline`: one span per step, whose durations are the wall time between step ends measured
    apart (`ends`), and within each the trainer lanes sum to the step within STEP_TOLERANCE; the PNG drawn."""
    trace = json.loads((out / "timeline" / "trace.json").read_text())
    recorded = trace_steps(trace)
    assert [s["name"] for s in recorded] == [f"step {i}" for i in range(1, steps + 1)]
    walls = [b - a for a, b in zip(ends, ends[1:])]  # steps 2..: between the ends measured by the test
    for step, wall in zip(recorded[1:], walls):
        assert step["dur"] / 1e6 == pytest.approx(wall, rel=STEP_TOLERANCE, abs=0.002), (step, wall)
    for step in recorded:
        assert sum(step["lanes"].values()) == pytest.approx(step["dur"], rel=STEP_TOLERANCE), step
        assert step["lanes"].get("backward", 0) > 0 and step["lanes"].get("scoring", 0) > 0, step
    png = (out / "timeline" / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    return recorded


def test_a_local_run_writes_a_trace_that_accounts_for_each_step_and_its_png(tiny_llama, tmp_path):
    trainer = local_run(tiny_llama, tmp_path)
    ends = StepEnds()
    trainer.add_callback(ends)
    trainer.train()
    recorded = check_trace_accounts_for_steps(tmp_path, ends.ends, 4)
    assert all(s["lanes"].get("generate", 0) > 0 and s["lanes"].get("rewards", 0) > 0 for s in recorded)
    first = next(log for log in trainer.state.log_history if "time/to_first_step_s" in log)
    # from train() to the first step's end: the first step's span, which starts when training does
    assert first["time/to_first_step_s"] == pytest.approx(recorded[0]["dur"] / 1e6, abs=0.01)
    assert sum("time/to_first_step_s" in log for log in trainer.state.log_history) == 1


def test_slow_rewards_in_a_streaming_step_hint_at_stream_rewards_once(monkeypatch, caplog):
    """At the default (stream_rewards=None: rewards in the step without environments) a streaming run whose rewards
    take a quarter of the step or more is told once that the switch exists; not for the first log (start-up), not
    where rewards already stream, not when the user chose False."""
    from trl_scale.trainers import timing as timing_module
    from trl_scale.trainers.plan import RolloutPlan, RunPlan
    from trl_scale.trainers.timing import PhaseTiming

    now = [0.0]
    monkeypatch.setattr(timing_module.time, "perf_counter", lambda: now[0])

    def timing(stream_rewards=None, in_stream=False, environments=False) -> PhaseTiming:
        rollout = RolloutPlan(
            client="trl_scale",
            environments=environments,
            takes_groups=True,
            rewards_in_stream=in_stream,
            stream_rewards_chosen=stream_rewards is not None,
        )
        return PhaseTiming.build(RunPlan("GRPOTrainer", rollout=rollout))

    def run(stamp: PhaseTiming, reward_share: float, logs: int = 3):
        for _ in range(logs):
            with stamp.timed("reward"):
                now[0] += 10 * reward_share
            now[0] += 10 * (1 - reward_share)
            stamp.log(None, {"loss": 0.0})

    with caplog.at_level("WARNING", logger="trl_scale"):
        run(timing(), reward_share=0.1)
        run(timing(stream_rewards=False), reward_share=0.5)
        run(timing(in_stream=True), reward_share=0.5)
        run(timing(environments=True), reward_share=0.5)
        run(timing(), reward_share=0.5, logs=1)  # the first log only: start-up, not judged
        assert "stream_rewards=True computes" not in caplog.text
        run(timing(), reward_share=0.5)
    hints = [r for r in caplog.records if "stream_rewards=True computes" in r.getMessage()]
    assert len(hints) == 1 and "rewards took 50% of the last steps' time" in hints[0].getMessage()


def test_a_written_timeline_reads_back_with_its_steps(tmp_path):
    """`Timeline.read` gives back what `write` wrote (every span and request, the lanes in order) and
    `recorded_steps` the clock's steps with their phases: a stored run's timeline is drawn again (the docs do)."""
    from trl_scale.timeline import MISMATCH_COUNTER, PhaseClock, Timeline, recorded_steps
    from trl_scale.timeline.render import render_png

    now = [100.0]
    timeline = Timeline()
    timeline.began = 100.0
    clock = PhaseClock(timeline, clock=lambda: now[0])
    clock.start()
    for step in (1, 2):
        with clock.phase("generate"):
            now[0] += 0.5
            timeline.overlapping("http://a", "request", now[0] - 0.4, now[0] + 0.3, tokens=8)
        with clock.phase("backward"):
            now[0] += 0.25
        now[0] += 0.1  # other
        timeline.counter("http://a", MISMATCH_COUNTER, now[0], kl=10.0**-step, step=step, sync=step)
        clock.step_end(step)
    clock.stop()
    back = Timeline.read(timeline.write(str(tmp_path / "trace.json")))
    for got, expected in zip(sorted(back.spans()), sorted(timeline.spans()), strict=True):
        assert got[:3] == expected[:3] and got[5] == expected[5]
        assert abs(got[3] - expected[3]) < 1e-6 and abs(got[4] - expected[4]) < 1e-6
    # the counters (the mismatch gate's per server and step): a counter track each, the same values back
    counters = [(g, name, values) for g, name, _, values in back.counters()]
    assert counters == [
        ("http://a", MISMATCH_COUNTER, {"kl": 0.1, "step": 1, "sync": 1}),
        counters[0][:2] + ({"kl": 0.01, "step": 2, "sync": 2},),
    ]
    assert not any(name == MISMATCH_COUNTER for _, _, name, *_ in back.spans())  # not a span
    png = render_png(back, recorded_steps(back), [(1, 0.2), (2, 0.4)], str(tmp_path / "timeline.png"))
    assert png is not None and (tmp_path / "timeline.png").stat().st_size > 0
    steps = recorded_steps(back)
    assert [s.step for s in steps] == [1, 2]
    for got, expected in zip(steps, clock.steps, strict=True):
        assert abs((got.end - got.start) - (expected.end - expected.start)) < 1e-6
        assert got.phases.keys() == expected.phases.keys()
        assert all(abs(got.phases[k] - expected.phases[k]) < 1e-6 for k in got.phases)
