"""GRPO whose reward is model output run as code, in a sandbox, on reward servers (CPU, offline, a few minutes).

    python examples/grpo_sandboxed_reward.py [--servers 2] [--max-steps 60]

Two `trl-scale reward-server --reward code` processes (bubblewrap sandboxes, OpenRLHF's remote reward contract on
127.0.0.1) score the toy counting task with its answer run as a program (`trl_scale.toy.code_task`); the trainer
reaches them through `RemoteReward`, one request per prompt group, routed and failed over. For a real run: your
dataset with a `tests` column ({"call": ..., "expected": ...} or {"stdin": ..., "stdout": ...}), the servers on
other machines with `--api-key`, and no `--extract` (the code is the completion's last fenced block).
"""

import argparse
import os
import signal
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_scale import GRPOConfig, GRPOTrainer, RemoteReward
from trl_scale.net import answers_health, free_port
from trl_scale.toy import COUNT_TARGET_LENGTH, build_tiny_model, counting_code_prompts
from trl_scale.toy.demo import evaluate_counting, warm_up

SERVER = ["-m", "trl_scale.cli", "reward-server", "--reward", "code"]
SERVER += ["--extract", "trl_scale.toy:number_words_as_code"]  # the toy's answer is number words: as a program


def start_servers(count: int, processes: list[subprocess.Popen]) -> list[str]:
    """`count` reward servers, each appended to `processes` as it starts (the caller stops them however it ends)."""
    urls = []
    for _ in range(count):
        port = free_port()
        processes.append(subprocess.Popen([sys.executable, *SERVER, "--port", str(port), "--wall-seconds", "5"]))
        urls.append(f"http://127.0.0.1:{port}/get_reward")
    for url in urls:  # a server is up in well under a second
        deadline = time.monotonic() + 60
        while not answers_health(url.removesuffix("/get_reward")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reward server {url} did not start")
            time.sleep(0.1)
    return urls


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="outputs/grpo-sandboxed-reward")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # An "SFT checkpoint": a tiny model warmed up on noisy counting text, saved like any checkpoint.
    base = build_tiny_model(os.path.join(args.output_dir, "base-model"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    warm_up(model, tokenizer, steps=60)
    before = evaluate_counting(model, tokenizer)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run stops its servers too (the finally below)
    processes: list[subprocess.Popen] = []
    try:
        urls = start_servers(args.servers, processes)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=RemoteReward(urls, label_column="tests"),
            args=GRPOConfig(
                output_dir=args.output_dir,
                max_steps=args.max_steps,
                per_device_train_batch_size=64,
                num_generations=8,
                max_completion_length=COUNT_TARGET_LENGTH,
                learning_rate=args.learning_rate,
                lr_scheduler_type="constant",
                logging_steps=10,
                report_to="none",
                save_strategy="no",
                bf16=False,
                use_cpu=True,
                activation_checkpointing=False,
            ),
            train_dataset=counting_code_prompts(args.max_steps * 8),
            processing_class=tokenizer,
        )
        trainer.train()
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    after = evaluate_counting(trainer.model, tokenizer)
    print(f"counting reward: {before:.3f} before GRPO, {after:.3f} after (scored in sandboxes on {len(urls)} servers)")


if __name__ == "__main__":
    main()
