"""Tree rows: rows that share a prefix (a group's prompt, a conversation's earlier turns, a DPO pair's prompt) folded
into one prefix trie, so that each shared token is forwarded once. The scoring engine forwards a call's rows this way
where :mod:`.tree_forward` says so.

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
    window = sliding_window_of(config)
    if window is not None and window < longest_row:
        return (
            f"{text.model_type} attends within a sliding window of {window} tokens, shorter than a row ({longest_row})"
        )
    return None


# The names configs give an attention window in tokens (GPT-Neo's `window_size`, Longformer's `attention_window`,
# most families' `sliding_window`; read from transformers 5.23's configs). Any other integer setting whose name holds
# "window" counts too (a window unknown here steps tree rows aside rather than being missed), except those that name
# something else: which layers slide (`sliding_window_pattern`, `max_window_layers`), counts of windows, vision
# windows and the on/off switch.
_WINDOW_NAMES = (
    "sliding_window", "sliding_window_size", "window_size", "attention_window", "attention_window_size",
    "keep_window_size", "local_attention_window_len",
)  # fmt: skip
_NOT_WINDOWS = (  # name prefixes, and "pattern" anywhere
    "max_window", "num_windows", "n_window", "window_block", "window_kernel", "window_positional", "window_size_per",
    "pretrained_window", "conv_window", "focal_window", "use_",
)  # fmt: skip


def sliding_window_of(config) -> int | None:
    """The model's narrowest attention window in tokens, or None where it attends to the whole row."""
    text = config.get_text_config()
    if not getattr(text, "use_sliding_window", True):
        return None
    names = set(_WINDOW_NAMES) | {
        k for k in vars(text) if "window" in k and "pattern" not in k and not k.lstrip("_").startswith(_NOT_WINDOWS)
    }
    windows = []
    for name in sorted(names):
        value = getattr(text, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        windows += [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return min(windows) if windows else None


@dataclass(frozen=True)
class TreeSegments:
    """The tree's tokens as attention segments, for kernels that take sequence boundaries (flash varlen, or sdpa one
    segment at a time): a segment is a run of tokens laid out one after the other along one path; its queries attend
    to its gathered keys (the path above it, then itself), causally aligned to the bottom right."""

    cu_seq_lens_q: torch.Tensor  # [segments + 1] int32: the segments' bounds in the layout
    cu_seq_lens_k: torch.Tensor  # [segments + 1] int32: their bounds in the gathered keys
    kv_index: torch.Tensor  # [gathered keys]: the layout index of each gathered key
    max_length_q: int
    max_length_k: int

    def to(self, device: torch.device) -> TreeSegments:
        return TreeSegments(
            self.cu_seq_lens_q.to(device),
            self.cu_seq_lens_k.to(device),
            self.kv_index.to(device),
            self.max_length_q,
            self.max_length_k,
        )


@dataclass(frozen=True)
class TreeRows:
    """Rows of token ids folded into a prefix trie (see the module's docstring)."""

    token_ids: torch.Tensor  # [nodes]: one token per node, depth-first
    position_ids: torch.Tensor  # [nodes]: each node's depth (its token's position in every row through it)
    enter: torch.Tensor  # [nodes]: depth-first entry index (= the node's own index)
    leave: torch.Tensor  # [nodes]: one past the last index of the node's subtree
    row_nodes: tuple[torch.Tensor, ...]  # per row: the node of each of its tokens
    segments: TreeSegments

    @classmethod
    def fold(cls, rows: list) -> TreeRows:
        """The trie of `rows` (lists or 1-D tensors of token ids; rows may be prefixes of each other or repeat)."""
        trie = PrefixTrie()
        for row in rows:
            trie.insert(row)
        return trie.laid_out()

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


class PrefixTrie:
    """A radix trie of rows (each edge a run of tokens), built row by row: `matched` says how many of a row's tokens
    are already in it (what adding the row would not cost), `insert` adds it, `laid_out` gives the `TreeRows`.
    Comparisons run on whole runs of tokens, not token by token: a group of G rows costs about 2G tensor
    comparisons, whatever its lengths."""

    def __init__(self) -> None:
        self.tokens: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)]  # per edge; edge 0: the root, empty
        self.children: list[dict[int, int]] = [{}]  # per edge: first token -> child edge, in insertion order
        self.rows: list[list[int]] = []
        self.num_tokens = 0  # unique tokens so far

    def _walk(self, row: torch.Tensor):
        """Along `row`: yields (edge, tokens of the edge matched, whether the whole edge matched), stopping where
        the row leaves the trie."""
        edge, position = 0, 0
        while position < len(row):
            child = self.children[edge].get(int(row[position]))
            if child is None:
                return
            run = self.tokens[child]
            length = min(len(run), len(row) - position)
            same = run[:length] == row[position : position + length]
            matched = length if bool(same.all()) else int((~same).nonzero()[0])
            yield child, matched, matched == len(run)
            if matched < len(run):
                return
            edge, position = child, position + matched

    def matched(self, row) -> int:
        """How many leading tokens of `row` the trie already holds."""
        return sum(matched for _, matched, _ in self._walk(torch.as_tensor(row, dtype=torch.long)))

    def insert(self, row) -> int:
        """Add `row`; returns the tokens it added."""
        row = torch.as_tensor(row, dtype=torch.long).cpu()
        edge, position = 0, 0
        for child, matched, whole in self._walk(row):
            position += matched
            edge = child
            if not whole:
                self._split(child, matched)
        if position < len(row):
            self.tokens.append(row[position:].clone())
            self.children.append({})
            self.children[edge][int(row[position])] = len(self.tokens) - 1
        added = len(row) - position
        self.num_tokens += added
        self.rows.append(row.tolist())
        return added

    def _split(self, edge: int, at: int) -> None:
        """Cut `edge` after `at` tokens: its tail becomes its only child (rows end on edge boundaries)."""
        run = self.tokens[edge]
        self.tokens.append(run[at:])
        self.children.append(self.children[edge])
        self.tokens[edge] = run[:at]
        self.children[edge] = {int(run[at]): len(self.tokens) - 1}

    def laid_out(self) -> TreeRows:
        """The trie depth-first: tokens, depths, subtree ends, each row's nodes, and the attention segments."""
        count = len(self.tokens)
        start, depth, leave = [0] * count, [0] * count, [0] * count
        path: list[list[int]] = [[] for _ in range(count)]  # per edge: the edges above it (root excluded)
        order, cursor, stack = [], 0, [(0, False)]
        while stack:  # iterative pre-order: a long row is a deep chain
            edge, done = stack.pop()
            if done:
                leave[edge] = cursor
                continue
            start[edge] = cursor
            cursor += len(self.tokens[edge])
            order.append(edge)
            stack.append((edge, True))
            for child in reversed(list(self.children[edge].values())):
                depth[child] = depth[edge] + len(self.tokens[edge])
                path[child] = [*path[edge], child] if edge else [child]
                stack.append((child, False))
        order = order[1:]  # the root holds no token
        token_ids = torch.cat([self.tokens[edge] for edge in order]) if order else torch.zeros(0, dtype=torch.long)
        lengths = torch.tensor([len(self.tokens[edge]) for edge in order], dtype=torch.long)
        first = torch.tensor([start[edge] for edge in order], dtype=torch.long)
        within = torch.arange(len(token_ids)) - torch.repeat_interleave(first, lengths)
        position_ids = torch.repeat_interleave(torch.tensor([depth[e] for e in order], dtype=torch.long), lengths)
        token_leave = torch.repeat_interleave(torch.tensor([leave[e] for e in order], dtype=torch.long), lengths)
        row_nodes = tuple(self._row_nodes(row, start) for row in self.rows)
        return TreeRows(
            token_ids=token_ids,
            position_ids=position_ids + within,
            enter=torch.arange(len(token_ids)),
            leave=token_leave,
            row_nodes=row_nodes,
            segments=self._segments(order, start, path),
        )

    def _row_nodes(self, row: list[int], start: list[int]) -> torch.Tensor:
        edge, position, spans = 0, 0, []
        while position < len(row):
            edge = self.children[edge][row[position]]
            length = len(self.tokens[edge])
            spans.append(torch.arange(start[edge], start[edge] + length))
            position += length
        return torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)

    def _segments(self, order: list[int], start: list[int], path: list[list[int]]) -> TreeSegments:
        """Runs of edges laid out one after the other, each the first child of the one before (a path); a segment's
        keys are the edges above its first one, then itself."""
        heads, queries, keys = [], [], []
        for edge in order:
            above = path[edge][:-1]
            continues = heads and above and above[-1] == heads[-1][-1] and start[edge] == queries[-1][1]
            if continues:
                heads[-1].append(edge)
                queries[-1][1] = start[edge] + len(self.tokens[edge])
            else:
                heads.append([edge])
                queries.append([start[edge], start[edge] + len(self.tokens[edge])])
                keys.append([(start[a], start[a] + len(self.tokens[a])) for a in above])
        kv_parts, k_lengths = [], []
        for (first, end), above in zip(queries, keys):
            spans = [torch.arange(a, b) for a, b in above] + [torch.arange(first, end)]
            kv_parts.append(torch.cat(spans))
            k_lengths.append(len(kv_parts[-1]))
        q_lengths = [end - first for first, end in queries]

        def bounds(lengths: list[int]) -> torch.Tensor:
            return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0).to(torch.int32)

        return TreeSegments(
            cu_seq_lens_q=bounds(q_lengths),
            cu_seq_lens_k=bounds(k_lengths),
            kv_index=torch.cat(kv_parts) if kv_parts else torch.zeros(0, dtype=torch.long),
            max_length_q=max(q_lengths, default=0),
            max_length_k=max(k_lengths, default=0),
        )


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
