"""Remove-padding: pack the real tokens of a padded batch into rows whose ``position_ids`` restart at 0 for
each sequence, split into micro-batches filled up to a token budget, and scatter per-token results back.

transformers treats a row as packed only when the forward gets ``attention_mask=None`` and builds no KV cache:
any 2D mask (even all ones) or an active cache silently lets the packed sequences attend to each other
(measured error ~0.7, no warning). :func:`packed_forward_kwargs` is the one place that builds those kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Attention implementations that honour packed `position_ids` with `attention_mask=None` (sdpa/eager/flex build a
# block-diagonal mask from them; the flash kernels take `cu_seq_lens`).
PACKING_ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass
class PackedMicroBatch:
    """One packed row: the real tokens of some sequences of the batch, back to back."""

    input_ids: torch.Tensor  # [1, n] int64
    position_ids: torch.Tensor  # [1, n] int64, restarting at 0 per sequence
    cu_seq_lens: torch.Tensor  # [num_seqs + 1] int32, for flash varlen
    max_length: int
    flat_index: torch.Tensor  # [n] positions in the flattened [B*T] padded layout


@dataclass
class PackedBatch:
    micro_batches: list[PackedMicroBatch]
    batch_size: int
    seq_len: int
    num_real_tokens: int

    @property
    def pad_fraction_removed(self) -> float:
        total = self.batch_size * self.seq_len
        return 1.0 - self.num_real_tokens / total if total else 0.0


def plan_micro_batches(
    lengths: list[int], token_budget: int | None, num_micro_batches: int | None = None
) -> list[list[int]]:
    """Group sequence indices into micro-batches whose token counts stay within ``token_budget``.

    Longest first, each sequence goes to the least-loaded micro-batch it fits in (a new one if none), which keeps
    the micro-batches balanced. A sequence longer than the budget gets a micro-batch of its own. With
    ``num_micro_batches`` the plan has exactly that many (at least as many as the budget needs): the largest ones
    are split while there are too few, and any still missing come back empty for the caller to fill with a dummy
    forward, so that every data-parallel rank runs the same number of forwards.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    if token_budget is None:
        bins, loads = ([order], [sum(lengths)]) if order else ([], [])
    else:
        for i in order:
            fitting = [b for b in range(len(bins)) if loads[b] + lengths[i] <= token_budget]
            if fitting:
                b = min(fitting, key=lambda b: loads[b])
                bins[b].append(i)
                loads[b] += lengths[i]
            else:
                bins.append([i])
                loads.append(lengths[i])
    if num_micro_batches is not None:
        if num_micro_batches < len(bins):
            raise ValueError(f"num_micro_batches={num_micro_batches} is fewer than the {len(bins)} the budget needs")
        while len(bins) < num_micro_batches:
            splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
            if not splittable:
                bins.append([])
                loads.append(0)
                continue
            b = max(splittable, key=lambda b: loads[b])
            # Move sequences from the largest micro-batch into a new one until the two are balanced.
            moved: list[int] = []
            while len(bins[b]) > 1 and sum(lengths[i] for i in moved) < loads[b] / 2:
                moved.append(bins[b].pop())
                loads[b] -= lengths[moved[-1]]
            bins.append(moved)
            loads.append(sum(lengths[i] for i in moved))
    # Keep each micro-batch in batch order: deterministic packing, easy to read.
    return [sorted(b) for b in bins]


