"""A streaming run's rollout timeline, recorded for the docs: GRPO on the tiny Llama over two `trl-scale serve`
processes (one slowed, so the servers differ), staleness 1, `rollout_timeline=True`, 6 steps. Writes the run's
trace and rewards to `benchmarks/results/timeline_streaming/` (what `benchmarks/charts.py` draws at the docs'
build with the run's own `render_png`). Usage: python benchmarks/timeline_example.py"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "benchmarks", "results", "timeline_streaming")


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import trl_scale
    from tests.helpers import cpu_args, start_servers, token_parity_reward
    from trl_scale.toy import build_tiny_model, counting_prompts

    work = tempfile.mkdtemp(prefix="timeline-example-")
    model = build_tiny_model(os.path.join(work, "model"))
    servers = start_servers(model, 2, ("--step-delay", "0.01"), ("--step-delay", "0.03"))
    try:
        config = trl_scale.GRPOConfig(
            **cpu_args(
                os.path.join(work, "run"), max_steps=6, num_generations=4, max_completion_length=16,
                use_vllm=True, vllm_mode="server", vllm_server_base_urls=[s.url for s in servers],
                async_rollout_staleness=1, rollout_timeline=True, weight_sync="shared_dir",
            )
        )  # fmt: skip
        trainer = trl_scale.GRPOTrainer(
            model=model, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(256)
        )
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    os.makedirs(OUT, exist_ok=True)
    shutil.copy(os.path.join(work, "run", "timeline", "trace.json"), os.path.join(OUT, "trace.json"))
    rewards = [(e["step"], e["reward"]) for e in trainer.state.log_history if "reward" in e and "step" in e]
    with open(os.path.join(OUT, "rewards.json"), "w") as handle:
        json.dump({"rewards": rewards, "run": "benchmarks/timeline_example.py, 2-core CPU"}, handle)
    print(OUT)


if __name__ == "__main__":
    main()
