"""Remove-padding: pack the real tokens of a padded batch into rows whose ``position_ids`` restart at 0 for
each sequence, split into micro-batches filled up to a token budget, and scatter per-token results back.

transformers treats a row as packed only when the forward gets ``attention_mask=None`` and builds no KV cache:
any 2D mask (even all ones) or an active cache silently lets the packed sequences attend to each other
(measured error ~0.7, no warning). :func:`packed_forward_kwargs` is the one place that builds those kwargs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class PackedMicroBatch:
    """One packed forward: ``R`` rows of real tokens, several sequences per row, back to back.

    A row holds whole sequences; a row shorter than the others ends in filler tokens that form a sequence of their
    own (positions restarting at 0), so they attend to nothing real and their outputs are dropped."""

    input_ids: torch.Tensor  # [R, W] int64
    position_ids: torch.Tensor  # [R, W] int64, restarting at 0 per sequence (and per filler run)
    seq_idx: torch.Tensor  # [R, W] int32, the sequence each token belongs to within its row (for SSM kernels)
    cu_seq_lens: torch.Tensor  # [segments + 1] int32 over the flattened rows, for varlen kernels (R == 1)
    max_length: int
    flat_index: torch.Tensor  # [n] positions of the real tokens in the flattened [B*T] padded layout
    token_index: torch.Tensor  # [n] positions of the same tokens in the flattened [R*W] micro-batch

    def real_tokens(self, per_position: torch.Tensor) -> torch.Tensor:
        """``per_position`` [R, W, ...] (e.g. hidden states) at the real tokens, ``[n, ...]``, in flat_index order."""
        return per_position.reshape(-1, *per_position.shape[2:])[self.token_index]


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

    @property
    def forwarded_tokens(self) -> int:
        return sum(mb.input_ids.numel() for mb in self.micro_batches)


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


def plan_rows(lengths: list[int], sequences: list[int], row_capacity: int | None) -> list[list[int]]:
    """Lay ``sequences`` (indices into ``lengths``) into rows of at most ``row_capacity`` tokens, first fit by
    decreasing length; ``None`` puts them all in one row. A sequence longer than the capacity gets its own row."""
    if row_capacity is None:
        return [list(sequences)] if sequences else []
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(sequences, key=lambda i: (-lengths[i], i)):
        row = next((r for r in range(len(rows)) if loads[r] + lengths[i] <= row_capacity), None)
        if row is None:
            rows.append([i])
            loads.append(lengths[i])
        else:
            rows[row].append(i)
            loads[row] += lengths[i]
    return [sorted(r) for r in rows]


def pack_padded_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    token_budget: int | None = None,
    num_micro_batches: int | None = None,
    row_capacity: int | Literal["longest"] | None = None,
) -> PackedBatch:
    """Pack a padded ``[B, T]`` batch (any mix of left and right padding) into micro-batches of real tokens.

    A sequence is the tokens where ``attention_mask`` is 1, in order; its ``position_ids`` are 0..L-1, which is
    what RoPE models compute for a right-padded row and what TRL's left-padded rows differ from only by a
    constant offset (harmless for relative positions).

    ``token_budget`` bounds the real tokens of one micro-batch (see :func:`plan_micro_batches`). ``row_capacity``
    shapes each micro-batch: ``None`` puts it in one row (for varlen kernels, which cost O(sum of L_i^2) on any
    row); an int or ``"longest"`` (the longest sequence of the batch) lays it in rows of that width (for dense
    kernels, sdpa and eager, whose attention costs O(width^2) per row: no more than the padded batch's).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"expected input_ids and attention_mask of the same [batch, seq] shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    batch_size, seq_len = input_ids.shape
    mask = attention_mask.bool()
    lengths = mask.sum(1).tolist()
    if row_capacity == "longest":
        row_capacity = max(lengths, default=1)
    plan = plan_micro_batches(lengths, token_budget, num_micro_batches)
    flat_positions = torch.arange(batch_size * seq_len, device=input_ids.device).view(batch_size, seq_len)
    micro_batches = [
        _packed_micro_batch(input_ids, mask, flat_positions, lengths, plan_rows(lengths, sequences, row_capacity))
        for sequences in plan
    ]
    return PackedBatch(micro_batches, batch_size, seq_len, int(sum(lengths)))


def _packed_micro_batch(
    input_ids: torch.Tensor, mask: torch.Tensor, flat_positions: torch.Tensor, lengths: list[int], rows: list
) -> PackedMicroBatch:
    """One micro-batch: its sequences laid in `rows` (each a list of sequence indices), every row as wide as the
    widest, the rest filler."""
    device = input_ids.device
    real_ids = input_ids.reshape(-1)
    width = max((sum(lengths[i] for i in row) for row in rows), default=0)
    num_rows = max(1, len(rows))
    # Filler: token 0 (any valid id), positions restarting at 0 as a sequence of its own, outputs dropped.
    ids = input_ids.new_zeros(num_rows, width)
    positions = torch.zeros(num_rows, width, dtype=torch.long, device=device)
    seq_idx = torch.zeros(num_rows, width, dtype=torch.int32, device=device)
    flat_index, token_index, segment_lengths = [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for s, i in enumerate(row):
            n = lengths[i]
            flat_index.append(flat_positions[i][mask[i]])
            token_index.append(torch.arange(r * width + offset, r * width + offset + n, device=device))
            positions[r, offset : offset + n] = torch.arange(n, device=device)
            seq_idx[r, offset : offset + n] = s
            segment_lengths.append(n)
            offset += n
        if offset < width:
            positions[r, offset:] = torch.arange(width - offset, device=device)
            seq_idx[r, offset:] = len(row)
            segment_lengths.append(width - offset)
    flat = torch.cat(flat_index) if flat_index else flat_positions.new_zeros(0)
    tokens = torch.cat(token_index) if token_index else flat_positions.new_zeros(0)
    ids.view(-1)[tokens] = real_ids[flat]
    cu = torch.zeros(len(segment_lengths) + 1, dtype=torch.int32, device=device)
    if segment_lengths:
        cu[1:] = torch.tensor(segment_lengths, device=device).cumsum(0)
    return PackedMicroBatch(
        input_ids=ids if rows else ids[:, :0],
        position_ids=positions if rows else positions[:, :0],
        seq_idx=seq_idx if rows else seq_idx[:, :0],
        cu_seq_lens=cu,
        max_length=max(segment_lengths, default=0),
        flat_index=flat,
        token_index=tokens,
    )


def packed_forward_kwargs(micro_batch: PackedMicroBatch, varlen_kwargs: bool = False, mrope: bool = False) -> dict:
    """The only kwargs a packed backbone forward gets: no attention mask, no cache (see the module docstring).

    ``varlen_kwargs`` adds the sequence boundaries that varlen kernels take (flash attention's ``cu_seq_lens``,
    linear-attention and SSM layers' ``cu_seq_lens`` / ``seq_idx``); only a single-row micro-batch can carry them,
    since those kernels read the rows as one flattened sequence of segments. ``mrope`` (Qwen2-VL and its kin, whose
    text model reads (time, height, width) positions): the positions as such a model takes packed rows,
    ``[4, rows, width]``, the plain ones first (they keep each token to its sequence), then the three axes (for text,
    each the plain ones); given ``[rows, width]``, it would copy them to the three axes and read no sequences."""
    positions = micro_batch.position_ids
    kwargs = {
        "input_ids": micro_batch.input_ids,
        "position_ids": positions[None].expand(4, *positions.shape) if mrope else positions,
        "attention_mask": None,
        "use_cache": False,
        "past_key_values": None,
    }
    if varlen_kwargs:
        if micro_batch.input_ids.size(0) != 1:
            raise ValueError("varlen kernels take one packed row per forward (row_capacity=None)")
        # Precomputed on the host: saves flash varlen a device sync per layer to infer them from position_ids.
        kwargs.update(
            cu_seq_lens_q=micro_batch.cu_seq_lens,
            cu_seq_lens_k=micro_batch.cu_seq_lens,
            max_length_q=micro_batch.max_length,
            max_length_k=micro_batch.max_length,
            seq_idx=micro_batch.seq_idx,
        )
    return kwargs


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


def empty_forward_anchor(backbone, device: torch.device) -> torch.Tensor:
    """A zero that depends on a one-token forward of `backbone`: what a rank with an empty micro-batch runs, so that
    its forward (and backward, once the zero is added to an output) matches the other ranks' count, as the
    collectives of sharded parameters (ZeRO-3, FSDP) require."""
    dummy = torch.zeros((1, 1), dtype=torch.long, device=device)
    out = backbone(input_ids=dummy, position_ids=dummy, attention_mask=None, use_cache=False)
    return out.last_hidden_state.sum() * 0.0