def pack_padded_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_budget: int | None = None,
    num_micro_batches: int | None = None,
) -> PackedBatch:
    """Pack a padded ``[B, T]`` batch (any mix of left and right padding) into micro-batches of real tokens.

    A sequence is the tokens where ``attention_mask`` is 1, in order; its ``position_ids`` are 0..L-1, which is
    what RoPE models compute for a right-padded row and what TRL's left-padded rows differ from only by a
    constant offset (harmless for relative positions).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"expected input_ids and attention_mask of the same [batch, seq] shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    batch_size, seq_len = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(1).tolist()
    plan = plan_micro_batches(lengths, token_budget, num_micro_batches)
    device = input_ids.device
    flat_positions = torch.arange(batch_size * seq_len, device=device).view(batch_size, seq_len)
    micro_batches = []
    for rows in plan:
        rows_tensor = torch.tensor(rows, dtype=torch.long, device=device)
        row_mask = mask[rows_tensor]
        flat_index = flat_positions[rows_tensor][row_mask]
        row_lengths = [lengths[r] for r in rows]
        position_ids = torch.cat([torch.arange(n, device=device) for n in row_lengths]) if rows else flat_index
        cu = torch.zeros(len(rows) + 1, dtype=torch.int32, device=device)
        if rows:
            cu[1:] = torch.tensor(row_lengths, device=device).cumsum(0)
        micro_batches.append(
            PackedMicroBatch(
                input_ids=input_ids.reshape(-1)[flat_index].unsqueeze(0),
                position_ids=position_ids.unsqueeze(0),
                cu_seq_lens=cu,
                max_length=max(row_lengths, default=0),
                flat_index=flat_index,
            )
        )
    return PackedBatch(micro_batches, batch_size, seq_len, int(sum(lengths)))


def pack_sequences(sequences: list[list[int]], token_budget: int | None = None, pad_token_id: int = 0) -> PackedBatch:
    """Pack raw token-id sequences (no padding anywhere); ``flat_index`` refers to their right-padded layout."""
    seq_len = max((len(s) for s in sequences), default=0)
    input_ids = torch.full((len(sequences), seq_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, seq in enumerate(sequences):
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, : len(seq)] = 1
    return pack_padded_batch(input_ids, attention_mask, token_budget)


def packed_forward_kwargs(micro_batch: PackedMicroBatch, attn_implementation: str | None) -> dict:
    """The only kwargs a packed backbone forward gets: no attention mask, no cache (see the module docstring)."""
    check_packing_attention(attn_implementation)
    kwargs = {
        "input_ids": micro_batch.input_ids,
        "position_ids": micro_batch.position_ids,
        "attention_mask": None,
        "use_cache": False,
        "past_key_values": None,
    }
    if attn_implementation and attn_implementation.startswith("flash"):
        # Precomputed on the host: saves flash varlen a device sync per layer to infer them from position_ids.
        kwargs.update(
            cu_seq_lens_q=micro_batch.cu_seq_lens,
            cu_seq_lens_k=micro_batch.cu_seq_lens,
            max_length_q=micro_batch.max_length,
            max_length_k=micro_batch.max_length,
        )
    return kwargs


def check_packing_attention(attn_implementation: str | None) -> None:
    if attn_implementation is not None and attn_implementation not in PACKING_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"padding_free=True needs an attention implementation that honours packed position_ids "
            f"({', '.join(PACKING_ATTENTION_IMPLEMENTATIONS)}); this model uses {attn_implementation!r}. "
            f"Fix: load the model with attn_implementation='sdpa' (model_init_kwargs), or set padding_free=False."
        )


def unpack(values: torch.Tensor, flat_index: torch.Tensor, batch_size: int, seq_len: int, fill: float = 0.0):
    """Scatter per-token ``values`` [n] back to a ``[batch_size, seq_len]`` tensor (differentiable)."""
    out = values.new_full((batch_size * seq_len,), fill)
    return out.index_put((flat_index,), values).view(batch_size, seq_len)


@dataclass
class UnpaddedRows:
    """A padded ``[B, T]`` batch without its padding: the real tokens back to back and a boolean mask. This is
    what crosses process boundaries (e.g. Ray's object store): int64 ids for real tokens only, one byte per
    position for the layout, and :meth:`to_padded` rebuilds the exact batch on the other side."""

    tokens: torch.Tensor  # [num_real_tokens] int64, row-major order
    mask: torch.Tensor  # [B, T] bool

    @classmethod
    def from_padded(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> UnpaddedRows:
        mask = attention_mask.detach().bool().cpu()
        return cls(tokens=input_ids.detach().cpu()[mask], mask=mask)

    def to_padded(self, pad_token_id: int = 0, device: torch.device | str | None = None):
        """``(input_ids, attention_mask)`` as int64 tensors, padding filled with ``pad_token_id``."""
        input_ids = torch.full(self.mask.shape, pad_token_id, dtype=torch.long)
        input_ids[self.mask] = self.tokens
        return input_ids.to(device), self.mask.long().to(device)

    @property
    def num_rows(self) -> int:
        return self.mask.size(0)

    def split(self, n: int) -> list[UnpaddedRows]:
        """``n`` row shards as ``torch.tensor_split`` makes them (some empty when there are fewer rows than n)."""
        masks = self.mask.tensor_split(n)
        counts = [int(m.sum()) for m in masks]
        return [UnpaddedRows(t, m) for t, m in zip(self.tokens.split(counts), masks)]
