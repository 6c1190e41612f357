"""What the GPU figures' scripts share (`gpu.py`, `gpu_train.py`): the shapes, the report, timing on the device, the
model FLOPs. Each script imports it; neither imports the other at import time."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

H100_BF16_PEAK = 989e12  # dense, datasheet
VOCAB = 151_936  # Qwen2/Qwen3's
# Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads, tied embeddings).
QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
)


@dataclass
class Sizes:
    """Shapes of one run: the GPU's by default, tiny ones for ``--smoke``."""

    head_shapes: list[tuple[int, int]]  # (tokens, hidden)
    head_vocab: int
    model: dict
    vocab: int
    batch_size: int
    max_prompt: int
    max_completion: int
    repeats: int
    e2e_batch: int
    e2e_generations: int
    e2e_completion: int
    e2e_prompt_words: tuple[int, int]
    e2e_steps: int
    dtype: str
    attention: list[str] = field(default_factory=lambda: ["sdpa"])


GPU_SIZES = Sizes(
    head_shapes=[(8192, 1536), (8192, 2048), (32768, 1536), (32768, 2048)],
    head_vocab=VOCAB,
    model=QWEN2_05B,
    vocab=VOCAB,
    batch_size=16,
    max_prompt=512,
    max_completion=4096,
    repeats=3,
    e2e_batch=16,
    e2e_generations=8,
    e2e_completion=128,
    e2e_prompt_words=(16, 512),
    e2e_steps=3,
    dtype="bfloat16",
    attention=["sdpa", "flex_attention", "flash_attention_2"],
)
SMOKE_SIZES = Sizes(
    head_shapes=[(96, 32)],
    head_vocab=1000,
    model=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    vocab=1000,
    batch_size=4,
    max_prompt=16,
    max_completion=32,
    repeats=1,
    e2e_batch=4,
    e2e_generations=2,
    e2e_completion=8,
    e2e_prompt_words=(2, 24),
    e2e_steps=2,
    dtype="bfloat16",  # so that the bf16 checks run too; the e2e part trains in fp32 on CPU
)


class Report:
    """Collects figures: one JSON line each on stdout (and in ``out/gpu.jsonl``), a table at the end."""

    def __init__(self, out_dir: str | None, device_name: str, deadline: float, run_id: str = ""):
        self.rows: list[dict] = []
        self.run_id = run_id  # every row of one run carries it: a second run into the same --out appends its own
        self.path = os.path.join(out_dir, "gpu.jsonl") if out_dir else None
        self.device_name = device_name
        self.deadline = deadline

    def add(self, figure: str, **values) -> dict:
        row = {"benchmark": "gpu", "run": self.run_id, "figure": figure, "device": self.device_name, **values}
        self.rows.append(row)
        line = json.dumps(row, default=json_value)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        return row

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic()


def json_value(value):
    return round(value, 4) if isinstance(value, float) else str(value)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device) -> float:
    """Seconds one call of `fn` takes, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure(fn: Callable[[], object], device, repeats: int) -> tuple[float, float | None]:
    """(median seconds, peak MiB allocated above the level before the call) of ``fn`` after one warm-up call."""
    import torch

    fn()
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = [timed(fn, device) for _ in range(repeats)]
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return statistics.median(times), peak


def matmul_tflops(device) -> float | None:
    """The bf16 8192^3 matmul rate, measured (None on CPU)."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    seconds, _ = measure(lambda: a @ b, device, 10)
    return 2 * 8192**3 / seconds / 1e12


# ----------------------------------------------------------------------------------------------- 1. the head


def qwen2_config(sizes: Sizes, attention: str, dtype):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=sizes.vocab,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attn_implementation=attention,
        dtype=dtype,
        **sizes.model,
    )


