"""The mismatch probe against real vLLM (CPU build): each server's figures and the probe's cost.

    python benchmarks/mismatch.py

Three servers: the policy in fp32 (the trainer's precision, vLLM), the policy in bfloat16 (`trl-scale serve`: vLLM's
CPU build dies on bfloat16 on this CPU), and another revision (vLLM: the policy's shape, names and tokenizer, a config
value a weight sync does not carry). One GRPO step of the demo's shape (64 completions, 8 per prompt) generating on
all three with `rollout_mismatch_action="warn"` gives each server's figures; the probe's cost is measured on two vLLM
servers of the policy, the same step with the probe and without. The last line printed is one JSON object, also
appended to `benchmarks/results/mismatch_cpu.jsonl` (the docs page and its picture read it)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests/real_vllm.py: the harness that starts real vLLM servers

SERVERS = ("fp32", "bf16", "other_revision")
REPEATS = 3


def _first_step(policy: str, urls: list[str], work: str, **fields) -> dict:
    """One GRPO step of the demo's shape generating on `urls`: its first log."""
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy import counting_prompts, counting_reward
    from trl_scale.toy.demo import demo_config

    config = trl_scale.GRPOConfig(
        **demo_config(tempfile.mkdtemp(dir=work), max_steps=1),
        use_cpu=True,
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        **fields,
    )
    tokenizer = AutoTokenizer.from_pretrained(policy)
    trainer = trl_scale.GRPOTrainer(
        policy, counting_reward, config, counting_prompts(256, seed=0), processing_class=tokenizer
    )
    trainer.train()
    return next(log for log in trainer.state.log_history if "loss" in log)


def _record(first: dict, runs: dict, budget: float) -> dict:
    """The JSON line: each server's probe figures (from `first`), the cost (medians of `runs`)."""
    figures = {
        name: {k.rsplit("/", 1)[1]: v for k, v in first.items() if k.startswith(f"rollout/mismatch_probe/server{i}/")}
        for i, name in enumerate(SERVERS)
    }
    probe_s = statistics.median(log["rollout/mismatch_probe/seconds"] for log in runs["with"])
    first_step_s = statistics.median(log["time/to_first_step_s"] for log in runs["with"])
    without_s = statistics.median(log["time/to_first_step_s"] for log in runs["without"])
    record = {
        "benchmark": "mismatch",
        "servers": figures,
        "repeats": REPEATS,
        "probe_s": probe_s,
        "first_step_s": first_step_s,
        "first_step_without_probe_s": without_s,
        "probe_share_of_first_step": probe_s / first_step_s,
        "first_step_ratio": first_step_s / without_s,
        "default_budget": budget,
        "code": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "date": str(datetime.date.today()),
        "machine": "2-core CPU, nothing else running",
    }
    return record


def main() -> dict:
    import transformers

    from tests.helpers import start_servers
    from tests.real_vllm import VLLM_PYTHON, start_vllm_servers, vllm_cpu_available
    from trl_scale.mismatch.arguments import DEFAULT_BUDGET
    from trl_scale.toy import build_tiny_model
    from trl_scale.toy.models import VLLM_CPU_SHAPE

    if not vllm_cpu_available():
        raise SystemExit(f"real vLLM is not installed at {VLLM_PYTHON}: bash scripts/setup_vllm.sh")
    transformers.logging.set_verbosity_error()
    work = tempfile.mkdtemp(prefix="mismatch-bench-")
    shape = {**VLLM_CPU_SHAPE, "initializer_range": 0.2}  # peaked next-token distributions, as a trained model's
    policy = build_tiny_model(os.path.join(work, "policy"), **shape)
    other = build_tiny_model(os.path.join(work, "other"), seed=11, rms_norm_eps=0.5, **shape)
    flags = ("--logprobs-mode", "processed_logprobs", "--weight-transfer-config", '{"backend":"trl_scale_gloo"}')
    # vLLM's CPU build dies on bfloat16 on this CPU (SIGILL): the bfloat16 server is trl-scale serve
    (bf16,) = start_servers(policy, 1, ("--dtype", "bfloat16"))
    fp32, second, wrong = start_vllm_servers([(policy, flags, {}), (policy, flags, {}), (other, flags, {})])
    try:
        # the figures: one probe over the three kinds of server
        first = _first_step(policy, [fp32.url, bf16.url, wrong.url], work, rollout_mismatch_action="warn")
        # the cost: the demo's shape on two vLLM servers of the policy, with the probe and without (same seed), in
        # turns after one step that warms both servers (a fresh vLLM CPU server's first request takes ~2 s)
        pair = [fp32.url, second.url]
        _first_step(policy, pair, work, rollout_mismatch_budget=None)
        runs = {"with": [], "without": []}
        for _ in range(REPEATS):
            runs["with"].append(_first_step(policy, pair, work))
            runs["without"].append(_first_step(policy, pair, work, rollout_mismatch_budget=None))
    finally:
        for server in (fp32, second, wrong, bf16):
            server.stop()
    record = _record(first, runs, DEFAULT_BUDGET)
    with open(os.path.join(ROOT, "benchmarks", "results", "mismatch_cpu.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
