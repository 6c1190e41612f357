"""End-to-end training time: stock TRL vs trl-scale with its defaults, side by side in one process.

For GRPO, RLOO and DPO, and three padding regimes (low, ~35 %, ~70 % of the padded scoring batch), the same tiny
Llama (built from a config, saved and loaded with ``from_pretrained``), the same data and the same seed train for a
few steps with ``trl.XTrainer`` and with ``trl_scale.XTrainer``; runs alternate (TRL first, then trl-scale first)
so that drift of the machine hits both. The figure is the median wall time of a training step (generation,
rewards and scoring included for GRPO/RLOO) after a warm-up step; the ratio is trl-scale / TRL.

Regimes come from prompt lengths (GRPO/RLOO: EOS is suppressed so every completion has the same length, and the
padding is the prompts'; DPO: prompt and answer lengths vary the same way), in blocks of four with one long prompt
(see REGIMES). The padding fraction printed is the one trl-scale measured on its scoring calls.

The "long" regime (prompts of 200-600 words, 32-token completions, G=8, local generation) is where a group's shared
prompt dominates: run it with ``--trainers grpo,rloo --regimes long``.

Usage: python benchmarks/e2e.py [--quick] [--trainers grpo,rloo,dpo] [--regimes low,mid,high,long]
The last line printed is one JSON object with ``e2e_time_ratio[trainer][regime]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Prompt lengths in words, in blocks of four: the four prompts of one GRPO/RLOO step (shuffling off, so each step
# sees one block), or a quarter of a DPO batch's rows. Each block's first prompt is the longest; the padding of a
# scoring batch comes from the others being shorter (completions all have the same length: EOS is suppressed).
BLOCK = 4
REGIMES = {
    "low": lambda rng: [rng.randint(30, 32) for _ in range(BLOCK)],  # ~1 %
    "mid": lambda rng: [180] + [rng.randint(15, 130) for _ in range(BLOCK - 1)],  # ~35 %
    "high": lambda rng: [400] + [rng.randint(2, 6) for _ in range(BLOCK - 1)],  # ~70 %
    # long prompts, short completions (issue 61): each prompt's G rows share it, which tree packing forwards once
    "long": lambda rng: [rng.randint(200, 600) for _ in range(BLOCK)],
}


def prompt_lengths(regime: str, count: int, rng: random.Random) -> list[int]:
    lengths = []
    while len(lengths) < count:
        lengths += REGIMES[regime](rng)
    return lengths[:count]


def random_text(length: int, rng: random.Random) -> str:
    from trl_scale.toy import TOY_WORDS

    return " ".join(rng.choice(TOY_WORDS) for _ in range(length))


def online_dataset(regime: str, count: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_list([{"prompt": random_text(n, rng)} for n in prompt_lengths(regime, count, rng)])


def preference_dataset(regime: str, count: int, seed: int):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for n in prompt_lengths(regime, count, rng):
        answer = max(2, n // 4) if regime != "low" else 16
        rows.append(
            {
                "prompt": random_text(n, rng),
                "chosen": " " + random_text(answer, rng),
                "rejected": " " + random_text(max(1, answer + rng.randint(-answer // 2, answer // 2)), rng),
            }
        )
    return Dataset.from_list(rows)


def number_words_reward(completions, **kwargs) -> list[float]:
    from trl_scale.toy import NUMBER_WORDS

    return [sum(w in NUMBER_WORDS for w in c.split()) / max(1, len(c.split())) for c in completions]


class StepTimer:
    """A TrainerCallback that records the wall time of every optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer.seconds.append(time.perf_counter() - timer._start)

        self.seconds: list[float] = []
        self.callback = _Callback()


