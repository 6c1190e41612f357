"""Ulysses sequence parallelism in the packed scoring engine, on DeepSpeed's ALST (`UlyssesSPAttentionHF`).

Every rank of a sequence-parallel (SP) group scores the same packed micro-batch: its one row (several sequences
back to back, positions restarting at 0 per sequence) is padded to a multiple of the group's size with filler (a
sequence of its own, never scored) and each rank runs the backbone on its contiguous slice of the row. ALST's
attention swaps sequence shards for head shards with an all-to-all, so each rank attends over the whole row for
its share of the heads, then swaps back. The row's sequences must not attend to each other: ALST drops the model's
masks and hands the core attention the whole row's position ids, from which `packed_causal_attention` finds the
sequences and attends within each (with the model's sliding window and attention soft-capping), so packing stays
exact and attention memory linear in each sequence.

Each rank then scores the labelled tokens of its own slice with the chunked head, and a summing all-reduce (with
autograd) puts every token's result on every rank of the group, in TRL's `[B, T-1]` layout. The group is one
data-parallel rank (`trl_scale.sharding.data_parallel`): every rank holds the same batch and computes the same loss
from the summed results; in backward the all-reduce sums the group's (equal) gradients, so each rank's parameters
get `sp_size` times its slice's share, and data-parallel averaging over all `world` ranks gives the average over
the `world / sp_size` groups of each group's whole-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SP_ATTENTION = "trl_scale_packed_sp"  # the core attention ALST wraps (registered with transformers)

# Layer kinds whose state runs along the sequence (convolutions, SSMs, linear attention): a shard boundary cuts it.
_SEQUENTIAL_LAYERS = ("conv", "mamba", "linear_attention", "mamba2", "ssm")


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This process's SP group: its size, this rank's index in it, and the process group (None: one process)."""

    size: int
    rank: int
    group: object | None

    def shard(self, width: int) -> tuple[int, int, int]:
        """(padded width, start, end) of this rank's slice of a row of `width` tokens."""
        padded = -(-width // self.size) * self.size
        local = padded // self.size
        return padded, self.rank * local, (self.rank + 1) * local


def check_sequence_parallel(config, sp_size: int, world_size: int, attn_implementation: str | None = None) -> None:
    """Refusals, each naming the fix: what sharding the sequence cannot do exactly for this model or launch."""
    if sp_size < 1:
        raise ValueError(f"sp_size={sp_size}: the sequence-parallel group size must be at least 1")
    if world_size % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide the {world_size} processes: each sequence-parallel group takes "
            f"sp_size processes. Fix: launch a multiple of {sp_size} processes, or an sp_size dividing {world_size}"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    if heads % sp_size:
        raise ValueError(
            f"sp_size={sp_size} does not divide this model's {heads} attention heads: Ulysses gives each rank "
            f"heads / sp_size of them. Fix: an sp_size dividing {heads}"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if kv_heads % sp_size and sp_size % kv_heads:
        raise ValueError(
            f"sp_size={sp_size} and this model's {kv_heads} key/value heads: one must divide the other (ALST splits "
            f"or replicates them). Fix: an sp_size dividing {kv_heads}, or a multiple of it"
        )
    layer_types = set(getattr(text, "layer_types", None) or [])
    sequential = sorted(t for t in layer_types if any(kind in t for kind in _SEQUENTIAL_LAYERS))
    pattern = getattr(text, "hybrid_override_pattern", None)
    if sequential or (pattern and set(pattern) - {"*", "-"}):
        kinds = sequential or [f"hybrid_override_pattern={pattern!r}"]
        raise ValueError(
            f"this model has layers whose state runs along the sequence ({', '.join(kinds)}): a sequence-parallel "
            "shard boundary would cut it, so the scores would not be exact. Fix: sp_size=1 for this model"
        )
    if attn_implementation is not None and core_attention_for(attn_implementation) is None:
        raise ValueError(
            f"attn_implementation={attn_implementation!r}: sequence parallelism runs ALST's Ulysses attention over "
            "flash attention (packed rows through its varlen path) or, for 'sdpa', 'eager' and 'flex_attention', "
            "over trl-scale's per-sequence attention; this kernel is neither, so packed sequences could attend "
            "to each other. Fix: attn_implementation='sdpa' (or a flash_attention_* kernel on GPUs)"
        )


def core_attention_for(attn_implementation: str) -> str | None:
    """The core attention ALST wraps for a model loaded with `attn_implementation`: the flash kernels themselves
    (their varlen path reads sequence starts from the gathered position ids); trl-scale's per-sequence attention
    (`packed_causal_attention`) for the kernels that would see one long causal sequence (sdpa and flex: ALST drops
    their masks; eager: it needs a whole-sequence 4D mask); None for any other."""
    if attn_implementation.startswith("flash_attention"):
        return attn_implementation
    if attn_implementation in ("sdpa", "eager", "flex_attention", SP_ATTENTION):
        return SP_ATTENTION
    return None


QUERY_BLOCK = 1024  # queries per block where scores are formed explicitly (a window or soft-capping)


def packed_causal_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, position_ids=None, **kwargs
):
    """Causal attention over one packed row, each sequence attending to itself only (the row's sequences start
    where its position ids restart at 0): one causal attention per sequence, so memory stays linear in the
    sequence (sdpa's fused kernels) where a block-diagonal mask over the row would be quadratic. A sequence longer
    than the layer's sliding window, or a layer with attention soft-capping (Gemma 2), is computed in blocks of
    queries, each against the keys it may see (the window's, or all earlier ones): memory linear in the sequence
    too. Shapes as transformers' sdpa attention: query ``[1, h, S, d]``, key/value ``[1, kv_h, S, d]``; returns
    ``([1, S, h, d], None)``."""
    from transformers.integrations.sdpa_attention import repeat_kv

    if position_ids is None:
        raise ValueError("packed_causal_attention needs the row's position_ids (ALST gathers them)")
    if query.size(0) != 1:
        raise ValueError(f"packed_causal_attention takes one packed row, got a batch of {query.size(0)}")
    length = query.size(2)
    starts = (position_ids[0, -length:] == 0).nonzero().flatten().tolist()
    bounds = sorted({0, *starts, length})
    groups = query.size(1) // key.size(1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    dropout = dropout if module.training else 0.0
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if softcap is None and not (window and end - start > window):
            outputs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=scale
                )
            )
            continue
        for first in range(0, end - start, QUERY_BLOCK):
            last = min(first + QUERY_BLOCK, end - start)
            lowest = max(0, first - window + 1) if window else 0  # the earliest key any query of the block sees
            outputs.append(
                _attention_block(q[:, :, first:last], k[:, :, lowest:last], v[:, :, lowest:last], first - lowest,
                                 window, softcap, scale, dropout)
            )  # fmt: skip
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _attention_block(q, k, v, offset: int, window, softcap, scale: float, dropout: float) -> torch.Tensor:
    """Queries ``q`` (at positions ``offset + i`` of the keys ``k``) attending causally, within ``window``, with
    soft-capping when ``softcap`` is set."""
    queries = torch.arange(q.size(2), device=q.device)[:, None] + offset
    keys = torch.arange(k.size(2), device=q.device)[None, :]
    allowed = queries >= keys
    if window:
        allowed = allowed & (queries - keys < window)
    if softcap is None:
        attention = torch.nn.functional.scaled_dot_product_attention
        return attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.nn.functional.dropout(torch.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout)
    return torch.matmul(weights, v)


