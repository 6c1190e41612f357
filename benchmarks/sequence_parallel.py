"""Sequence parallelism's memory and time: one long sequence scored (forward + backward of the packed scoring
engine, the chunked head, TRL's fused-forward call) by one process (`sp_size=1`) and sharded over 2 CPU processes
with Ulysses attention (`sp_size=2`, gloo), on a toy Llama sized so that activations dominate.

An SP group is one data-parallel rank: both ranks hold the same batch (the long sequence) and each runs its half of
the packed row, so a rank holds half the sequence's activations (plus what Ulysses attention gathers: each rank
attends over the whole row for half the heads).

Activation memory is measured exactly: the bytes of every tensor autograd saves for backward during the forward
(`torch.autograd.graph.saved_tensors_hooks`), per rank, at its peak (what must be held until backward frees it);
weights and optimizer state are the same on every rank and left out. Step time is the wall time of forward +
backward, the slowest rank's. From the bytes per token, the longest sequence whose activations fit a budget
(`--budget-gib`) is derived for each sp_size.

Usage: python benchmarks/sequence_parallel.py [--tokens 8192] [--budget-gib 16]. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SIZES = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=1024)
VOCAB = 200  # token ids drawn below it (the toy vocabulary is larger)


class SavedBytes:
    """The bytes autograd holds for backward: added as tensors are saved, the peak kept (a saved tensor shared by
    several nodes counts once per save, as autograd keeps a reference per node; views of one storage count once)."""

    def __init__(self):
        self.now = self.peak = 0
        self.storages: set[int] = set()

    def pack(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        if key not in self.storages:
            self.storages.add(key)
            self.now += tensor.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        return tensor

    @staticmethod
    def unpack(tensor):
        return tensor


def measure(model_path: str, tokens: int, sp_size: int, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring
    from trl_scale.scoring.sequence_parallel import enable_sequence_parallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(model, outputs=("log_probs",))
    group = enable_sequence_parallel(model, sp_size) if sp_size > 1 else None
    install_packed_scoring(model, padding_free=True, sequence_parallel=group)
    input_ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    runs = []
    for _ in range(2):  # the first warms up
        saved = SavedBytes()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.loss.backward()
        model.zero_grad()
        runs.append({"seconds": time.perf_counter() - start, "activation_bytes": saved.peak})
    return runs[-1]


def worker(model_path: str, tokens: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = measure(model_path, tokens, 2)  # the same sequence on both ranks: the group's one batch
    with open(f"{out}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.tokens, args.worker[1])
        return
    import torch
    import transformers

    from trl_scale.toy import build_tiny_model

    transformers.logging.set_verbosity_error()
    work = tempfile.mkdtemp(prefix="sp-bench-")
    model_path = build_tiny_model(os.path.join(work, "model"), family="llama", **SIZES)
    torch.set_num_threads(1)  # as each of the 2 ranks: the comparison is per rank, one core each
    one = measure(model_path, args.tokens, 1)
    out = os.path.join(work, "rank")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571"]
    command += [os.path.abspath(__file__), "--tokens", str(args.tokens)]
    command += ["--worker", model_path, out]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    subprocess.run(command, check=True, env=env, capture_output=True)
    ranks = [json.load(open(f"{out}.{rank}")) for rank in (0, 1)]
    two = {
        "seconds": max(r["seconds"] for r in ranks),
        "activation_bytes": max(r["activation_bytes"] for r in ranks),
    }
    budget = args.budget_gib * 2**30
    per_token = {1: one["activation_bytes"] / args.tokens, 2: two["activation_bytes"] / args.tokens}
    summary = {
        "benchmark": "sequence_parallel",
        "tokens": args.tokens,
        "model": SIZES,
        "activation_gib_per_rank": {"sp1": one["activation_bytes"] / 2**30, "sp2": two["activation_bytes"] / 2**30},
        "activation_ratio_sp2_vs_sp1": two["activation_bytes"] / one["activation_bytes"],
        "step_seconds": {"sp1": one["seconds"], "sp2": two["seconds"]},
        "step_time_ratio_sp2_vs_sp1": two["seconds"] / one["seconds"],
        "longest_sequence_in_budget": {
            "budget_gib": args.budget_gib,
            "sp1": int(budget / per_token[1]),
            "sp2": int(budget / per_token[2]),
        },
        "threads_per_rank": 1,
    }
    gib = summary["activation_gib_per_rank"]
    print(
        f"{args.tokens} tokens: activations per rank {gib['sp1']:.2f} GiB (sp 1) vs {gib['sp2']:.2f} GiB (sp 2), "
        f"ratio {summary['activation_ratio_sp2_vs_sp1']:.2f}; step {one['seconds']:.1f} s vs {two['seconds']:.1f} s"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
