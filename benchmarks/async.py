"""Asynchronous rollout: GRPO step time over 2 `trl-scale serve` processes, synchronous (staleness 0, what TRL
does: generate, then train) vs staleness 1 and 2 (the servers generate the next batches while the trainer trains).

The servers get a per-token delay chosen so that generating a batch takes about as long as training on it (the
regime where overlap matters; measured first with no delay). Same model, data, seed and servers for every run;
runs alternate (sync, 1, 2, sync, 1, 2, ...), and each run's step time is the mean over its steps after a warm-up.
The trainer and the servers are pinned to separate halves of the cores (on 2 cores: one each); sharing them, the
servers' own compute takes the trainer's cores and overlap hides only the delay.

Usage: python benchmarks/async.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

from rollout import start_server, wait_ready  # benchmarks/rollout.py: `trl-scale serve` processes


def split_cores() -> tuple[set[int] | None, set[int] | None]:
    """Trainer cores and server cores: half each, so neither side's compute slows the other (as with servers on
    their own GPUs, the case async rollout is for). None where the platform cannot pin or has one core."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def servers(model_path: str, delay: float, cpus: set[int] | None) -> tuple[list[subprocess.Popen], list[str]]:
    started = [start_server(model_path, delay, cpus) for _ in range(2)]
    for _, url in started:
        wait_ready(url)
    return [process for process, _ in started], [url for _, url in started]


def step_times(
    model_path: str, urls: list[str], staleness: int, steps: int, warmup: int, out: str, generate_seconds=None
) -> list[float]:
    from transformers import AutoTokenizer, TrainerCallback

    import trl_scale
    from trl_scale.toy import counting_prompts, counting_reward

    times = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    trainer = trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=counting_reward,
        args=trl_scale.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=BATCH,
            num_generations=NUM_GENERATIONS,
            max_completion_length=MAX_TOKENS,
            max_steps=steps,
            learning_rate=1e-3,
            logging_steps=1000,
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
            rollout_max_inflight_per_server=1,  # one request at a time per server: both servers share the work
            rollout_request_timeout=300,
            weight_sync_timeout=300,
        ),
        train_dataset=counting_prompts(4096, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.add_callback(Clock())
    if generate_seconds is not None:  # time inside generation (calibration)
        generation = trainer.vllm_generation
        generate = generation.generate

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                generate_seconds.append(time.perf_counter() - start)

        generation.generate = timed
    trainer.train()
    trainer.vllm_generation.client.close()
    intervals = [b - a for a, b in zip(times, times[1:])]
    return intervals[warmup:]


MAX_TOKENS = 8
NUM_GENERATIONS = 8
BATCH = 64  # completions per step: 8 prompts x 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from trl_scale.toy import build_tiny_model

    transformers.logging.set_verbosity_error()
    trainer_cores, server_cores = split_cores()
    if trainer_cores:
        import torch

        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
    steps, warmup, repeats = (14, 3, 2) if args.quick else (40, 5, 3)
    work = tempfile.mkdtemp(prefix="async-bench-")
    # A small model rather than the tests' tiny one: training does enough arithmetic that it, not Python overhead,
    # sets the step time. The servers run on their own cores (split_cores), and the delay stands for the rest of
    # a GPU server's generation time.
    model_path = build_tiny_model(os.path.join(work, "model"), hidden_size=256, num_layers=4, intermediate_size=1024)

    # Calibrate: with instant servers, split a step into generation and the rest (training); then give the servers
    # a per-token delay (each holds its model token_delay x tokens x n per request) that makes generation take about
    # as long as training.
    processes, urls = servers(model_path, 0.0, server_cores)
    generate_seconds: list[float] = []
    try:
        calibration = step_times(model_path, urls, 0, 10, 3, os.path.join(work, "calibrate"), generate_seconds)
    finally:
        for process in processes:
            process.kill()
    step = statistics.mean(calibration)
    generation = statistics.mean(generate_seconds[3:])
    train_step = step - generation
    requests_per_server = BATCH // NUM_GENERATIONS // 2  # prompts per step (one request each), over 2 servers
    delay = max(0.0, train_step - generation) / (requests_per_server * MAX_TOKENS * NUM_GENERATIONS)

    processes, urls = servers(model_path, delay, server_cores)
    results: dict[int, list[float]] = {0: [], 1: [], 2: []}
    try:
        for repeat in range(repeats):
            for staleness in (0, 1, 2):
                out = os.path.join(work, f"run-{staleness}-{repeat}")
                results[staleness] += step_times(model_path, urls, staleness, steps, warmup, out)
    finally:
        for process in processes:
            process.kill()
    mean = {k: statistics.mean(v) for k, v in results.items()}
    ratios = {str(k): mean[k] / mean[0] for k in (1, 2)}
    print(
        f"with instant servers: step {step:.3f} s = generation {generation:.3f} s + training {train_step:.3f} s; "
        f"token delay {delay * 1000:.2f} ms"
    )
    for k in (0, 1, 2):
        print(f"staleness {k}: {mean[k]:.3f} s/step" + (f"  ({ratios[str(k)]:.2f} x sync)" if k else ""))
    print(
        json.dumps(
            {
                "benchmark": "async",
                "quick": args.quick,
                "train_step_s": train_step,
                "generation_with_instant_servers_s": generation,
                "token_delay_s": delay,
                "step_time_s": {str(k): v for k, v in mean.items()},
                "async_vs_sync_step_time": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
