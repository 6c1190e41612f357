"""One rank of the sequence-parallel scoring parity check (run by tests/test_sequence_parallel.py under
`torch.distributed.run`, 2 processes, gloo): the same batch scored by TRL's padded forward in one process and by
trl-scale's packed engine sharded over the 2 ranks with Ulysses attention (DeepSpeed's ALST); writes the largest
differences of per-token log-probs, entropies, the loss and the gradients (summed over the group, divided by its
size, as data-parallel averaging does) to a file per case and rank. A case with `own_batches` gives rank 1 another
batch: the engine must refuse it (the group is one data-parallel rank), and the worker records the error."""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist


def batch(vocab: int, lengths: list[int], prompt: int, seed: int = 0):
    """Right-padded rows of random tokens (the first `prompt` of each unlabelled, as a prompt), and labels."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, :length] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return input_ids, mask, labels


def scored(model, input_ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def mutate(name: str) -> None:
    """The mutations the parity must catch: a slice's tokens matched to the hidden state one row off; a token at a
    slice boundary scored on both ranks; the group's values taken from rank 0 only."""
    from trl_scale.scoring import engine

    if name == "shift":

        def shifted(token_index, start, end):
            mine = (token_index >= start) & (token_index < end)
            return mine, (token_index[mine] - start + 1).clamp(max=end - start - 1)

        engine.slice_tokens = shifted
    elif name == "twice":

        def twice(token_index, start, end):
            mine = (token_index >= max(0, start - 1)) & (token_index < end)
            return mine, (token_index[mine] - start).clamp(min=0)

        engine.slice_tokens = twice
    else:

        def rank0_only(values, group):
            values = values.clone()
            dist.broadcast(values, src=dist.get_global_rank(group.group, 0), group=group.group)
            return values

        engine.summed_over_group = rank0_only


def run_case(case: dict, out: str) -> None:
    """One case (the options of the test that reads it): a model, its lengths and budget, a mutation or another batch
    on rank 1. Writes this rank's result to `out` + rank."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import engine, install_packed_scoring
    from trl_scale.scoring.sequence_parallel import SequenceParallelGroup, enable_sequence_parallel

    own_batches, rank = case.get("own_batches", False), dist.get_rank()
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_pretrained(case["model"], dtype=torch.float32)
    reference.eval()
    add_fused_lm_head(reference, outputs=("log_probs", "entropy"))
    sharded = copy.deepcopy(reference)
    group = enable_sequence_parallel(sharded, 2)
    originals = (engine.slice_tokens, engine.summed_over_group)
    if case.get("mutation"):
        mutate(case["mutation"])
    try:
        install_packed_scoring(
            sharded, token_budget=case.get("token_budget"), outputs=("entropy",), sequence_parallel=group
        )
        lengths = [int(n) for n in case.get("lengths", "9,23,12,5").split(",")]  # odd total; 23 over half of 30
        if own_batches and rank == 1 and not case.get("same_shape"):  # another batch, of other lengths and rows
            lengths = [7, 30, 4]
        vocab = reference.config.get_text_config().vocab_size
        input_ids, mask, labels = batch(vocab, lengths, prompt=3, seed=rank if own_batches else 0)
        expected, expected_grads = scored(reference, input_ids, mask, labels)
        if own_batches:
            try:
                scored(sharded, input_ids, mask, labels)
                result = {"rank": rank, "refused": ""}
            except RuntimeError as error:
                result = {"rank": rank, "refused": str(error)}
        else:
            got, grads = scored(sharded, input_ids, mask, labels)
            for value in grads.values():  # data-parallel averaging over the 2 ranks (one data-parallel rank's)
                dist.all_reduce(value)
                value /= 2
            valid = expected.label_mask
            result = {
                "rank": rank,
                "group": isinstance(group, SequenceParallelGroup) and group.size,
                "log_probs": (got.log_probs - expected.log_probs)[valid].abs().max().item(),
                "entropy": (got.entropy - expected.entropy)[valid].abs().max().item(),
                "loss": abs(got.loss.item() - expected.loss.item()),
                "grads": max((grads[n] - g).abs().max().item() for n, g in expected_grads.items()),
                "same_grad_names": sorted(grads) == sorted(expected_grads),
                "scored_tokens": int(valid.sum()),
            }
    finally:
        engine.slice_tokens, engine.summed_over_group = originals
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()


def main() -> None:
    """`--cases FILE`: a JSON object of named cases, run one after the other in this one launch (a launch costs
    more than a case); each writes `--out`/name.rank. The refusals last: a case whose ranks hold different batches
    ends on the check's own refusal, which leaves the group usable, but nothing is risked on it."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.cases) as f:
        cases = json.load(f)
    dist.init_process_group("gloo")
    for name, case in sorted(cases.items(), key=lambda item: item[1].get("own_batches", False)):
        run_case(case, os.path.join(args.out, name))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