def run_once(trainer_name: str, impl: str, regime: str, model_path: str, args) -> dict:
    import torch
    import trl

    import trl_scale

    package = trl if impl == "trl" else trl_scale
    torch.manual_seed(args.seed)
    timer = StepTimer()
    out_dir = tempfile.mkdtemp(prefix=f"e2e-{trainer_name}-{impl}-")
    common = dict(
        output_dir=out_dir,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=False,
        seed=args.seed,
        disable_tqdm=True,
    )
    if trainer_name in ("grpo", "rloo"):
        from transformers import AutoTokenizer

        eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
        config_cls = getattr(package, f"{trainer_name.upper()}Config")
        trainer_cls = getattr(package, f"{trainer_name.upper()}Trainer")
        config = config_cls(
            per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations,
            max_completion_length=args.completion_length,
            generation_kwargs={"suppress_tokens": [eos]},
            shuffle_dataset=False,
            **common,
        )
        dataset = online_dataset(regime, args.batch_size * args.steps, args.seed)
        trainer = trainer_cls(
            model=model_path,
            reward_funcs=number_words_reward,
            args=config,
            train_dataset=dataset,
            callbacks=[timer.callback],
        )
    else:
        config = package.DPOConfig(per_device_train_batch_size=args.batch_size, **common)
        dataset = preference_dataset(regime, args.batch_size * args.steps, args.seed)
        trainer = package.DPOTrainer(model=model_path, args=config, train_dataset=dataset, callbacks=[timer.callback])
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    trainer.train()
    history = trainer.state.log_history
    pad = [h["padding_free/pad_fraction_removed"] for h in history if "padding_free/pad_fraction_removed" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    if len(timer.seconds) != args.steps:
        raise RuntimeError(f"{trainer_name}/{impl}/{regime}: {len(timer.seconds)} steps timed, {args.steps} expected")
    return {"seconds": timer.seconds[1:], "pad_fraction": statistics.mean(pad) if pad else None, "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats (a few minutes)")
    parser.add_argument("--trainers", default="grpo,rloo,dpo")
    parser.add_argument("--regimes", default="low,mid,high")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.steps = 3 if args.quick else 8  # the first step of each run is a warm-up, not timed
    args.repeats = 2 if args.quick else 4  # alternated: TRL first, then trl-scale first, ...
    args.batch_size, args.num_generations, args.completion_length = 32, 8, 32

    import torch

    from trl_scale.toy import build_tiny_model

    model_path = build_tiny_model(
        tempfile.mkdtemp(prefix="e2e-model-"), "llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4
    )
    print(f"torch threads: {torch.get_num_threads()}; Llama h256 x4 layers, sdpa, fp32, CPU; batch {args.batch_size}")
    print(f"{'trainer':<7}{'regime':<7}{'padding':>9}{'TRL s/step':>12}{'trl-scale':>11}{'ratio':>8}")
    ratios: dict[str, dict[str, float]] = {}
    details = []
    for trainer_name in args.trainers.split(","):
        for regime in args.regimes.split(","):
            times = {"trl": [], "trl_scale": []}
            pad = None
            for rep in range(args.repeats):
                for impl in ("trl", "trl_scale") if rep % 2 == 0 else ("trl_scale", "trl"):
                    result = run_once(trainer_name, impl, regime, model_path, args)
                    times[impl] += result["seconds"]
                    pad = result["pad_fraction"] if impl == "trl_scale" else pad
            stock, ours = statistics.median(times["trl"]), statistics.median(times["trl_scale"])
            ratio = ours / stock
            ratios.setdefault(trainer_name, {})[regime] = round(ratio, 3)
            details.append(
                {"trainer": trainer_name, "regime": regime, "pad_fraction": pad, "trl_s": stock, "trl_scale_s": ours}
            )
            pad_text = f"{pad:.0%}" if pad is not None else "n/a"
            print(f"{trainer_name:<7}{regime:<7}{pad_text:>9}{stock:>12.3f}{ours:>11.3f}{ratio:>8.2f}", flush=True)
    print(json.dumps({"benchmark": "e2e", "quick": args.quick, "e2e_time_ratio": ratios, "runs": details}))


if __name__ == "__main__":
    main()
