"""Tree packing in the scoring engine: a call's rows folded into prefix tries (:mod:`.tree`), each shared token
forwarded once, when that pays and is exact for the model; otherwise the call packs rows as before.

A call's rows are sorted by their tokens, so rows that share a prefix (a group's prompt, a DPO pair's prompt, a
conversation's earlier turns) sit together, then filled into tries up to `token_budget` unique tokens each. Each
trie's tokens go through the backbone once (`position_ids` = depth; the attention of :mod:`.tree_kernel` on sdpa
models, a dense path mask on eager ones), and every (row, position) the caller keeps reads its node's hidden state:
the gather's backward sums a shared node's gradient over the rows that read it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..logs import get_logger
from .packing import empty_forward_anchor
from .routing_replay import replay_active
from .support import PROBE_TOLERANCES, draws_random_numbers
from .tree import PrefixTrie, TreeRows, sliding_window_of, why_not_tree
from .tree_flex import flex_tree_kwargs, static_shapes
from .tree_kernel import TREE_SEGMENTS_KWARG
from .varlen import TREE_SDPA, VARLEN_SDPA, install_tree_attention, varlen_forward

logger = get_logger(__name__)

TREE_PACKING_CHOICES = ("auto", True, False)
# auto: tree rows when their estimated cost is at most this fraction of the rows' (a margin for the fold and gather)
_PAYS = 0.9


@dataclass
class TreeMicroBatch:
    """One forward's trie: the batch rows it holds (in the trie's row order) and their real columns."""

    tree: TreeRows | None  # None: an empty forward, for a rank with fewer micro-batches than another
    rows: list[int]
    columns: list[torch.Tensor]


@dataclass
class TreeSupport:
    """Whether tree rows are exact for a backbone, with which kernel (probed once, cached on the backbone)."""

    # "segments" (sdpa, varlen), "blocks" (flex: a block mask), "dense" (eager: a path mask), None: no tree kernel
    kernel: str | None
    exact: bool | None = None
    reason: str = ""
    # a window that counts distance in the tree's layout, not in the row (GPT-Neo's local attention): a trie longer
    # than it is not exact even when each of its rows fits the window. None: no window, or one kept per row.
    layout_window: int | None = None


def fold_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, token_budget: int | None
) -> list[tuple[PrefixTrie, list[tuple[int, torch.Tensor]]]]:
    """The padded batch's rows (their real tokens) as tries of at most `token_budget` unique tokens each (a row
    longer than the budget alone), rows sharing a prefix together; with each trie, its rows (batch index, real
    columns) in the trie's row order."""
    real = attention_mask.detach().bool().cpu()
    ids = input_ids.detach().cpu()
    rows = [(b, real[b].nonzero()[:, 0]) for b in range(ids.size(0))]
    rows = [(b, columns, ids[b, columns]) for b, columns in rows if len(columns)]
    rows.sort(key=lambda row: row[2].tolist())
    tries: list[tuple[PrefixTrie, list]] = []
    for b, columns, tokens in rows:
        if not tries or (token_budget is not None and _grown(tries[-1][0], tokens) > token_budget):
            tries.append((PrefixTrie(), []))
        trie, members = tries[-1]
        trie.insert(tokens)
        members.append((b, columns))
    return tries


def _grown(trie: PrefixTrie, tokens: torch.Tensor) -> int:
    """The trie's unique tokens once `tokens` is added."""
    return trie.num_tokens + len(tokens) - trie.matched(tokens)


def rows_cost(lengths: list[int], hidden_size: int) -> float:
    """A packed-rows forward's work in units of one attention pair: each token's projections and MLP cost about
    6 x hidden pairs' worth (24 d^2 vs 4 d per layer), and each row attends causally (L^2 / 2 pairs)."""
    return sum(6 * hidden_size * n + n * n / 2 for n in lengths)


def tree_cost(trees: list[TreeRows], kernel: str, hidden_size: int) -> float:
    """The same for tree rows: tree segments (and flex's blocks, about as many pairs) attend to their path and
    causally within, a dense path mask to every token of its trie."""
    cost = 0.0
    for tree in trees:
        cost += 6 * hidden_size * tree.num_tokens
        if kernel == "dense":
            cost += tree.num_tokens**2
            continue
        q = (tree.segments.cu_seq_lens_q[1:] - tree.segments.cu_seq_lens_q[:-1]).double()
        k = (tree.segments.cu_seq_lens_k[1:] - tree.segments.cu_seq_lens_k[:-1]).double()
        cost += float((q * (k - q) + q * q / 2).sum())
    return cost


