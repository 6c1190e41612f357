"""Routing replay (R3, "Rollout Routing Replay", arXiv 2510.11370) on transformers' MoE blocks: each token's
experts, as the sampler chose them, taken by the trainer's routers in every forward of that token (old, reference,
policy); the router still computes its logits, and the gate's weights are computed from them over the replayed
experts as the family's router computes them over its own (`ROUTERS`), so the router keeps its gradient.

Routes are looked up by the sequence's tokens (`RouteBook`): a forward's rows are found whatever order, split or
chunk TRL scores them in. A top-level forward gets its rows' routes in its padded layout (a forward pre-hook on the
model); the packed engine lays them out as each micro-batch packs its tokens (`packed_layout`, from the micro-batch's
own index maps). A token with no route (a prompt's last one, a sequence no server sampled) keeps the router's own
choice. Each router also counts how often its own top-k set equals the replayed one (`Agreement`)."""

from __future__ import annotations

import base64
import io
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def _softmax_over_all(router, logits, chosen):
    """Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral: the softmax over every expert at the chosen ones, renormalized where the
    family normalizes its top-k (Mixtral always does)."""
    weights = F.softmax(logits.float(), dim=-1).gather(1, chosen)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _softmax_over_chosen(router, logits, chosen):
    """GraniteMoE: the softmax over the chosen experts' logits."""
    return F.softmax(logits.float().gather(1, chosen), dim=-1)


def _sigmoid_scaled(router, logits, chosen):
    """DeepSeek-V3: the sigmoid of the chosen experts' logits (the bias-corrected, group-limited choice is the
    sampler's), normalized where the family does, times its routed scaling factor."""
    weights = logits.float().sigmoid().gather(1, chosen)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# transformers 5's MoE routers, each returning (logits, weights, indices): class name -> the gate's weights over
# given experts, as its own forward computes them over the experts it chooses
ROUTERS = {
    "Qwen3MoeTopKRouter": _softmax_over_all,
    "Qwen2MoeTopKRouter": _softmax_over_all,
    "OlmoeTopKRouter": _softmax_over_all,
    "MixtralTopKRouter": _softmax_over_all,
    "GraniteMoeTopKRouter": _softmax_over_chosen,
    "DeepseekV3TopkRouter": _sigmoid_scaled,
}


def routers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers routing replay knows, in the order the layers run them."""
    return [module for module in model.modules() if type(module).__name__ in ROUTERS]


_active = threading.local()  # the replay of the forward running on this thread, and its current layout


def encode_routes(routes: np.ndarray) -> str:
    """vLLM's `numpy2base64` (`vllm/utils/serial_utils.py`): the array's `.npy` bytes, base64."""
    with io.BytesIO() as buffer:
        np.save(buffer, routes, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def decode_routes(text: str) -> np.ndarray:
    """A choice's `routed_experts` as vLLM documents decoding it: `np.load(io.BytesIO(base64.b64decode(s)))`."""
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def replay_active() -> bool:
    """A replaying forward runs on this thread (tree rows, which lay tokens out otherwise, step aside for it)."""
    return getattr(_active, "replay", None) is not None


@dataclass
class Agreement:
    """(token, layer) pairs whose replayed experts were compared with the router's own top-k, and how many matched
    (as sets)."""

    matched: int = 0
    compared: int = 0
    # training forwards' rows (grad on), and those whose sequence no server's routes cover (they keep their own)
    rows: int = 0
    rows_without_routes: int = 0

    @property
    def share(self) -> float | None:
        return self.matched / self.compared if self.compared else None


class RouteBook:
    """The sampler's routes by sequence: a sequence's token ids -> its routes `[tokens - 1 - start, layers, k]` from
    token `start` (vLLM's `routed_experts`). Holds the newest `capacity` sequences."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._routes: dict[tuple[int, ...], tuple[int, np.ndarray]] = {}

    def add(self, sequence: list[int], routes: np.ndarray, start: int = 0) -> None:
        if routes.ndim != 3 or routes.shape[0] != len(sequence) - 1 - start:
            raise ValueError(
                f"routes of shape {tuple(routes.shape)} for a sequence of {len(sequence)} tokens from token {start}: "
                f"expected [{len(sequence) - 1 - start}, layers, top_k] (vLLM's routed_experts)"
            )
        key = tuple(sequence)
        self._routes.pop(key, None)
        self._routes[key] = (start, routes)
        while len(self._routes) > self.capacity:
            self._routes.pop(next(iter(self._routes)))

    def __len__(self) -> int:
        return len(self._routes)

    def _longer(self, sequence: tuple[int, ...]) -> tuple[int, np.ndarray] | None:
        """The routes of a sequence the book holds only as the start of a longer one (TRL cut a conversation at
        max_completion_length): a token's route depends on the tokens up to it only, so the longer one's first
        rows are its. Scanned on a miss only."""
        n = len(sequence)
        for key, (start, known) in reversed(self._routes.items()):
            # the length and the last token first: a sequence the book does not hold (an evaluation's, the probe's)
            # scans it whole, and slicing every key would cost its length each
            if len(key) > n > start and key[n - 1] == sequence[-1] and key[:n] == sequence:
                return start, known[: n - start]
        return None

    def padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: int, k: int) -> torch.Tensor:
        """`[B, T, layers, k]` int64 routes at each row's real tokens (any padding), -1 where none is known."""
        routes = torch.full((*input_ids.shape, layers, k), -1, dtype=torch.long)
        ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
        for row in range(ids.size(0)):
            positions = mask[row].nonzero().squeeze(1)
            sequence = tuple(ids[row, positions].tolist())
            found = self._routes.get(sequence) or self._longer(sequence)
            if found is None:
                continue
            start, known = found
            if known.shape[1:] != (layers, k):
                raise ValueError(
                    f"the sampler's routes have {known.shape[1]} layers of top-{known.shape[2]}, the policy "
                    f"{layers} MoE layers of top-{k}: the server does not serve this model"
                )
            routes[row, positions[start : start + known.shape[0]]] = torch.from_numpy(known.astype(np.int64))
        return routes.to(input_ids.device)


