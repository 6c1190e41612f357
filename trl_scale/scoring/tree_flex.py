"""Tree rows on FlexAttention: the tree's path rule (:class:`.tree.TreeRows`: key k is on query q's path iff
``k <= q < leave[k]``) as a block mask, built from the tree's intervals without a dense ``[N, N]`` mask.

Blocks of :data:`BLOCK` x :data:`BLOCK` tokens: a key block below the diagonal is *empty* for a query block when no
key in it has its subtree reaching the query block (``max(leave) <= q_start``), *full* when every key's subtree
covers the whole query block (``min(leave) >= q_end``), and partial otherwise (the diagonal always is); flex runs
`mask_mod` on partial blocks only. The layout is padded to a bucket of whole blocks (:func:`padded_length`), so
that calls of many lengths share a few compiled kernels; each padding token attends to itself only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .tree import TreeRows

BLOCK = 128  # flex attention's default sparse block size


def padded_length(num_tokens: int, block: int = BLOCK) -> int:
    """The layout's length: the tree's tokens rounded up to a bucket of whole blocks, 2^k or 3 x 2^(k-1) blocks
    (at most a third of padding past the first blocks; a few dozen shapes for any length, each compiled once)."""
    blocks = max(1, -(-num_tokens // block))
    power = 1 << (blocks - 1).bit_length()  # the power of two at or above
    bucket = power * 3 // 4 if power >= 4 and power * 3 // 4 >= blocks else power
    return bucket * block


@contextmanager
def static_shapes() -> Iterator[None]:
    """While a tree forward runs on flex: each bucketed length compiles its own static kernel. transformers
    compiles flex attention with automatic dynamic shapes, which recompile for symbolic lengths at the second
    length seen; inductor's CPU flex template fails to build such kernels (torch 2.13: an undeclared
    ``cur_qSplitSize`` in the generated C++), and bucketed lengths need no symbolic ones."""
    import torch._dynamo

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=64):
        yield


def padded_leave(tree: TreeRows, length: int) -> torch.Tensor:
    """`leave` of every laid-out token, the padding included (a padding token's subtree is itself)."""
    tail = torch.arange(tree.num_tokens + 1, length + 1, dtype=torch.long)
    return torch.cat([tree.leave.long(), tail])


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[q_blocks, kv_blocks]`` bool matrix as flex's ``(num_blocks, indices)``: per query block, how many key
    blocks and which (the marked ones first, in order), with flex's leading batch and head dimensions."""
    count = blocks.sum(-1).to(torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count[None, None], indices[None, None]


def block_classes(leave: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: ``[blocks, blocks]`` bool matrices of the path mask over a layout whose `leave` is
    given (its length a multiple of `block`)."""
    blocks = leave.numel() // block
    per_block = leave.view(blocks, block)
    reach_max, reach_min = per_block.max(1).values, per_block.min(1).values
    starts = torch.arange(blocks) * block
    below = torch.arange(blocks)[None, :] < torch.arange(blocks)[:, None]  # key block before the query block
    reaches = reach_max[None, :] > starts[:, None]  # some key's subtree reaches into the query block
    covers = reach_min[None, :] >= (starts + block)[:, None]  # every key's subtree covers the query block
    full = below & covers
    partial = (below & reaches & ~covers) | torch.eye(blocks, dtype=torch.bool)
    return partial, full


def tree_block_mask(tree: TreeRows, device: torch.device, block: int = BLOCK):
    """The flex ``BlockMask`` of `tree`'s paths over its padded layout (see the module's docstring)."""
    from torch.nn.attention.flex_attention import BlockMask

    length = padded_length(tree.num_tokens, block)
    leave = padded_leave(tree, length)
    partial, full = block_classes(leave, block)
    leave = leave.to(device)

    def on_path(batch, head, q_index, kv_index):
        return (kv_index <= q_index) & (q_index < leave[kv_index])

    kv_num, kv_indices = _ordered(partial)
    full_num, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num.to(device),
        kv_indices.to(device),
        full_num.to(device),
        full_indices.to(device),
        BLOCK_SIZE=block,
        mask_mod=on_path,
        seq_lengths=(length, length),
    )


def flex_tree_kwargs(tree: TreeRows, device: torch.device, pad_token_id: int = 0) -> dict:
    """The backbone's keyword arguments for one trie's forward on flex attention: the padded layout (padding at
    position 0, attending to itself) and its block mask. The first `tree.num_tokens` states are the tree's."""
    length = padded_length(tree.num_tokens)
    padding = length - tree.num_tokens
    token_ids = torch.cat([tree.token_ids, torch.full((padding,), pad_token_id, dtype=torch.long)])
    position_ids = torch.cat([tree.position_ids, torch.zeros(padding, dtype=torch.long)])
    return {
        "input_ids": token_ids[None].to(device),
        "position_ids": position_ids[None].to(device),
        "attention_mask": tree_block_mask(tree, device),
        "use_cache": False,
    }