def tree_support(backbone) -> TreeSupport:
    """The backbone's :class:`TreeSupport`: which kernel takes tree rows (an sdpa model is switched to
    :data:`.varlen.TREE_SDPA`, sdpa for every other call), probed for exactness once."""
    support = getattr(backbone, "_trl_scale_tree_support", None)
    if support is None:
        attention = getattr(backbone.config, "_attn_implementation", None)
        if attention in (VARLEN_SDPA, TREE_SDPA) or (attention == "sdpa" and install_tree_attention(backbone)):
            support = TreeSupport("segments")
        elif attention == "eager":
            support = TreeSupport("dense")
        elif attention == "flex_attention":
            support = TreeSupport("blocks")
        else:
            support = TreeSupport(None, exact=False, reason=f"attn_implementation={attention!r} takes no tree mask")
        backbone._trl_scale_tree_support = support
    if support.exact is None:
        support.exact, support.reason = probe_tree(backbone, support.kernel)
        window = sliding_window_of(backbone.config)
        if support.exact and window is not None and not probe_window_by_row(backbone, support.kernel, window):
            support.layout_window = window
    return support


def tree_forward_kwargs(tree: TreeRows, kernel: str, device: torch.device, dtype: torch.dtype) -> dict:
    """The backbone's keyword arguments for one trie's forward."""
    if kernel == "blocks":
        return flex_tree_kwargs(tree, device)
    kwargs = {
        "input_ids": tree.token_ids[None].to(device),
        "position_ids": tree.position_ids[None].to(device),
        "use_cache": False,
    }
    if kernel == "segments":
        kwargs["attention_mask"] = None
        kwargs[TREE_SEGMENTS_KWARG] = tree.segments.to(device)
    else:
        kwargs["attention_mask"] = tree.attention_mask(dtype).to(device)
    return kwargs


def tree_hidden(backbone, tree: TreeRows, kernel: str) -> torch.Tensor:
    """One trie's hidden states, ``[nodes, hidden]``."""
    parameter = next(backbone.parameters())
    kwargs = tree_forward_kwargs(tree, kernel, parameter.device, parameter.dtype)
    context = {"segments": varlen_forward, "blocks": static_shapes}.get(kernel, nullcontext)
    with context():
        return backbone(**kwargs).last_hidden_state[0, : tree.num_tokens]  # flex: without the padding


def probe_tree(backbone, kernel: str | None) -> tuple[bool, str]:
    """Fold three rows sharing a prefix (and one sharing part of it) and compare each row's hidden states with the
    row run alone. Rows fit a sliding window (longer ones are refused per call). Returns ``(exact, reason)``."""
    if kernel is None:
        return False, "no tree kernel"
    longest = min(12, sliding_window_of(backbone.config) or 12)
    if longest < 6:
        return False, f"a sliding window of {longest} tokens"
    vocab = backbone.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (longest - 4,), generator=generator)
    rows = [torch.cat([prompt, torch.randint(0, vocab, (n,), generator=generator)]) for n in (4, 2, 3)]
    rows.append(torch.cat([prompt[:1], torch.randint(0, vocab, (3,), generator=generator)]))
    return _tree_matches_rows(backbone, kernel, rows)


def probe_window_by_row(backbone, kernel: str, window: int) -> bool:
    """Whether the model's attention window counts distance within each row (position ids), not in the tree's
    layout: rows that each fit the window, folded into a layout longer than it, match the rows alone. The rows
    depend on the config only, so every rank runs the same forwards (they gather sharded parameters)."""
    vocab = backbone.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (2,), generator=generator)
    branch = max(1, min(6, window - 2))
    count = window // branch + 2  # the layout: 2 + count * branch tokens, past the window
    rows = [torch.cat([prompt, torch.randint(0, vocab, (branch,), generator=generator)]) for _ in range(count)]
    return _tree_matches_rows(backbone, kernel, rows)[0]


def _tree_matches_rows(backbone, kernel: str, rows: list[torch.Tensor]) -> tuple[bool, str]:
    """`rows` folded into one tree and forwarded once, against each row alone: ``(exact, reason)``."""
    tree = TreeRows.fold(rows)
    device = next(backbone.parameters()).device
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            hidden = tree_hidden(backbone, tree, kernel).float()
            alone = [backbone(input_ids=row[None].to(device), use_cache=False).last_hidden_state[0] for row in rows]
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        return False, f"its tree forward fails ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    finally:
        backbone.train(was_training)
    tolerance = PROBE_TOLERANCES["full" if alone[0].dtype in (torch.float32, torch.float64) else "half"]["alone"]
    for nodes, own in zip(tree.row_nodes, alone):
        own = own.float()
        error = (hidden[nodes.to(device)] - own).abs().max().item() / max(1.0, own.abs().max().item())
        if error > tolerance:
            return False, f"a tree row differs from the same row alone by {error:.1e} (its attention ignores the path)"
    return True, ""


