"""MoE policy scoring with the router's load-balancing loss, stock TRL against trl-scale, side by side in one process
on the same model and batch: GRPO's loss forward (log-probs and TRL's router term, `output_router_logits=True`) and its
backward. Stock TRL 1.16 forwards the padded [B, T] batch through its fused head; trl-scale packs the real tokens
(`scoring/router_loss.py`: the router's logits at the real tokens); and the same packed forward replaying each
token's routes (`routing_replay=True`: `scoring/routing_replay.py`, the routes found by sequence in a book, as a
server returned them; here the model's own, so the numbers match). The batch: left-padded prompts and right-padded
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


def _models(stock, input_ids, mask) -> tuple[dict, object]:
    """Stock TRL's model, the packed one, and the packed one replaying each sequence's own routes (as a server
    returned them: `trl-scale serve`'s reading of the model's routers), with the replay (its agreement)."""
    from trl_scale.scoring import install_packed_scoring
    from trl_scale.scoring.routing_replay import RouteBook, RouteReplay, decode_routes
    from trl_scale.serve.routed_experts import routed_experts

    packed, replayed = copy.deepcopy(stock), copy.deepcopy(stock)
    assert install_packed_scoring(packed, padding_free=True) is not None
    assert install_packed_scoring(replayed, padding_free=True) is not None
    book = RouteBook()
    sequences = [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]
    for sequence, encoded in zip(sequences, routed_experts(stock, sequences, 0)):
        book.add(sequence, decode_routes(encoded))
    return {"trl": stock, "trl_scale": packed, "trl_scale_replay": replayed}, RouteReplay(replayed, book)


def main() -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

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
    input_ids, mask, labels = _batch(stock.config.vocab_size, rows, max_prompt, max_completion, pad=0)
    models, replay = _models(stock, input_ids, mask)
    times: dict[str, list[float]] = {name: [] for name in models}
    for model in models.values():  # warm-up
        _step(model, input_ids, mask, labels)
    for repeat in range(repeats):
        for name in list(models) if repeat % 2 == 0 else list(models)[::-1]:
            seconds, out = _step(models[name], input_ids, mask, labels)
            times[name].append(seconds)
    stock, packed, replayed = models.values()
    call = dict(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True, output_router_logits=True)
    with torch.no_grad():
        a, b, c = stock(**call), packed(**call), replayed(**call)
    trl_s, ours_s = statistics.median(times["trl"]), statistics.median(times["trl_scale"])
    replay_s = statistics.median(times["trl_scale_replay"])
    real = int(mask.sum())
    record = {
        "benchmark": "moe_scoring",
        "quick": args.quick,
        "model": "qwen3_moe, 8 experts, top-2, hidden 128, 4 layers",
        "rows": rows,
        "pad_fraction": 1 - real / mask.numel(),
        "step_s": {"trl": trl_s, "trl_scale": ours_s, "trl_scale_replay": replay_s},
        "real_tokens_per_s": {"trl": real / trl_s, "trl_scale": real / ours_s, "trl_scale_replay": real / replay_s},
        "speedup": trl_s / ours_s,
        "speedup_with_replay": trl_s / replay_s,
        "max_logprob_diff": float((a.log_probs - b.log_probs)[a.label_mask].abs().max()),
        "max_logprob_diff_replay": float((a.log_probs - c.log_probs)[a.label_mask].abs().max()),
        "replay_agreement": replay.agreement.share,
        "aux_loss_diff": float((a.aux_loss - b.aux_loss).abs()),
        "repeats": repeats,
        "date": str(datetime.date.today()),
        "machine": "2-core CPU",
    }
    if not args.quick:
        with open(os.path.join(ROOT, "benchmarks", "results", "moe_cpu.jsonl"), "a") as handle:
            handle.write(json.dumps(record) + "\n")
    print(f"TRL {trl_s:.3f} s, trl-scale {ours_s:.3f} s, with routing replay {replay_s:.3f} s per forward + backward")
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
