"""Tree rows (`trl_scale/scoring/tree.py`) against the rows scored one by one, as one GRPO group's policy scoring:
forward and backward of the completion tokens' log-probs, a group of G completions of C tokens sharing a P-token
prompt, on the same tiny model, side by side in one process.

Stock TRL and today's packing score each completion's row `[prompt, completion]` (G(P+C) tokens forwarded; with
equal lengths nothing is padded, so both are "rows" here); tree rows forward P + G*C. Tree rows are not yet wired
into the trainers (issue 61): this measures the module alone, on this machine's sdpa with a dense path mask.

Usage: python benchmarks/tree_packing.py [--quick]. One JSON line per shape; the last line is the summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SHAPES = [(p, c, g) for p in (64, 512, 2048) for c in (32, 256) for g in (4, 8, 16)]
QUICK_SHAPES = [(512, 32, 8), (200, 256, 8), (64, 32, 4)]


def _model(hidden: int, layers: int):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_scale.toy import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=hidden, num_layers=layers, num_heads=8, num_kv_heads=4)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def _rows(prompt: int, completion: int, group: int, vocab: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(prompt * 1000 + completion * 10 + group)
    shared = torch.randint(3, vocab, (prompt,), generator=generator).tolist()
    return [shared + torch.randint(3, vocab, (completion,), generator=generator).tolist() for _ in range(group)]


def _rows_step(model, rows: list[list[int]], prompt: int) -> None:
    """Each row forwarded whole, log-probs of its completion tokens, backward: the rows' cost."""
    import torch

    ids = torch.tensor(rows)
    hidden = model.model(input_ids=ids).last_hidden_state[:, prompt - 1 : -1]
    logp = torch.log_softmax(model.lm_head(hidden).float(), -1).gather(2, ids[:, prompt:, None])
    logp.sum().backward()


def _tree_step(model, tree, prompt: int) -> None:
    from trl_scale.scoring.tree import tree_token_logprobs

    tree_token_logprobs(model, tree, start=prompt).sum().backward()


def _median_seconds(step, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, prompt: int, completion: int, group: int, repeats: int) -> dict:
    from trl_scale.scoring.tree import TreeRows

    rows = _rows(prompt, completion, group, model.config.vocab_size)
    tree = TreeRows.fold(rows)
    rows_s = _median_seconds(lambda: (model.zero_grad(set_to_none=True), _rows_step(model, rows, prompt)), repeats)
    tree_s = _median_seconds(lambda: (model.zero_grad(set_to_none=True), _tree_step(model, tree, prompt)), repeats)
    return {
        "P": prompt,
        "C": completion,
        "G": group,
        "row_tokens": tree.row_tokens,
        "tree_tokens": tree.num_tokens,
        "rows_step_s": round(rows_s, 4),
        "tree_step_s": round(tree_s, 4),
        "tree_vs_rows": round(tree_s / rows_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three shapes, fewer repeats")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = _model(args.hidden, args.layers)
    results = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        results.append(measure(model, *shape, repeats=3 if args.quick else 5))
        print(json.dumps({"benchmark": "tree_packing", **results[-1]}), flush=True)
    print(json.dumps({"benchmark": "tree_packing", "quick": args.quick, "hidden": args.hidden,
                      "layers": args.layers, "shapes": results}))  # fmt: skip


if __name__ == "__main__":
    main()
