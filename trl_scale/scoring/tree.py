"""Tree rows: rows that share a prefix (a group's prompt, a conversation's earlier turns, a DPO pair's prompt) folded
into one prefix trie, so that each shared token is forwarded once (issue 61's first part; not yet wired into the
packed scoring engine).

Layout: the trie's nodes depth-first, one token each, `position_ids` = depth, and each token attending to its own
root-to-node path only (node k is on node q's path iff `enter[k] <= enter[q] < leave[k]`, the depth-first interval
rule). A row's log-prob of its token j is read from the hidden state of its node for token j-1: a shared node predicts
one next token per row that continues through it, and gathering its hidden state once per (row, position) makes its
gradient the sum over those rows, as the rows' separate forwards give it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .support import is_stateful


def why_not_tree(config, longest_row: int) -> str | None:
    """Why a model of `config` cannot score rows of up to `longest_row` tokens as tree rows exactly (None: it can).
    Layers that carry state along the sequence would scan across the rows a tree interleaves; a sliding window
    shorter than a row limits attention by distance in the row, which the tree's layout does not keep (measured:
    Mistral, Gemma 2 and 3 with rows past their window are off by ~0.2 nats; within it, exact)."""
    text = config.get_text_config()
    if is_stateful(config):
        return (
            f"{text.model_type} has layers that carry state along the sequence (convolution, SSM or linear attention)"
        )
    window = getattr(text, "sliding_window", None)
    if window is not None and getattr(text, "use_sliding_window", True) and window < longest_row:
        return (
            f"{text.model_type} attends within a sliding window of {window} tokens, shorter than a row ({longest_row})"
        )
    return None


@dataclass(frozen=True)
class TreeRows:
    """Rows of token ids folded into a prefix trie (see the module's docstring)."""

    token_ids: torch.Tensor  # [nodes]: one token per node, depth-first
    position_ids: torch.Tensor  # [nodes]: each node's depth (its token's position in every row through it)
    enter: torch.Tensor  # [nodes]: depth-first entry index (= the node's own index)
    leave: torch.Tensor  # [nodes]: one past the last index of the node's subtree
    row_nodes: tuple[torch.Tensor, ...]  # per row: the node of each of its tokens

    @classmethod
    def fold(cls, rows: list[list[int]]) -> TreeRows:
        """The trie of `rows` (lists of token ids; rows may be prefixes of each other or repeat)."""
        children: list[dict[int, int]] = [{}]  # node 0: a virtual root, not laid out
        tokens, paths = [-1], []
        for row in rows:
            node, path = 0, []
            for token in row:
                child = children[node].get(token)
                if child is None:
                    child = len(tokens)
                    children[node][token] = child
                    children.append({})
                    tokens.append(token)
                node = child
                path.append(node)
            paths.append(path)
        order, enter, leave, depth = _depth_first(children)
        laid = torch.tensor(order[1:], dtype=torch.long)  # trie node ids in layout order, the virtual root dropped
        index_of = torch.empty(len(tokens), dtype=torch.long)
        index_of[laid] = torch.arange(len(laid))
        return cls(
            token_ids=torch.tensor(tokens, dtype=torch.long)[laid],
            position_ids=torch.tensor(depth, dtype=torch.long)[laid] - 1,
            enter=torch.tensor(enter, dtype=torch.long)[laid] - 1,
            leave=torch.tensor(leave, dtype=torch.long)[laid] - 1,
            row_nodes=tuple(index_of[torch.tensor(path, dtype=torch.long)] for path in paths),
        )

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded (each shared token once)."""
        return int(self.token_ids.numel())

    @property
    def row_tokens(self) -> int:
        """Tokens the rows hold, as forwarded one by one."""
        return sum(int(nodes.numel()) for nodes in self.row_nodes)

    def on_path(self) -> torch.Tensor:
        """[nodes, nodes] bool: query q may attend to key k (k is q itself or one of its ancestors)."""
        q, k = self.enter[:, None], self.enter[None, :]
        return (k <= q) & (q < self.leave[None, :])

    def attention_mask(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The 4D mask a transformers model takes as given (`[1, 1, nodes, nodes]`): bool for sdpa (True attends),
        or additive in `dtype` (0 or the dtype's minimum) for eager attention."""
        allowed = self.on_path()[None, None]
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)

    def predicting_nodes(self, start: int = 1) -> torch.Tensor:
        """Per (row, position j >= start), row-major: the node whose hidden state predicts the row's token j
        (`start`: the first position scored, e.g. the prompt's length: only completion tokens)."""
        return torch.cat([nodes[start - 1 : -1] for nodes in self.row_nodes])

    def labels(self, start: int = 1) -> torch.Tensor:
        """The tokens `predicting_nodes(start)` predict, in the same order."""
        return torch.cat([self.token_ids[nodes[start:]] for nodes in self.row_nodes])


def _depth_first(children: list[dict[int, int]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Pre-order of the trie from node 0 (children in insertion order): the order, and per trie node its entry index,
    its subtree's end and its depth. Iterative: a long row is a deep chain."""
    count = len(children)
    enter, leave, depth, order = [0] * count, [0] * count, [0] * count, []
    stack = [(0, False)]
    while stack:
        node, done = stack.pop()
        if done:
            leave[node] = len(order)
            continue
        enter[node] = len(order)
        order.append(node)
        stack.append((node, True))
        for child in reversed(list(children[node].values())):
            depth[child] = depth[node] + 1
            stack.append((child, False))
    return order, enter, leave, depth


def tree_token_logprobs(model, tree: TreeRows, start: int = 1) -> torch.Tensor:
    """Each row's log-prob of each of its tokens from position `start` on (row-major, as `TreeRows.labels`), from
    one forward of the tree's tokens through a transformers causal LM (its backbone, then its head on the
    predicting nodes only)."""
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    eager = getattr(model.config, "_attn_implementation", "sdpa") == "eager"
    mask = tree.attention_mask(model.dtype if eager else None).to(model.device)
    hidden = backbone(
        input_ids=tree.token_ids[None].to(model.device),
        position_ids=tree.position_ids[None].to(model.device),
        attention_mask=mask,
        use_cache=False,
    ).last_hidden_state[0]
    picked = hidden.index_select(0, tree.predicting_nodes(start).to(hidden.device))  # backward sums shared nodes
    logits = model.get_output_embeddings()(picked).float()
    labels = tree.labels(start).to(logits.device)
    return torch.log_softmax(logits, dim=-1).gather(1, labels[:, None])[:, 0]
