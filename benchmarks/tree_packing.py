"""Tree packing (issue 61) end to end in the scoring engine: one GRPO-style scoring step (old log-probs, the
reference's log-probs, the loss forward and backward) of stock TRL's padded rows, today's packed rows
(`tree_packing=False`) and tree rows (`tree_packing=True`), on the same tiny model and the same batch, side by side in
one process.

The batch is TRL's layout: groups of G completions sharing a P-token prompt (completion lengths spread over [C/2, C],
so the padded batch holds padding), one group per scoring call as TRL's default `per_device_train_batch_size` =
`num_generations` gives; the multi-turn workload trains every turn of a conversation, each turn's row holding the
history before it. Tokens computed: the padded batch's width times its rows (stock), its real tokens (packed rows),
its unique tokens (tree rows).

Usage: python benchmarks/tree_packing.py [--quick]. One JSON line per shape; the last line is the summary.
On a GPU (issue 63: P=2048, C=256, G=8 on the 1.5B shape, varlen and flex):
python benchmarks/tree_packing.py --device cuda --dtype bfloat16 --attention flex_attention --shapes 2048,256,8
--hidden 1536 --layers 28 --heads 12 --kv-heads 2 (sdpa on CUDA in half precision runs the tree's segments on torch's
flash varlen kernel). Each shape's line also gives the tree rows' largest log-prob gap to stock TRL's padded rows.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import time

SHAPES = [(p, c, g) for p in (64, 512, 2048) for c in (32, 256) for g in (4, 8, 16)]
QUICK_SHAPES = [(512, 32, 8), (200, 256, 8), (64, 32, 4)]
VARIANTS = ("stock", "packed", "tree")


def _model(args):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_scale.toy import tiny_config

    torch.manual_seed(0)
    config = tiny_config(
        "llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads
    )
    config._attn_implementation = args.attention
    return AutoModelForCausalLM.from_config(config).to(args.device, getattr(torch, args.dtype))


def padded_batch(rows: list[tuple[list[int], list[int]]]):
    """TRL's layout of (prompt, completion) rows: left-padded prompts, right-padded completions, labels on the
    completions."""
    import torch

    width_p, width_c = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids, mask, labels = [], [], []
    for p, c in rows:
        left, right = width_p - len(p), width_c - len(c)
        ids.append([0] * left + p + c + [0] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        labels.append([-100] * width_p + c + [-100] * right)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def group_rows(prompt: int, completion: int, group: int, vocab: int) -> list:
    import torch

    generator = torch.Generator().manual_seed(prompt * 1000 + completion * 10 + group)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    shared = tokens(prompt)
    lengths = torch.randint(max(1, completion // 2), completion + 1, (group,), generator=generator).tolist()
    return [(shared, tokens(n)) for n in lengths]


def conversation_rows(conversations: int, turns: int, asked: int, answered: int, vocab: int) -> list:
    """Per-turn training rows: turn k's prompt is the conversation so far (k questions and k-1 answers)."""
    import torch

    generator = torch.Generator().manual_seed(turns)
    rows = []
    for _ in range(conversations):
        history: list[int] = []
        for _ in range(turns):
            history = history + torch.randint(3, vocab, (asked,), generator=generator).tolist()
            answer = torch.randint(3, vocab, (answered,), generator=generator).tolist()
            rows.append((history, answer))
            history = history + answer
    return rows


def _scorers(base, variant: str):
    """(policy, reference) of one variant, each with TRL's fused head, and the policy's packing figures."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring

    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        if variant != "stock":
            install_packed_scoring(model, outputs=("entropy",), padding_free=True, tree_packing=variant == "tree")
        models.append(model)
    return models


def _step(policy, reference, batch) -> None:
    """One scoring step as GRPO runs it with a reference (beta > 0) and old log-probs (vLLM's correction)."""
    import torch

    ids, mask, labels = batch
    with torch.no_grad():
        policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)  # old log-probs
        reference(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out = policy(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    (-(out.log_probs * out.label_mask).sum() / out.label_mask.sum()).backward()
    policy.zero_grad(set_to_none=True)


def _synchronized(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(step, repeats: int, device="cpu") -> float:
    step()  # warm-up (and the probes, and a compile)
    times = []
    for _ in range(repeats):
        _synchronized(device)
        start = time.perf_counter()
        step()
        _synchronized(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _logprob_gap(models: dict, batch) -> float:
    """The tree rows' largest log-prob gap to stock TRL's padded rows, on the labelled tokens."""
    import torch

    ids, mask, labels = batch
    with torch.no_grad():
        out = {name: model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
               for name, model in models.items()}  # fmt: skip
    kept = out["stock"].label_mask.bool()
    return float((out["tree"].log_probs.float() - out["stock"].log_probs.float())[kept].abs().max())


def measure(base, name: str, rows: list, repeats: int) -> dict:
    device = next(base.parameters()).device
    batch = tuple(t.to(device) for t in padded_batch(rows))
    result: dict = {"workload": name}
    policies = {}
    for variant in VARIANTS:
        policy, reference = _scorers(base, variant)
        step = functools.partial(_step, policy, reference, batch)
        result[f"{variant}_step_s"] = round(_median_seconds(step, repeats, device), 4)
        policies[variant] = policy
        if variant == "tree":
            stats = policy._trl_scale_packed_scoring.stats
            result["tree_calls_fraction"] = round(stats.tree_calls / max(1, stats.calls), 3)
            result["tree_tokens"] = stats.tree_tokens // max(1, stats.tree_calls)
    result["tree_logp_max_gap"] = _logprob_gap(policies, batch)
    result["stock_tokens"] = int(batch[0].numel())
    result["packed_tokens"] = int(batch[1].sum())
    result["tree_vs_packed"] = round(result["tree_step_s"] / result["packed_step_s"], 3)
    result["tree_vs_stock"] = round(result["tree_step_s"] / result["stock_step_s"], 3)
    result["packed_vs_stock"] = round(result["packed_step_s"] / result["stock_step_s"], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three shapes and the multi-turn workload, fewer repeats")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "flex_attention", "eager"))
    parser.add_argument("--shapes", help="P,C,G[;P,C,G...]: these shapes only (and the multi-turn workload)")
    args = parser.parse_args()
    base = _model(args)
    vocab = base.config.vocab_size
    repeats = 3
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in shape.split(",")) for shape in args.shapes.split(";")]
    workloads = [(f"P={p},C={c},G={g}", group_rows(p, c, g, vocab)) for p, c, g in shapes]
    workloads.append(("multi-turn: 2 conversations x 6 turns of 64 + 32", conversation_rows(2, 6, 64, 32, vocab)))
    results = []
    for name, rows in workloads:
        results.append(measure(base, name, rows, repeats))
        print(json.dumps({"benchmark": "tree_packing", **results[-1]}), flush=True)
    print(json.dumps({"benchmark": "tree_packing", "quick": args.quick, "hidden": args.hidden, "layers": args.layers,
                      "device": args.device, "dtype": args.dtype, "attention": args.attention,
                      "workloads": results}))  # fmt: skip


if __name__ == "__main__":
    main()
