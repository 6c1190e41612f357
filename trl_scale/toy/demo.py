"""The CPU demo: a tiny model learns to count with trl-scale's GRPO, offline, in about a minute.

1. Build a tiny Llama and the toy tokenizer in code, save them, load them back with ``from_pretrained``.
2. Warm up with a short supervised pass on noisy counting text (a weak counter, like an SFT model).
3. Train with ``trl_scale.GRPOTrainer`` on the counting task's verifiable reward.
4. Report reward before vs after (sampled, and greedy accuracy), save the model and a PNG of the reward curve.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..sharding.zero import whole_parameters
from .models import build_tiny_model
from .tasks import COUNT_TARGET_LENGTH, counting_prompts, counting_reward, number_word_corpus
from .training import supervised_steps


@dataclass
class DemoResult:
    reward_before: float  # mean sampled reward (temperature 1) on held-out prompts, before RL
    reward_after: float
    greedy_accuracy_before: float  # mean reward of greedy completions
    greedy_accuracy_after: float
    train_rewards: list[float]  # the `reward` GRPO logged at each step
    model_dir: str
    plot_path: str | None
    train_seconds: float


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    steps: int = 60,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 1,
) -> float:
    """A short supervised pass on noisy counting text; returns the last loss."""
    corpus = number_word_corpus(steps * batch_size, seed=seed)

    def batches():
        for step in range(steps):
            texts = [t + tokenizer.eos_token for t in corpus[step * batch_size : (step + 1) * batch_size]]
            batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right")
            yield batch, batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)

    return supervised_steps(model, batches(), learning_rate)


def build_counting_model(
    output_dir: str, family: str = "llama", seed: int = 0, warm_up_steps: int = 60, **config_kwargs
) -> str:
    """A tiny model of ``family`` warmed up on noisy counting text (a weak counter, like an SFT checkpoint, which
    RL then sharpens), saved with its tokenizer to ``output_dir``. A random model never earns the counting reward,
    so RL on it learns nothing. Deterministic for a ``seed``; ``config_kwargs`` change its shape."""
    base = build_tiny_model(output_dir, family=family, seed=seed, **config_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(base)
    # Whole, also under a ZeRO-3 launcher, where one process builds it while the others wait (see whole_parameters).
    with whole_parameters():
        model = AutoModelForCausalLM.from_pretrained(base)
        torch.manual_seed(seed)
        warm_up(model, tokenizer, steps=warm_up_steps)
        model.save_pretrained(output_dir)
    return output_dir


@torch.no_grad()
def evaluate_counting(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    num_prompts: int = 64,
    samples_per_prompt: int = 4,
    greedy: bool = False,
    seed: int = 123,
) -> float:
    """Mean counting reward of the model's completions on held-out prompts."""
    prompts = list(counting_prompts(num_prompts, seed=seed)["prompt"])
    if not greedy:
        prompts = [p for p in prompts for _ in range(samples_per_prompt)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    encoded = encoded.to(model.device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    output = model.generate(
        **encoded,
        max_new_tokens=COUNT_TARGET_LENGTH,
        do_sample=not greedy,
        temperature=1.0 if not greedy else None,
        top_k=0 if not greedy else None,
        top_p=1.0 if not greedy else None,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.random.set_rng_state(generator_state)
    completions = tokenizer.batch_decode(output[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = counting_reward(prompts, completions)
    return sum(rewards) / len(rewards)


def plot_rewards(rewards: list[float], path: str, before: float, after: float) -> str | None:
    """Save the reward curve as a PNG; returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(rewards) + 1), rewards, label="reward per GRPO step (sampled)", color="tab:blue")
    window = max(1, len(rewards) // 20)
    if len(rewards) >= window > 1:
        smooth = [sum(rewards[i - window + 1 : i + 1]) / window for i in range(window - 1, len(rewards))]
        ax.plot(range(window, len(rewards) + 1), smooth, color="tab:orange", label=f"moving mean ({window} steps)")
    ax.axhline(before, color="gray", linestyle="--", label=f"held-out before RL: {before:.2f}")
    ax.axhline(after, color="green", linestyle="--", label=f"held-out after RL: {after:.2f}")
    ax.set_xlabel("training step")
    ax.set_ylabel("counting reward")
    ax.set_ylim(0, 1.05)
    ax.set_title("trl-scale GRPO demo: a tiny model learns to count")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def demo_config(output_dir: str, max_steps=800, batch_size=64, num_generations=8, learning_rate=5e-4, seed=0) -> dict:
    """The demo's GRPO settings: a constant learning rate, no KL term, a log line per step, nothing saved."""
    return dict(
        output_dir=os.path.join(output_dir, "grpo"),
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        num_generations=num_generations,
        max_completion_length=COUNT_TARGET_LENGTH,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        activation_checkpointing=False,
        seed=seed,
        log_level="warning",
    )


def _progress_bar_only(trainer) -> None:
    """Keep the progress bar (when asked), drop the per-step metric dicts the Trainer prints at every log."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ProgressCallback):
            callback.on_log = lambda *args, **kwargs: None


def _warmed_up_model(output_dir: str, family: str, seed: int, warm_up_steps: int):
    """The tiny model built, saved and loaded back with `from_pretrained` (the real loading code), then warmed up."""
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.makedirs(output_dir, exist_ok=True)
    base_dir = build_tiny_model(os.path.join(output_dir, "base-model"), family=family, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    torch.manual_seed(seed)
    warm_up(model, tokenizer, steps=warm_up_steps)
    return model, tokenizer


def run_demo(
    output_dir: str = "trl-scale-demo",
    max_steps: int = 800,
    learning_rate: float = 5e-4,
    family: str = "llama",
    warm_up_steps: int = 60,
    per_device_train_batch_size: int = 64,
    num_generations: int = 8,
    seed: int = 0,
    show_progress: bool = True,
    make_plot: bool = True,
    **config_overrides,
) -> DemoResult:
    """Run the whole demo and return its figures. Everything lands under ``output_dir``."""
    import time

    from ..trainers import GRPOConfig, GRPOTrainer

    model, tokenizer = _warmed_up_model(output_dir, family, seed, warm_up_steps)
    reward_before = evaluate_counting(model, tokenizer)
    greedy_before = evaluate_counting(model, tokenizer, greedy=True)

    args = GRPOConfig(
        **demo_config(output_dir, max_steps, per_device_train_batch_size, num_generations, learning_rate, seed),
        disable_tqdm=not show_progress,
        **config_overrides,
    )
    prompts = counting_prompts(max_steps * per_device_train_batch_size // num_generations + 64, seed=seed)
    trainer = GRPOTrainer(model, counting_reward, args, prompts, processing_class=tokenizer)
    _progress_bar_only(trainer)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    train_rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]

    model = trainer.model
    model.eval()
    reward_after = evaluate_counting(model, tokenizer)
    greedy_after = evaluate_counting(model, tokenizer, greedy=True)

    model_dir = os.path.join(output_dir, "final-model")
    trainer.save_model(model_dir)
    tokenizer.save_pretrained(model_dir)
    curve = os.path.join(output_dir, "reward_curve.png")
    plot_path = plot_rewards(train_rewards, curve, reward_before, reward_after) if make_plot else None
    result = DemoResult(
        reward_before=reward_before,
        reward_after=reward_after,
        greedy_accuracy_before=greedy_before,
        greedy_accuracy_after=greedy_after,
        train_rewards=train_rewards,
        model_dir=os.path.abspath(model_dir),
        plot_path=os.path.abspath(plot_path) if plot_path else None,
        train_seconds=train_seconds,
    )
    with open(os.path.join(output_dir, "demo_result.json"), "w") as f:
        json.dump(asdict(result), f, indent=2)
    return result


def format_result(result: DemoResult) -> str:
    sample_prompts = ["three four", "eight nine", "zero"]
    lines = [
        "",
        "trl-scale demo: GRPO taught a tiny model to count (continue 'three four' with ' five six seven eight').",
        f"  reward before RL : {result.reward_before:.3f}   (greedy accuracy {result.greedy_accuracy_before:.3f})",
        f"  reward after RL  : {result.reward_after:.3f}   (greedy accuracy {result.greedy_accuracy_after:.3f})",
        f"  training time    : {result.train_seconds:.0f} s for {len(result.train_rewards)} GRPO steps",
        f"  model saved to   : {result.model_dir}",
    ]
    if result.plot_path:
        lines.append(f"  reward curve     : {result.plot_path}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(result.model_dir)
        model = AutoModelForCausalLM.from_pretrained(result.model_dir)
        encoded = tokenizer(sample_prompts, return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=COUNT_TARGET_LENGTH, do_sample=False)
        completions = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        lines.append("  the saved model, greedy:")
        lines += [f"    {p!r:>14} ->{c}" for p, c in zip(sample_prompts, completions)]
    except Exception as error:  # the summary must not hide the result above
        lines.append(f"  (could not reload the saved model: {error})")
    verdict = "LEARNED" if result.reward_after > result.reward_before + 0.2 else "DID NOT LEARN ENOUGH"
    lines.append(f"  verdict          : {verdict}")
    return "\n".join(lines)
