"""Packed scoring vs stock TRL, side by side in one run, on the same model and data.

1. Policy scoring (forward + backward), as GRPO's loss runs it: a batch of left-padded prompts and right-padded
   completions whose lengths follow a long-tailed distribution (mean about a quarter of the maximum). Stock TRL
   1.16 forwards the padded [B, T] batch through its fused head; trl-scale packs real tokens into micro-batches
   and projects only completion tokens. Reported: real tokens per second, and the ratio.
2. Log-prob head memory and time at 4096 tokens x 512 hidden x 65,536 vocab, forward + backward, each variant in
   a fresh process: full logits, TRL's fused head (default tile), trl-scale's chunked head. Peak is the RSS
   above the process's level once inputs are allocated.

3. `--vlm`: the vision-language workload (`benchmarks/vlm_workload.py`): a Gemma 3 batch whose prompts hold 1-3
   images each, scored by stock TRL's fused forward and by trl-scale's (padded, its chunked head on the labelled
   tokens only), each in a fresh process: step time and peak RSS.

Usage: python benchmarks/packing.py [--quick] [--vlm [--vlm-family gemma3|qwen2_vl]].
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    # ru_maxrss survives fork+exec (a child would report its parent's peak); VmHWM can be reset.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def head_worker(variant: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    import torch
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    from trl_scale.scoring import ChunkedLogProbHead

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    grad_out = torch.randn(tokens)
    baseline = _status_mib("VmRSS")
    _reset_peak_rss()
    start = time.perf_counter()
    if variant == "full_logits":
        logp = (h @ w.T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    elif variant == "trl_fused_head":
        logp = ChunkedLogProbFunction.apply(
            h, w, None, targets, 1.0, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ()
        )[0]
    elif variant == "trl_scale_head":
        logp = ChunkedLogProbHead.apply(h, w, None, targets, 1.0, chunk, None, 1.0, ())[0]
    else:
        raise ValueError(variant)
    (logp * grad_out).sum().backward()
    seconds = time.perf_counter() - start
    peak = _status_mib("VmHWM")
    return {
        "variant": variant,
        "peak_mib": peak - baseline,
        "seconds": seconds,
        "logp_sum": float(logp.detach().sum()),
    }


def run_head_variant(variant: str, args) -> dict:
    command = [sys.executable, __file__, "--head-worker", variant, "--head-chunk", str(args.head_chunk)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def long_tailed_batch(batch_size: int, max_prompt: int, max_completion: int, vocab: int, seed: int = 0):
    """Left-padded prompts + right-padded completions; completion lengths lognormal, mean ~ max/4, capped."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(max_prompt // 4, max_prompt + 1, (batch_size,), generator=generator)
    normal = torch.randn(batch_size, generator=generator)
    completion_lens = (torch.exp(normal * 0.9) * max_completion / 8).long().clamp(4, max_completion)
    completion_lens[0] = max_completion  # the long tail reaches the cap, as clipped completions do
    input_ids = torch.zeros(batch_size, max_prompt + max_completion, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i in range(batch_size):
        p, c = int(prompt_lens[i]), int(completion_lens[i])
        ids = torch.randint(1, vocab, (p + c,), generator=generator)
        input_ids[i, max_prompt - p : max_prompt + c] = ids
        mask[i, max_prompt - p : max_prompt + c] = 1
        labels[i, max_prompt : max_prompt + c] = ids[p:]
    return input_ids, mask, labels, completion_lens


def scoring_benchmark(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring
    from trl_scale.toy import tiny_config

    torch.manual_seed(0)
    config = tiny_config(
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        attn_implementation="sdpa",
    )
    stock = AutoModelForCausalLM.from_config(config)
    add_fused_lm_head(stock, outputs=("log_probs", "entropy"))
    ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict(stock.state_dict())
    add_fused_lm_head(ours, outputs=("log_probs", "entropy"))
    install_packed_scoring(ours, outputs=("entropy",))  # defaults: the layout follows the attention kernel
    input_ids, mask, labels, completion_lens = long_tailed_batch(
        args.batch_size, args.max_prompt, args.max_completion, args.vocab
    )
    real_tokens = int(mask.sum())

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        valid = out.label_mask
        loss = -(out.log_probs * valid).sum() / valid.sum()
        loss.backward()
        return out

    results = {}
    for name, model in (("stock_trl", stock), ("trl_scale", ours)):
        step(model)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = step(model)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        results[name] = {"seconds": seconds, "real_tokens_per_s": real_tokens / seconds, "log_probs": out.log_probs}
    max_diff = (results["stock_trl"]["log_probs"] - results["trl_scale"]["log_probs"]).abs().max().item()
    return {
        "batch_size": args.batch_size,
        "padded_tokens": input_ids.numel(),
        "real_tokens": real_tokens,
        "completion_tokens": int(completion_lens.sum()),
        "mean_completion_over_max": float(completion_lens.float().mean() / args.max_completion),
        "stock_trl_s": results["stock_trl"]["seconds"],
        "trl_scale_s": results["trl_scale"]["seconds"],
        "scoring_tokens_per_s_ratio": results["trl_scale"]["real_tokens_per_s"]
        / results["stock_trl"]["real_tokens_per_s"],
        "max_abs_logprob_diff": max_diff,
    }


def run_vlm_variant(variant: str, args) -> dict:
    command = [sys.executable, __file__, "--vlm-worker", variant, "--vlm-family", args.vlm_family]
    command += ["--quick"] if args.quick else []
    out = subprocess.run(command, capture_output=True, text=True, check=True, env={**os.environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def vlm_benchmark(args) -> dict:
    print(f"\n== vision-language scoring, forward+backward ({args.vlm_family} h256 x4, vocab 32768, CPU)")
    runs = {variant: run_vlm_variant(variant, args) for variant in ("stock_trl", "trl_scale_padded", "trl_scale")}
    first = runs["stock_trl"]
    print(
        f"{first['padded_tokens']} padded tokens, {first['tokens']} real ({first['image_tokens']} image tokens, "
        f"{first['completion_tokens']} completion tokens)"
    )
    print(f"{'path':<18}{'seconds':>10}{'peak MiB':>10}")
    for name, run in runs.items():
        print(f"{name:<18}{run['seconds']:>10.3f}{run['peak_mib']:>10.0f}")
    summary = {
        "vlm_time_ratio": runs["trl_scale"]["seconds"] / first["seconds"],
        "vlm_peak_memory_ratio": runs["trl_scale"]["peak_mib"] / max(1.0, first["peak_mib"]),
        "vlm_padded_time_ratio": runs["trl_scale_padded"]["seconds"] / first["seconds"],
        "vlm_logp_sum_diff": abs(runs["trl_scale"]["logp_sum"] - first["logp_sum"]),
        "vlm_runs": runs,
    }
    time_ratio, peak_ratio = summary["vlm_time_ratio"], summary["vlm_peak_memory_ratio"]
    print(f"ratio (trl-scale / TRL): time {time_ratio:.2f}x, peak {peak_ratio:.2f}x")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a smaller batch (a few minutes)")
    parser.add_argument("--vlm", action="store_true", help="the vision-language workload only")
    parser.add_argument("--vlm-family", choices=["gemma3", "qwen2_vl"], default="gemma3", help="with --vlm")
    parser.add_argument("--vlm-worker", help=argparse.SUPPRESS)
    parser.add_argument("--head-worker", help=argparse.SUPPRESS)
    parser.add_argument("--head-chunk", type=int, default=256, help="trl-scale head token chunk")
    parser.add_argument("--skip-head", action="store_true", help="skip the head memory part")
    args = parser.parse_args()
    if args.head_worker:
        print(json.dumps(head_worker(args.head_worker, 4096, 512, 65536, args.head_chunk)))
        return
    if args.vlm_worker:
        from vlm_workload import worker

        batch, repeats = (8, 2) if args.quick else (16, 3)
        print(json.dumps(worker(args.vlm_worker, batch, repeats, _status_mib, _reset_peak_rss, args.vlm_family)))
        return
    if args.vlm:
        summary = {"benchmark": "packing_vlm", "family": args.vlm_family, "quick": args.quick}
        print(json.dumps({**summary, **vlm_benchmark(args)}))
        return
    args.vocab, args.hidden, args.layers = 32768, 256, 4
    args.batch_size = 16 if args.quick else 32
    args.max_prompt, args.max_completion = 64, 512
    args.repeats = 2 if args.quick else 5
    import torch

    print(f"torch threads: {torch.get_num_threads()}  (set OMP_NUM_THREADS to change)")
    scoring = scoring_benchmark(args)
    print("\n== policy scoring, forward+backward (Llama h256 x4 layers, vocab 32768, sdpa, fp32, CPU)")
    print(f"batch {scoring['batch_size']}: {scoring['padded_tokens']} padded tokens, {scoring['real_tokens']} real")
    print(
        f"({1 - scoring['real_tokens'] / scoring['padded_tokens']:.0%} padding), mean completion/max "
        f"{scoring['mean_completion_over_max']:.2f}, default token budget (automatic)"
    )
    print(f"{'path':<12}{'seconds':>10}{'real tok/s':>14}")
    for name in ("stock_trl", "trl_scale"):
        s = scoring[f"{name}_s"]
        print(f"{name:<12}{s:>10.3f}{scoring['real_tokens'] / s:>14.0f}")
    print(
        f"ratio (trl-scale / TRL): {scoring['scoring_tokens_per_s_ratio']:.2f}x   "
        f"max |logp diff| {scoring['max_abs_logprob_diff']:.2e}"
    )

    summary = {"benchmark": "packing", "quick": args.quick, **{k: v for k, v in scoring.items()}}
    if not args.skip_head:
        summary.update(head_benchmark(args))
    print(json.dumps(summary))


def head_benchmark(args) -> dict:
    print("\n== log-prob head, 4096 tokens x 512 hidden x 65536 vocab, fwd+bwd, fresh process each")
    print(f"{'variant':<16}{'peak MiB':>10}{'seconds':>10}")
    heads = {}
    for variant in ("full_logits", "trl_fused_head", "trl_scale_head"):
        heads[variant] = run_head_variant(variant, args)
        print(f"{variant:<16}{heads[variant]['peak_mib']:>10.0f}{heads[variant]['seconds']:>10.2f}")
    return dict(
        logprob_peak_memory_gib=heads["trl_scale_head"]["peak_mib"] / 1024,
        logprob_seconds=heads["trl_scale_head"]["seconds"],
        full_logits_peak_memory_gib=heads["full_logits"]["peak_mib"] / 1024,
        full_logits_seconds=heads["full_logits"]["seconds"],
        trl_head_peak_memory_gib=heads["trl_fused_head"]["peak_mib"] / 1024,
        trl_head_seconds=heads["trl_fused_head"]["seconds"],
        head_time_vs_full_logits=heads["trl_scale_head"]["seconds"] / heads["full_logits"]["seconds"],
    )


if __name__ == "__main__":
    main()
