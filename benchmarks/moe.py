"""MoE policy scoring with the router's load-balancing loss, stock TRL against trl-scale, side by side in one process
on the same model and batch: GRPO's loss forward (log-probs and TRL's router term, `output_router_logits=True`) and its
backward. Stock TRL 1.16 forwards the padded [B, T] batch through its fused head; trl-scale packs the real tokens
(`scoring/router_loss.py`: the router's logits at the real tokens). The batch: left-padded prompts and right-padded
completions of long-tailed lengths (a group's completions differ in length, as sampled), on a Qwen3-MoE of 8 experts,
top-2. Runs alternate; the medians and their ratio, and the largest log-prob and router-loss differences.

Usage: python benchmarks/moe.py [--quick]. The last line printed is one JSON object (also appended to
benchmarks/results/moe_cpu.jsonl).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _batch(vocab: int, rows: int, max_prompt: int, max_completion: int, pad: int, seed: int = 0):
    import torch

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(max_prompt // 4, max_prompt))] for _ in range(rows)]
    lengths = [min(max_completion, max(1, int(rng.paretovariate(1.2) * max_completion / 8))) for _ in range(rows)]
    completions = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids, mask, labels = [], [], []
    for p, c in zip(prompts, completions):
        ids.append([pad] * (width_p - len(p)) + p + c + [pad] * (width_c - len(c)))
        mask.append([0] * (width_p - len(p)) + [1] * (len(p) + len(c)) + [0] * (width_c - len(c)))
        labels.append([-100] * width_p + c + [-100] * (width_c - len(c)))
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def _step(model, input_ids, mask, labels) -> tuple[float, object]:
    start = time.perf_counter()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True, output_router_logits=True)
    objective = (out.log_probs * out.label_mask).sum() / out.label_mask.sum() + 0.001 * out.aux_loss
    objective.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start, out


def main() -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring
    from trl_scale.toy import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    rows, max_prompt, max_completion, repeats = (16, 32, 256, 3) if args.quick else (32, 64, 512, 5)
    shape = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2)
    path = build_tiny_model(tempfile.mkdtemp(prefix="moe-bench-"), family="qwen3_moe", **shape)
    stock = AutoModelForCausalLM.from_pretrained(path).train()
    add_fused_lm_head(stock, outputs=("log_probs",))
    packed = copy.deepcopy(stock)
    assert install_packed_scoring(packed, padding_free=True) is not None
    input_ids, mask, labels = _batch(stock.config.vocab_size, rows, max_prompt, max_completion, pad=0)
    times: dict[str, list[float]] = {"trl": [], "trl_scale": []}
    _step(stock, input_ids, mask, labels), _step(packed, input_ids, mask, labels)  # warm-up
    for repeat in range(repeats):
        for name in ("trl", "trl_scale") if repeat % 2 == 0 else ("trl_scale", "trl"):
            seconds, out = _step(stock if name == "trl" else packed, input_ids, mask, labels)
            times[name].append(seconds)
    call = dict(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True, output_router_logits=True)
    with torch.no_grad():
        a, b = stock(**call), packed(**call)
    trl_s, ours_s = statistics.median(times["trl"]), statistics.median(times["trl_scale"])
    real = int(mask.sum())
    record = {
        "benchmark": "moe_scoring",
        "quick": args.quick,
        "model": "qwen3_moe, 8 experts, top-2, hidden 128, 4 layers",
        "rows": rows,
        "pad_fraction": 1 - real / mask.numel(),
        "step_s": {"trl": trl_s, "trl_scale": ours_s},
        "real_tokens_per_s": {"trl": real / trl_s, "trl_scale": real / ours_s},
        "speedup": trl_s / ours_s,
        "max_logprob_diff": float((a.log_probs - b.log_probs)[a.label_mask].abs().max()),
        "aux_loss_diff": float((a.aux_loss - b.aux_loss).abs()),
        "repeats": repeats,
        "date": str(datetime.date.today()),
        "machine": "2-core CPU",
    }
    if not args.quick:
        with open(os.path.join(ROOT, "benchmarks", "results", "moe_cpu.jsonl"), "a") as handle:
            handle.write(json.dumps(record) + "\n")
    print(f"TRL {trl_s:.3f} s, trl-scale {ours_s:.3f} s per forward + backward ({trl_s / ours_s:.2f}x)")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
