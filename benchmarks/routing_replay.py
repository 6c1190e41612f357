"""Routing replay's figures: an fp32 trainer of a Qwen3-MoE (8 experts, top-2) generating on two bf16 `trl-scale
serve` servers that return their routes, GRPO with `routing_replay=True` and without, the same sampled completions
(seeded requests), the policy held still (learning rate 0: what differs is the sampler's precision and routes, not
training). Per step: `routing/agreement` (the share of (token, layer) whose trainer-chosen experts equal the
sampler's: what a run without replay trains on; with replay every token takes the sampler's) and the log-prob gap TRL
logs (`sampling/sampling_logp_difference/mean`, |trainer - sampler| over completion tokens), with and without replay.

    python benchmarks/routing_replay.py

The last line printed is one JSON object, also appended to `benchmarks/results/routing_replay_cpu.jsonl` (the docs
page reads it)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests/helpers.py: the harness that starts `trl-scale serve`

STEPS = 6
GAP = "sampling/sampling_logp_difference/mean"


def _run(policy: str, urls: list[str], work: str, replay: bool) -> list[dict]:
    from tests.helpers import server_grpo

    trainer = server_grpo(
        policy,
        tempfile.mkdtemp(dir=work),
        urls,
        max_steps=STEPS,
        routing_replay=replay,
        weight_sync="shared_dir",
        learning_rate=0.0,
        generation_kwargs={"seed": 0},
        max_completion_length=16,
        rollout_mismatch_action="warn",  # a bf16 MoE sampler can pass the default budget: measured, said
    )
    trainer.train()
    return [log for log in trainer.state.log_history if "loss" in log]


def main() -> dict:
    import transformers

    from tests.helpers import start_servers
    from trl_scale.toy import build_tiny_model

    transformers.logging.set_verbosity_error()
    work = tempfile.mkdtemp(prefix="routing-replay-bench-")
    # peaked router and next-token distributions, as a trained model's (a tiny random model's are nearly uniform)
    policy = build_tiny_model(os.path.join(work, "policy"), family="qwen3_moe", initializer_range=0.2)
    flags = ("--enable-return-routed-experts", "--dtype", "bfloat16")
    servers = start_servers(policy, 2, flags, flags)
    try:
        urls = [server.url for server in servers]
        with_replay = _run(policy, urls, work, replay=True)
        without = _run(policy, urls, work, replay=False)
    finally:
        for server in servers:
            server.stop()
    agreement = [log["routing/agreement"] for log in with_replay]

    def kl(logs: list[dict]) -> list[float]:  # the mismatch gate's per-step KL, averaged over the servers measured
        return [statistics.mean(v for k, v in log.items() if k.startswith("rollout/mismatch/") and k.endswith("/kl"))
                for log in logs]  # fmt: skip

    record = {
        "benchmark": "routing_replay",
        "model": "qwen3_moe, 8 experts, top-2, hidden 64, 2 layers, initializer_range 0.2",
        "sampler": "2 x trl-scale serve, bfloat16; trainer fp32",
        "steps": STEPS,
        "agreement": agreement,
        "agreement_median": statistics.median(agreement),
        "gap_with_replay": [log[GAP] for log in with_replay],
        "gap_without_replay": [log[GAP] for log in without],
        "gap_median_with_replay": statistics.median(log[GAP] for log in with_replay),
        "gap_median_without_replay": statistics.median(log[GAP] for log in without),
        "mismatch_kl_with_replay": kl(with_replay),
        "mismatch_kl_without_replay": kl(without),
        "code": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "date": str(datetime.date.today()),
        "machine": "2-core CPU",
    }
    with open(os.path.join(ROOT, "benchmarks", "results", "routing_replay_cpu.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")
    print(
        f"agreement {record['agreement_median']:.3f}; log-prob gap {record['gap_median_with_replay']:.2e} with "
        f"replay, {record['gap_median_without_replay']:.2e} without"
    )
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