def model_flops(config, input_mask, labels) -> float:
    """Useful training FLOPs of one scoring forward+backward (see the module's docstring)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    body = layers * (2 * hidden * attention_width + 2 * hidden * kv_width + 3 * hidden * config.intermediate_size)
    lengths = input_mask.sum(1).double()
    real, scored = float(lengths.sum()), float((labels != -100).sum())
    attention = 6 * layers * attention_width * float((lengths**2).sum())
    return 6 * body * real + 6 * config.vocab_size * hidden * scored + attention


def table(rows: list[dict]) -> str:
    """A markdown table of the figures: one line each, the columns that matter for its kind."""
    lines = ["| figure | case | baseline | trl-scale | ratio / check |", "|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "error" in r or r.get("oom"):
            why = r.get("skipped") or r.get("error") or "out of memory"
            case = r.get("variant") or r.get("attention") or r.get("trainer")
            lines.append(f"| {r['figure']} | {case} {r.get('tokens', '')} | | | {why} |")
        elif r["figure"] == "head":
            peak = f"{r['peak_mib']:.0f} MiB" if r["peak_mib"] is not None else "n/a"
            case = f"{r['variant']} {r['tokens']}x{r['hidden']}x{r['vocab']}"
            diff = r["max_abs_logp_diff_vs_trl_fused"]
            lines.append(f"| head | {case} | | {r['ms']:.1f} ms, {peak} | max diff vs TRL's kernel {diff} |")
        elif r["figure"].startswith("scoring"):
            mfu = r["trl_scale_packed_mfu"]
            mfu_text = f", MFU {r['trl_padded_mfu']:.1%} -> {mfu:.1%}" if mfu is not None else ""
            fp32_text = ""
            if "trl_padded_vs_fp32_max" in r:
                padded, packed = r["trl_padded_vs_fp32_max"], r["trl_scale_packed_vs_fp32_max"]
                fp32_text = f" (vs fp32: padded {padded:.1e}, packed {packed:.1e})"
            lines.append(
                f"| {r['figure']} | {r['attention']} {r['dtype']}, {r['real_tokens']}/{r['padded_tokens']} real "
                f"| {r['trl_padded_tokens_per_s']:.0f} tok/s | {r['trl_scale_packed_tokens_per_s']:.0f} tok/s "
                f"| {r['speedup']:.2f}x{mfu_text}; max diff {r['max_abs_logp_diff']:.1e}"
                f"{fp32_text}, {'exact' if r['within_tolerance'] else 'NOT within tolerance'} |"
            )
        elif r["figure"] == "train_step":
            mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
            lines.append(
                f"| train_step | {r['shape']} {r['variant']} ({r['attention']}) | | {r['step_s'] * 1e3:.0f} ms/step"
                f"{mfu}, {r['peak_mib'] or 0:.0f} MiB "
                f"| vs fp32 max {r['vs_fp32_max']:.1e} mean {r['vs_fp32_mean']:.1e} |"
            )
        elif r["figure"] == "train_step_summary":
            mfu = ""
            if r.get("trl_scale_mfu") is not None:
                mfu = f", MFU {r['trl_padded_mfu']:.1%} -> {r['trl_scale_mfu']:.1%}"
            lines.append(
                f"| train_step_summary | {r['shape']}: {r['trl_scale_variant']} | {r['trl_padded_step_s']:.3f} s "
                f"| {r['trl_scale_step_s']:.3f} s | {r['speedup_vs_trl_padded']:.2f}x{mfu}; "
                f"{'as exact as padded' if r['exact_as_padded'] else 'LESS exact than padded'} |"
            )
        elif r["figure"] == "e2e":
            mfu = r["trl_scale_mfu"]
            mfu_text = f", MFU {r['baseline_mfu']:.1%} -> {mfu:.1%}" if mfu is not None else ""
            lines.append(
                f"| e2e | {r['trainer']} vs {r['baseline']} | {r['baseline_step_s']:.2f} s/step "
                f"| {r['trl_scale_step_s']:.2f} s/step | {r['step_time_ratio']:.2f}{mfu_text} |"
            )
        else:
            lines.append(f"| {r['figure']} | {json.dumps(r, default=json_value)} | | | |")
    return "\n".join(lines)