_announced: set[str] = set()


def _step_aside(model_type: str, reason: str, tree_packing) -> None:
    if tree_packing is True:
        raise ValueError(
            f"tree_packing=True, but tree rows are not exact for model type '{model_type}': {reason}. Fix: "
            "tree_packing='auto' (tree rows where exact and worth it, else packed rows) or tree_packing=False"
        )
    if model_type not in _announced:  # once per model type (a window's reason differs with each call's rows)
        _announced.add(model_type)
        logger.warning(
            f"trl-scale: tree packing steps aside for model type '{model_type}' ({reason}); its scoring calls pack "
            "rows without sharing prefixes. Set tree_packing=False to silence this."
        )


def planned_trees(backbone, input_ids, attention_mask, token_budget: int | None, tree_packing) -> list | None:
    """The tries to forward this call as (each with its rows), or None to pack rows as before: `tree_packing`
    False, a model whose attention cannot take a tree exactly (a warning that names why; an error with True), or,
    with "auto", a call where sharing would not save enough work."""
    if tree_packing is False or replay_active():  # replayed routes are laid out by packed rows (`routing_replay`)
        return None
    config = backbone.config
    lengths = attention_mask.sum(1).tolist()
    # The probe first, on every rank alike (its forwards gather sharded parameters collectively), then this call's
    # rows (a sliding window shorter than the longest row).
    reason = why_not_tree(config, 0)
    support = tree_support(backbone) if reason is None else None
    if reason is None:
        reason = support.reason if not support.exact else why_not_tree(config, int(max(lengths, default=0)))
    if reason is None and draws_random_numbers(backbone):
        reason = (
            "dropout is active (a shared token would drop out alike for every row); set disable_dropout=True or "
            "the model's attention_dropout to 0"
        )
    if reason is not None:
        _step_aside(config.get_text_config().model_type, reason, tree_packing)
        return None
    tries = fold_rows(input_ids, attention_mask, token_budget)
    trees = [trie.laid_out() for trie, _ in tries]
    window = support.layout_window
    if window is not None and any(tree.num_tokens > window for tree in trees):
        longest = max(tree.num_tokens for tree in trees)
        reason = (
            f"its attention window ({window} tokens) counts distance in the tree's layout, and this call's tree is "
            f"{longest} tokens long (rows within the window are exact only in a layout within it)"
        )
        _step_aside(config.get_text_config().model_type, reason, tree_packing)
        return None
    if tree_packing == "auto":
        hidden_size = config.get_text_config().hidden_size
        if tree_cost(trees, support.kernel, hidden_size) > _PAYS * rows_cost(lengths, hidden_size):
            return None
    return [
        TreeMicroBatch(tree, [b for b, _ in members], [columns for _, columns in members])
        for (_, members), tree in zip(tries, trees)
    ]


def tree_backbone_forward(backbone, micro_batches: list[TreeMicroBatch], seq_len: int, keep: torch.Tensor | None):
    """Forward each trie; returns ``([(flat index into [B, T], hidden [n, H]), ...], anchor)`` for the (row,
    position) pairs `keep` ([B * T] bool; None: every real token) marks. ``anchor``: a zero that depends on an
    empty micro-batch's dummy forward (see the engine's packed forward)."""
    support = tree_support(backbone)
    pieces, anchor = [], None
    device = next(backbone.parameters()).device
    for micro_batch in micro_batches:
        if micro_batch.tree is None:
            anchor = empty_forward_anchor(backbone, device)
            continue
        hidden = tree_hidden(backbone, micro_batch.tree, support.kernel)
        flat = torch.cat([b * seq_len + columns for b, columns in zip(micro_batch.rows, micro_batch.columns)])
        nodes = torch.cat(micro_batch.tree.row_nodes)
        flat, nodes = flat.to(device), nodes.to(device)
        if keep is not None:
            kept = keep[flat]
            flat, nodes = flat[kept], nodes[kept]
        pieces.append((flat, gathered(hidden, nodes)))
    return pieces, anchor


def gathered(hidden: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """Each (row, position)'s node hidden state: one copy per reader, so the backward sums a shared node's gradient
    over the rows that read it."""
    return hidden.index_select(0, nodes)
