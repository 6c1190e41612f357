"""Critic placement: co-located (the critic in the trainer process, its update after the policy's) vs split (the
critic on its own Ray role group, its update overlapping the policy's), PPO on the same model and data in one
run, with policy and critic of the same size so their costs are balanced.

Step time is the median over update-only steps (PPO epochs after the first reuse the rollout: no generation).
Each process uses one thread, so the split critic gets a core of its own as it would get its own GPUs.

Usage: python benchmarks/placement.py [--quick] [--profile]. The last line printed is one JSON object. With
`--profile`, each update step is split into where its time went (medians): handing the critic its batch
(`dispatch`), the policy's forward and backward (`policy`), waiting for the critic's result after them
(`critic_wait`), and the rest of the step (the optimizer steps, logging); for the co-located run, `critic` is the
critic's own update, run in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _profiled(trainer, phases: dict) -> None:
    """Time the critic's dispatch and result wait, and the policy's micro-step, inside each update step."""
    step_async, training_step = trainer.critic.step_async, trainer.training_step

    class Timed:
        def __init__(self, pending):
            self.pending = pending

        def result(self):
            start = time.perf_counter()
            try:
                return self.pending.result()
            finally:
                phases["critic_wait"].append(time.perf_counter() - start)

    def timed_step_async(batch, train=True):
        start = time.perf_counter()
        pending = step_async(batch, train=train)
        phases["dispatch"].append(time.perf_counter() - start)
        return Timed(pending)

    def timed_training_step(*args, **kwargs):
        start = time.perf_counter()
        waited = len(phases["critic_wait"])
        loss = training_step(*args, **kwargs)
        total = time.perf_counter() - start
        wait = phases["critic_wait"][-1] if len(phases["critic_wait"]) > waited else 0.0
        phases["policy"].append(total - wait - phases["dispatch"][-1])
        return loss

    trainer.critic.step_async, trainer.training_step = timed_step_async, timed_training_step


def run(backend: str, model_path: str, steps: int, phases: dict | None = None) -> list[float]:
    import warnings

    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    import trl_scale
    from trl_scale.toy import counting_prompts

    warnings.filterwarnings("ignore")
    durations = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            durations.append(time.perf_counter() - self.start)

    def reward(completion_ids, **kwargs):
        return [sum(t % 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]

    config = trl_scale.PPOConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=16,
        max_completion_length=48,
        num_ppo_epochs=4,
        num_mini_batches=1,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        activation_checkpointing=False,
        backend=backend,
        critic_placement={"num_cpus_per_worker": 1},
    )
    trainer = trl_scale.PPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=config,
        train_dataset=counting_prompts(512),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(StepTimer())
    if phases is not None:
        _profiled(trainer, phases)
    trainer.train()
    # Steps 0, 4, 8, ... generate; the others only update.
    return [d for i, d in enumerate(durations) if i % 4 != 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true", help="where each update step's time went")
    args = parser.parse_args()
    import ray
    import torch

    from trl_scale.toy import build_tiny_model

    torch.set_num_threads(1)
    model_path = build_tiny_model(
        tempfile.mkdtemp(prefix="placement-"), hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    steps = 12 if args.quick else 32
    from collections import defaultdict

    profiles = {"colocated": defaultdict(list), "split": defaultdict(list)} if args.profile else None
    colocated = run("local", model_path, steps, profiles and profiles["colocated"])
    split = run("ray", model_path, steps, profiles and profiles["split"])
    ray.shutdown()
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
    c, s = median(colocated), median(split)
    print("PPO update step (policy and critic: Llama h256 x4 layers; 16 sequences x <=48 new tokens; 1 thread each)")
    print(f"co-located (serial): {c:.3f} s   split (critic on a Ray group): {s:.3f} s   ratio {s / c:.2f}")
    print(
        json.dumps(
            {
                "benchmark": "placement",
                "quick": args.quick,
                "colocated_step_s": c,
                "split_step_s": s,
                "split_vs_colocated_step_time": s / c,
                "update_steps_measured": len(split),
                **({"profile": _summary(profiles, colocated, split, median)} if profiles else {}),
            }
        )
    )


def _summary(profiles: dict, colocated: list[float], split: list[float], median) -> dict:
    """Median seconds per update step of each phase (update steps only: every 4th step generates). The local
    critic runs inside `dispatch` (its step is synchronous), so there `dispatch` is the critic's own update."""
    summary = {}
    for name, durations in (("colocated", colocated), ("split", split)):
        phases = profiles[name]
        keep = [i for i in range(len(phases["policy"])) if i % 4 != 0]  # one micro-step per step here
        row = {
            phase: round(median([values[i] for i in keep if i < len(values)]), 4) for phase, values in phases.items()
        }
        row["step"] = round(median(durations), 4)
        row["rest"] = round(row["step"] - row.get("dispatch", 0) - row.get("policy", 0) - row.get("critic_wait", 0), 4)
        summary[name] = row
    return summary


if __name__ == "__main__":
    main()
