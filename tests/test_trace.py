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


def _traces(records) -> list[dict[str, dict[str, int]]]:
    """Each logged trace line, parsed back: hook -> feature -> entries."""
    parsed = []
    for record in records:
        message = record.getMessage()
        if message.startswith("trl-scale trace since the last log: "):
            body = message.removeprefix("trl-scale trace since the last log: ")
            hooks = {}
            for part in body.split("; "):
                hook, features = part.split(": ", 1)
                hooks[hook] = {m[0]: int(m[1]) for m in re.findall(r"(\w+) x(\d+)", features)}
            parsed.append(hooks)
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
    traces = _traces(caplog.records)
    assert len(traces) == 2, "one trace per training log (logging_steps=1, two steps)"
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