def _no_mask(*args, **kwargs):
    """The mask transformers would build for the local slice: none (ALST drops masks; the core attention builds
    the whole row's)."""
    return None


def enable_sequence_parallel(model, sp_size: int) -> SequenceParallelGroup:
    """Switch `model` (a transformers causal LM or backbone) to Ulysses attention over SP groups of `sp_size`
    consecutive ranks (DeepSpeed's layout), after the refusals. Returns this process's group."""
    from transformers import AttentionInterface, AttentionMaskInterface

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    current = getattr(model.config, "_attn_implementation", None)
    check_sequence_parallel(model.config, sp_size, world, current)
    if sp_size == 1:
        return SequenceParallelGroup(1, 0, None)
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    if not deepspeed.comm.is_initialized():  # DeepSpeed's groups over the process group already up (gloo or nccl)
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    core = core_attention_for(current or "sdpa")
    if core == SP_ATTENTION:
        AttentionInterface.register(SP_ATTENTION, packed_causal_attention)
        AttentionMaskInterface.register(SP_ATTENTION, _no_mask)
        model.set_attn_implementation(SP_ATTENTION)
    if mpu._SEQUENCE_PARALLEL_GROUP is None:  # once per process: ALST wraps the core attention for every model
        UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation=core, sequence_parallel_size=sp_size, micro_batch_size=1,
            seq_length_is_variable=True,
        )  # fmt: skip
    elif mpu.get_sequence_parallel_world_size() != sp_size:
        raise ValueError(
            f"sp_size={sp_size}, but this process's sequence-parallel groups have "
            f"{mpu.get_sequence_parallel_world_size()} ranks: every model of a run shares one sp_size"
        )
    group = mpu.get_sequence_parallel_group()
    return SequenceParallelGroup(sp_size, dist.get_rank(group), group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a process group; backward sums the gradients over it the same way."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        summed = values.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.group)
        return summed, None


def check_same_batch(group: SequenceParallelGroup, *tensors: torch.Tensor) -> None:
    """Every rank of an SP group must score the same batch (its slices are parts of one row): a batch that differs
    would be scored as a mix of both, silently. Compared by shape and a position-weighted checksum, one small
    all-gather per scoring call."""
    if group.size == 1:
        return
    first = tensors[0]
    fingerprint = [float(n) for n in first.shape]
    for tensor in tensors:
        values = tensor.detach().reshape(-1).double()
        weights = torch.arange(1, values.numel() + 1, device=values.device, dtype=torch.float64) % 9973 + 1
        fingerprint.append(float((values * weights).sum()))
    mine = torch.tensor(fingerprint, dtype=torch.float64, device=first.device)
    everyone = [torch.empty_like(mine) for _ in range(group.size)]
    dist.all_gather(everyone, mine, group=group.group)
    if any(not torch.equal(other, mine) for other in everyone):
        raise RuntimeError(
            "sequence parallelism: the ranks of a sequence-parallel group hold different batches, so their slices "
            "are not parts of the same rows. Each group must be one data-parallel rank (trl-scale's trainers "
            "arrange this with sequence_parallel_size; a custom loop must give every rank of a group the same batch)"
        )


def summed_over_group(values: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """Each rank's partial tensor (zero where another rank owns the entry), summed over the SP group, with
    autograd (backward sums the group's gradients)."""
    if group.size == 1:
        return values
    return _SumOverGroup.apply(values, group.group)