class RouteReplay:
    """Installed on a model: while `book` knows a forward's sequences, its routers take their experts."""

    def __init__(self, model: torch.nn.Module, book: RouteBook):
        self.routers = routers_of(model)
        if not self.routers:
            families = ", ".join(sorted(ROUTERS))
            raise ValueError(
                f"routing_replay=True: {type(model).__name__} has no MoE router routing replay knows ({families}). "
                "Fix: routing_replay=False, or a model of those families"
            )
        self.book = book
        self.agreement = Agreement()
        self.k = int(self.routers[0].top_k)
        # (router, its input's fingerprint) -> the routes a training forward took, for its recomputation in backward
        self._for_recompute: dict[tuple, torch.Tensor] = {}
        self._handles = [model.register_forward_pre_hook(self._begin, with_kwargs=True)]
        self._handles.append(model.register_forward_hook(self._end))
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._replayed(layer)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _begin(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask")
        if input_ids is None or getattr(_active, "replay", None) is not None:
            return None  # embeddings only, or a nested call (PEFT's wrapper calls the model inside)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        routes = self.book.padded(input_ids, attention_mask, len(self.routers), self.k)
        _active.replay, _active.routes = self, routes.reshape(-1, len(self.routers), self.k)
        _active.with_grad = torch.is_grad_enabled()
        if _active.with_grad:  # a training forward: its rows counted; the last one's backward recomputed what it kept
            self.agreement.rows += routes.size(0)
            self.agreement.rows_without_routes += int((routes.reshape(routes.size(0), -1) < 0).all(dim=1).sum())
            self._for_recompute.clear()
        return None

    def _end(self, module, args, output):
        if getattr(_active, "replay", None) is self:
            _active.replay = _active.routes = None
        return output

    def _replayed(self, layer: int):
        def hook(router, args, output):
            if getattr(_active, "replay", None) is self:
                routes = _active.routes
                if routes.size(0) != output[2].size(0):
                    raise RuntimeError(
                        f"routing replay: a router saw {output[2].size(0)} tokens where the forward's layout has "
                        f"{routes.size(0)} (a forward whose token layout replay does not know: tree rows, sequence "
                        "parallelism)"
                    )
                replayed = routes[:, layer]
                if _active.with_grad:  # activation checkpointing recomputes this call in backward, outside the
                    # forward (reentrant checkpointing runs the forward itself without grad: the model's call decides)
                    self._for_recompute[(layer, _fingerprint(args[0]))] = replayed
                return self._take(router, output, replayed, count=True)
            if self._for_recompute:  # a checkpointed layer recomputed in backward: the routes its forward took
                replayed = self._for_recompute.pop((layer, _fingerprint(args[0])), None)
                if replayed is not None:
                    return self._take(router, output, replayed, count=False)
            return output

        return hook

    def _take(self, router, output, replayed: torch.Tensor, count: bool):
        logits, scores, indices = output
        known = replayed[:, 0] >= 0
        if not bool(known.any()):
            return output
        if count:
            own = indices[known].sort(dim=-1).values
            self.agreement.compared += int(known.sum())
            self.agreement.matched += int((own == replayed[known].sort(dim=-1).values).all(dim=-1).sum())
        chosen = torch.where(known[:, None], replayed, indices)
        weights = ROUTERS[type(router).__name__](router, logits, chosen)
        return logits, weights.to(scores.dtype), chosen


def _fingerprint(hidden: torch.Tensor) -> tuple:
    """A router call's input, recognised again when activation checkpointing recomputes it (bit for bit the same
    hidden states; another call's are not): its shape, sum and first value."""
    flat = hidden.detach().reshape(-1)
    return (tuple(hidden.shape), float(flat.double().sum()), float(flat[0]) if flat.numel() else 0.0)


@contextmanager
def packed_layout(micro_batch):
    """While a packed micro-batch runs (the engine), the active replay's routes laid out as it packs its tokens:
    `flat_index` (positions in the padded `[B*T]` layout) to `token_index` (positions in its `[R*W]` rows); its
    filler tokens keep their own routes."""
    replay = getattr(_active, "replay", None)
    if replay is None:
        yield
        return
    padded = _active.routes
    rows, width = micro_batch.input_ids.shape
    laid = torch.full((rows * width, *padded.shape[1:]), -1, dtype=padded.dtype, device=padded.device)
    laid[micro_batch.token_index.to(padded.device)] = padded[micro_batch.flat_index.to(padded.device)]
    _active.routes = laid
    try:
        yield
    finally:
        _active.routes = padded
