"""The hook trace (`trainers/trace.py`): each training log says which features' hooks ran since the last one, and
what it says is what ran (a feature the chain holds but that no step entered would show as missing here)."""

from __future__ import annotations

import logging
import re

from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts, counting_reward
from trl_scale.trainers.trace import HookTrace

from .helpers import cpu_args


def _traces(records, asides: list | None = None) -> list[dict[str, dict[str, int]]]:
    """Each logged trace line, parsed back: hook -> feature -> entries (and, into `asides`, hook -> feature -> the
    calls it stepped aside on)."""
    parsed = []
    for record in records:
        message = record.getMessage()
        if message.startswith("trl-scale trace since the last log: "):
            body = message.removeprefix("trl-scale trace since the last log: ")
            hooks, aside = {}, {}
            for part in body.split("; "):
                hook, features = part.split(": ", 1)
                entries = re.findall(r"(\w+) x(\d+)(?: \(aside x(\d+)\))?", features)
                hooks[hook] = {name: int(count) for name, count, _ in entries}
                aside[hook] = {name: int(skipped) for name, _, skipped in entries if skipped}
            parsed.append(hooks)
            if asides is not None:
                asides.append(aside)
    return parsed


def test_each_log_traces_the_hooks_that_ran_and_only_those(tiny_llama, tmp_path, caplog):
    config = trl_scale.GRPOConfig(
        **cpu_args(tmp_path, max_steps=2, per_device_train_batch_size=4),
        num_generations=4,
        max_completion_length=6,
    )
    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=counting_reward,
        args=config,
        train_dataset=counting_prompts(16, seed=0),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    calls = []
    scoring = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: calls.append(1) or scoring(*a, **k)
    with caplog.at_level(logging.INFO, logger="trl_scale"):
        trainer.train()
    asides = []
    traces = _traces(caplog.records, asides)
    assert len(traces) == 2, "one trace per training log (logging_steps=1, two steps)"
    # packed scoring takes TRL's local generation only under sequence parallelism: here it steps aside every time
    for trace, aside in zip(traces, asides):
        assert aside.get("single_turn", {}).get("packed_scoring") == trace["single_turn"]["packed_scoring"] > 0
    takers = trainer.features.by_hook()
    for trace in traces:
        for hook, features in trace.items():
            assert set(features) <= set(takers[hook]), (hook, features, takers[hook])
        # one generation batch per step: each of its takers entered once
        assert trace["generate_and_score"] == dict.fromkeys(takers["generate_and_score"], 1)
    # scoring's takers entered as often as TRL scored, over both logs (the adapter's method is the chain's)
    for name in takers["scoring"]:
        assert sum(trace["scoring"][name] for trace in traces) == len(calls)


def test_the_trace_counts_and_starts_again_when_taken():
    trace = HookTrace()
    trace.entered("packed_scoring", "scoring")
    trace.entered("packed_scoring", "scoring")
    trace.entered("ratio_metrics", "generate_and_score")
    hooks = trace.taken()
    assert hooks == {"scoring": {"packed_scoring": 2}, "generate_and_score": {"ratio_metrics": 1}}
    assert HookTrace.line(hooks) == "scoring: packed_scoring x2; generate_and_score: ratio_metrics x1"
    assert trace.taken() == {} and HookTrace.line({}) == "none"


def test_the_trace_says_where_a_feature_that_decides_per_call_stepped_aside():
    trace = HookTrace()
    trace.entered("dynamic_sampling", "generate_and_score")
    trace.entered("dynamic_sampling", "generate_and_score")
    trace.stepped_aside("dynamic_sampling", "generate_and_score")
    hooks, aside = trace.taken_with_asides()
    assert HookTrace.line(hooks, aside) == "generate_and_score: dynamic_sampling x2 (aside x1)"
    assert trace.taken_with_asides() == ({}, {})


def test_every_per_call_decision_is_declared_and_traced():
    """A feature that steps aside on a call says so in the trace (`run.trace.stepped_aside(self.name, hook)`) and
    declares it (`STEPS_ASIDE`, printed by `trl-scale step`): the one is there exactly where the other is."""
    import ast
    import inspect

    from trl_scale.trainers.feature import Feature
    from trl_scale.trainers.online import ONLINE_FEATURES

    from .helpers import ROOT

    kinds = {kind for kind in ONLINE_FEATURES if issubclass(kind, Feature)}
    for path in (ROOT / "trl_scale" / "trainers").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                traced = {
                    call.args[1].value
                    for call in ast.walk(node)
                    if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "stepped_aside"
                    and isinstance(call.args[1], ast.Constant)
                }
                kind = next((k for k in kinds if k.__name__ == node.name and inspect.getfile(k) == str(path)), None)
                declared = set(kind.STEPS_ASIDE) if kind is not None else set()
                assert traced == declared, (node.name, traced, declared)
