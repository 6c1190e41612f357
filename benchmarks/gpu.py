"""The GPU figures, stock TRL and trl-scale side by side in one run (one GPU, under 9 minutes).

1. ``head``: the log-prob head, forward + backward, bf16, 8k and 32k tokens x hidden 1536 and 2048 x vocab 151,936:
   peak memory above the inputs and time for TRL's fused Triton kernel, full logits (the pre-1.15 path: logits,
   log-softmax, gather, entropy), trl-scale's head (``chunked_logprobs``, which dispatches to TRL's kernel on CUDA)
   and trl-scale's torch head (what runs where Triton does not).
2. ``scoring``: policy scoring (forward + backward, activation checkpointing as TRL's default) of a long-tailed
   batch on a Qwen2-0.5B-shaped model built from a config (random weights, bf16), TRL's padded path vs trl-scale's
   packed rows, per attention kernel present (sdpa, flex attention; flash varlen where ``flash_attn`` is
   installed): real tokens/s, MFU, and packed = padded (bf16 ≤ 1e-2; fp32 on a small case ≤ 1e-5).
3. ``e2e``: training steps with local generation (vLLM is not there): stock TRL's GRPOTrainer vs trl-scale's; and
   trl-scale's PPOTrainer (TRL has none since 1.13) with packing off (TRL's padded path) vs on. Median step time
   after a warm-up step, and ``ThroughputCallback``'s MFU (6 x parameters x tokens/s over the peak).

4. ``train``: one whole training step (forward + backward + AdamW) of the long-tailed batch on Qwen2-0.5B- and
   1.5B-shaped models: TRL's padded path vs trl-scale's packed step as it was (every layer checkpointed, plain
   layers) and with its defaults (checkpointed layers planned by memory, layers compiled where the rule says it
   pays), the compile's break-even in steps, and a profile before and after (``benchmarks/gpu_train.py``;
   ``--train-every-layout`` adds the earlier layouts: rows, flex).

MFU in (2) counts the useful FLOPs of the real tokens only: ``6 x body parameters x real tokens + 6 x vocab x hidden
x scored tokens + 6 x layers x attention width x sum of squared sequence lengths`` (causal attention; the
activation-checkpointing recompute not counted), over the H100's dense bf16 peak (989 TFLOP/s; the measured
8192^3 bf16 matmul rate is printed beside it).

Usage: python benchmarks/gpu.py [--smoke] [--parts head,scoring,e2e,train] [--out DIR] [--budget-s 510]
``--smoke`` runs every part on CPU with tiny shapes (bf16, the e2e part fp32); CI runs it so that the script cannot
rot. Each figure is one JSON line (also appended to DIR/gpu.jsonl); a markdown table of them comes last. How to
run it on a lent GPU: README, "Measuring on a GPU" (``bash scripts/prepare_gpu.sh`` prints the command).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmarks (packing, e2e)

from gpu_common import (  # noqa: E402 (after the path above)
    GPU_SIZES,
    H100_BF16_PEAK,
    SMOKE_SIZES,
    Report,
    Sizes,
    matmul_tflops,
    measure,
    model_flops,
    qwen2_config,
    table,
)


def head_variants() -> dict[str, Callable]:
    """Each: (hidden, weight, targets) -> (logprobs, entropy), differentiable."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    from trl_scale.scoring import ChunkedLogProbHead, chunked_logprobs
    from trl_scale.scoring.logprob_head import DEFAULT_LOGPROB_CHUNK_SIZE

    def trl_fused(h, w, t):
        chunk = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
        return ChunkedLogProbFunction.apply(h, w, None, t, 1.0, chunk, None, 1.0, ("entropy",))[:2]

    def full_logits(h, w, t):
        logp_all = (h @ w.t()).float().log_softmax(-1)
        return logp_all.gather(1, t[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)

    def trl_scale_head(h, w, t):
        return chunked_logprobs(h, w, None, t, 1.0, DEFAULT_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",))[:2]

    def trl_scale_torch_head(h, w, t):
        chunk = DEFAULT_LOGPROB_CHUNK_SIZE
        return ChunkedLogProbHead.apply(h, w, None, t, 1.0, chunk, None, 1.0, ("entropy",))[:2]

    return {
        "trl_fused": trl_fused,
        "full_logits": full_logits,
        "trl_scale": trl_scale_head,
        "trl_scale_torch_head": trl_scale_torch_head,
    }


def head_figures(report: Report, sizes: Sizes, device, dtype) -> None:
    import torch

    from trl_scale.scoring.logprob_head import use_trl_kernel

    variants = head_variants()
    for tokens, hidden in sizes.head_shapes:
        generator = torch.Generator().manual_seed(tokens + hidden)
        h = torch.randn(tokens, hidden, generator=generator).to(device, dtype).requires_grad_()
        w = (torch.randn(sizes.head_vocab, hidden, generator=generator) * 0.02).to(device, dtype).requires_grad_()
        t = torch.randint(0, sizes.head_vocab, (tokens,), generator=generator).to(device)
        grad_out = torch.randn(tokens, generator=generator).to(device)
        reference = None
        for name, head in variants.items():
            if report.seconds_left() < 60:
                report.add("head", variant=name, tokens=tokens, hidden=hidden, skipped="out of time")
                continue
            result: dict = {}

            def step(head=head, result=result, h=h, w=w, t=t, grad_out=grad_out):
                h.grad = w.grad = None
                logp, _ = head(h, w, t)
                (logp.float() * grad_out).sum().backward()
                result["logp"] = logp.detach().float()

            try:
                seconds, peak = measure(step, device, sizes.repeats)
            except torch.OutOfMemoryError:
                h.grad = w.grad = None
                torch.cuda.empty_cache()
                report.add("head", variant=name, tokens=tokens, hidden=hidden, vocab=sizes.head_vocab, oom=True)
                continue
            if name == "trl_fused":
                reference = result["logp"]
            diff = (result["logp"] - reference).abs().max().item() if reference is not None else None
            report.add(
                "head",
                variant=name,
                tokens=tokens,
                hidden=hidden,
                vocab=sizes.head_vocab,
                dtype=str(dtype).removeprefix("torch."),
                ms=seconds * 1e3,
                peak_mib=peak,
                max_abs_logp_diff_vs_trl_fused=diff,
                uses_trl_kernel=use_trl_kernel(device) if name == "trl_scale" else None,
            )
        h = w = t = grad_out = reference = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- 2. packed scoring


def attention_available(name: str, device) -> str | None:
    """None when ``name`` can run on ``device``, else why not."""
    import importlib.util

    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "flash_attn is not installed"
    if name != "sdpa" and device.type != "cuda":
        return "GPU only here (torch's flex attention has no CPU backward)"
    return None


def scoring_models(config, device, checkpointing: bool):
    """(TRL's padded model, trl-scale's packed model, the packed config) with the same weights."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring

    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(config).to(device)
    ours = AutoModelForCausalLM.from_config(config).to(device)
    ours.load_state_dict(stock.state_dict())
    packed = None
    for model in (stock, ours):
        model.train()
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        if model is ours:
            packed = install_packed_scoring(model, outputs=("entropy",))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return stock, ours, packed


def score_once(model, batch):
    input_ids, mask, labels = batch
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    valid = out.label_mask
    (-(out.log_probs * valid).sum() / valid.sum()).backward()
    return out.log_probs.detach().float(), valid.bool()


def scoring_figure(report: Report, sizes: Sizes, device, dtype, attention: str, small: bool = False) -> None:
    """One attention kernel: padded vs packed on the same batch (``small``: an fp32 exactness case)."""
    import torch
    from packing import long_tailed_batch

    if small:
        sizes = SMOKE_SIZES
    config = qwen2_config(sizes, attention, dtype)
    stock, ours, packed = scoring_models(config, device, checkpointing=not small)
    cpu_batch = long_tailed_batch(sizes.batch_size, sizes.max_prompt, sizes.max_completion, sizes.vocab)
    batch = tuple(x.to(device) for x in cpu_batch[:3])
    flops = model_flops(config, cpu_batch[1], cpu_batch[2])
    real_tokens = int(cpu_batch[1].sum())
    row = dict(
        attention=attention,
        dtype=str(dtype).removeprefix("torch."),
        batch=sizes.batch_size,
        padded_tokens=cpu_batch[0].numel(),
        real_tokens=real_tokens,
        packed=packed is not None,
    )
    results = {}
    for name, model in (("trl_padded", stock), ("trl_scale_packed", ours)):
        out: dict = {}

        def step(model=model, out=out):
            out["logp"], out["valid"] = score_once(model, batch)

        seconds, peak = measure(step, device, 1 if small else sizes.repeats)
        results[name] = out
        row[f"{name}_s"] = seconds
        row[f"{name}_peak_mib"] = peak
        row[f"{name}_tokens_per_s"] = real_tokens / seconds
        row[f"{name}_mfu"] = flops / seconds / H100_BF16_PEAK if device.type == "cuda" else None
    valid = results["trl_padded"]["valid"]
    diff = (results["trl_padded"]["logp"] - results["trl_scale_packed"]["logp"])[valid].abs()
    row.update(
        speedup=row["trl_padded_s"] / row["trl_scale_packed_s"],
        max_abs_logp_diff=diff.max().item(),
        mean_abs_logp_diff=diff.mean().item(),
    )
    if dtype == torch.float32:
        row["within_tolerance"] = row["max_abs_logp_diff"] <= 1e-5
    else:
        row.update(low_precision_errors(stock, batch, valid, results))
    report.add("scoring_small_fp32" if small else "scoring", **row)
    del stock, ours
    if device.type == "cuda":
        torch.cuda.empty_cache()


def low_precision_errors(stock, batch, valid, results) -> dict:
    """Each bf16 path's distance from the same weights scored in fp32 (TRL's padded path): bf16 rounding moves both
    paths by about 1e-2 per token on its own, so packed = padded is judged by packed being no further from fp32
    than TRL's padded path is (mean within 10 %, max within 50 %)."""
    import torch

    stock.float()
    with torch.no_grad():
        input_ids, mask, labels = batch
        reference = stock(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    errors = {}
    for name in ("trl_padded", "trl_scale_packed"):
        error = (results[name]["logp"] - reference.float())[valid].abs()
        errors[f"{name}_vs_fp32_max"], errors[f"{name}_vs_fp32_mean"] = error.max().item(), error.mean().item()
    errors["within_tolerance"] = (
        errors["trl_scale_packed_vs_fp32_mean"] <= 1.1 * errors["trl_padded_vs_fp32_mean"]
        and errors["trl_scale_packed_vs_fp32_max"] <= 1.5 * errors["trl_padded_vs_fp32_max"]
    )
    return errors


def scoring_figures(report: Report, sizes: Sizes, device, dtype) -> None:
    import torch

    scoring_figure(report, sizes, device, torch.float32, "sdpa", small=True)
    for attention in sizes.attention:
        why_not = attention_available(attention, device)
        if why_not is None and report.seconds_left() < 150:
            why_not = "out of time"
        if why_not:
            report.add("scoring", attention=attention, skipped=why_not)
            continue
        try:
            scoring_figure(report, sizes, device, dtype, attention)
        except Exception as error:  # a kernel that fails here is a figure too; the others still run
            report.add("scoring", attention=attention, error=f"{type(error).__name__}: {error}"[:400])


# ----------------------------------------------------------------------------------------- 3. end to end


def e2e_model(sizes: Sizes, dtype) -> str:
    """A Qwen2-0.5B-shaped model with the toy tokenizer, saved and loaded with ``from_pretrained``. With random
    weights it samples ids the toy tokenizer does not have (they decode to nothing), so every completion runs
    to ``max_completion_length``: the step's cost is fixed."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_scale.toy import build_tokenizer

    tokenizer = build_tokenizer()
    config = qwen2_config(sizes, "sdpa", dtype)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    path = tempfile.mkdtemp(prefix="gpu-e2e-model-")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def e2e_dataset(sizes: Sizes, count: int):
    """Prompts with long-tailed lengths (log-uniform between the bounds): the scoring batch's padding."""
    from datasets import Dataset

    from trl_scale.toy import TOY_WORDS

    rng = random.Random(0)
    low, high = sizes.e2e_prompt_words
    rows = []
    for _ in range(count):
        length = int(math.exp(rng.uniform(math.log(low), math.log(high))))
        rows.append({"prompt": " ".join(rng.choice(TOY_WORDS) for _ in range(length))})
    return Dataset.from_list(rows)


def completion_length_reward(completions, **kwargs) -> list[float]:
    return [len(c) / 100 for c in completions]


def e2e_run(trainer_name: str, impl: str, model_path: str, sizes: Sizes, device) -> dict:
    """One short training run; returns the median step time after the first step and the last logged metrics."""
    import torch
    import trl
    from e2e import StepTimer

    import trl_scale
    from trl_scale.callbacks import ThroughputCallback

    torch.manual_seed(0)
    timer = StepTimer()
    on_gpu = device.type == "cuda"
    config_cls = {"grpo": (trl if impl == "trl" else trl_scale).GRPOConfig, "ppo": trl_scale.PPOConfig}[trainer_name]
    trainer_cls = {"grpo": (trl if impl == "trl" else trl_scale).GRPOTrainer, "ppo": trl_scale.PPOTrainer}[
        trainer_name
    ]
    extra = {"padding_free": False} if impl == "trl_scale_padded" else {}
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix=f"gpu-e2e-{trainer_name}-{impl}-"),
        max_steps=sizes.e2e_steps,
        per_device_train_batch_size=sizes.e2e_batch,
        max_completion_length=sizes.e2e_completion,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        bf16=on_gpu,
        use_cpu=not on_gpu,
        seed=0,
        disable_tqdm=True,
        shuffle_dataset=False,
        # PPO: one rollout and one update per step, as GRPO's default (num_iterations=1) does.
        **({"num_generations": sizes.e2e_generations} if trainer_name == "grpo" else {"num_ppo_epochs": 1}),
        **extra,
    )
    dataset = e2e_dataset(sizes, sizes.e2e_batch * sizes.e2e_steps)
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=completion_length_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[timer.callback, ThroughputCallback()],
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    step_s = statistics.median(timer.seconds[1:])
    last = logs[-1]
    result = {"step_s": step_s, "num_tokens": last.get("num_tokens"), "loss": last.get("loss")}
    result["tokens_per_s"] = (logs[-1]["num_tokens"] - logs[0]["num_tokens"]) / sum(timer.seconds[1:])
    params = sum(p.numel() for p in trainer.model.parameters())
    # ThroughputCallback's MFU where trl-scale logs it; the same formula from TRL's logs for stock TRL.
    result["mfu"] = last.get("throughput/mfu")
    if result["mfu"] is None and on_gpu:
        result["mfu"] = 6 * params * result["tokens_per_s"] / H100_BF16_PEAK
    result["pad_fraction_removed"] = last.get("padding_free/pad_fraction_removed")
    del trainer
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def e2e_figures(report: Report, sizes: Sizes, device, dtype) -> None:
    import torch

    model_path = e2e_model(sizes, dtype if device.type == "cuda" else torch.float32)
    pairs = {"grpo": ("trl", "trl_scale"), "ppo": ("trl_scale_padded", "trl_scale")}
    for trainer_name, (baseline, ours) in pairs.items():
        if report.seconds_left() < 90:
            report.add("e2e", trainer=trainer_name, skipped="out of time")
            continue
        results = {impl: e2e_run(trainer_name, impl, model_path, sizes, device) for impl in (baseline, ours)}
        report.add(
            "e2e",
            trainer=trainer_name,
            baseline=baseline,
            baseline_step_s=results[baseline]["step_s"],
            trl_scale_step_s=results[ours]["step_s"],
            step_time_ratio=results[ours]["step_s"] / results[baseline]["step_s"],
            baseline_mfu=results[baseline]["mfu"],
            trl_scale_mfu=results[ours]["mfu"],
            baseline_tokens_per_s=results[baseline]["tokens_per_s"],
            trl_scale_tokens_per_s=results[ours]["tokens_per_s"],
            pad_fraction_removed=results[ours]["pad_fraction_removed"],
            batch=sizes.e2e_batch,
            completion_length=sizes.e2e_completion,
        )


# ----------------------------------------------------------------------------------------------- summary


PARTS = ("head", "scoring", "e2e", "train")


def train_part(report: Report, sizes: Sizes, device, dtype, every_layout: bool = False) -> None:
    from gpu_train import GPU_SHAPES, train_figures

    train_figures(report, sizes, device, dtype, None if device.type != "cuda" else GPU_SHAPES, every_layout)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, any device (CI)")
    parser.add_argument("--parts", default="head,scoring,e2e,train", help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", default=None, help="folder for gpu.jsonl and gpu.md")
    parser.add_argument("--budget-s", type=float, default=510.0, help="parts past this many seconds are skipped")
    parser.add_argument(
        "--train-every-layout", action="store_true", help="train part: also the layouts measured before (rows, flex)"
    )
    args = parser.parse_args(argv)
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:  # before anything runs: a typo must not cost the parts before it
        parser.error(f"--parts {args.parts!r}: unknown {unknown or 'empty'}; choose from {', '.join(PARTS)}")
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        parser.error("no CUDA device: run with --smoke on CPU")
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    dtype = getattr(torch, sizes.dtype)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    report = Report(args.out, name, time.monotonic() + args.budget_s, run_id)
    import transformers
    import trl

    from trl_scale.scoring.varlen import varlen_kernel

    kernel = varlen_kernel()
    report.add(
        "environment",
        torch=torch.__version__,
        transformers=transformers.__version__,
        trl=trl.__version__,
        measured_bf16_matmul_tflops=matmul_tflops(device),
        varlen_kernel=None if kernel is None else str(inspect.signature(kernel)),
        parts=parts,
        smoke=args.smoke,
    )
    functions = {
        "head": head_figures,
        "scoring": scoring_figures,
        "e2e": e2e_figures,
        "train": lambda *a: train_part(*a, every_layout=args.train_every_layout),
    }
    for part in parts:
        start = time.monotonic()
        functions[part](report, sizes, device, dtype)
        print(f"# {part}: {time.monotonic() - start:.0f} s", flush=True)
    summary = table(report.rows)
    print(summary)
    if args.out:
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(summary + "\n")
    return report.rows


if __name__ == "__main__":
    main()
