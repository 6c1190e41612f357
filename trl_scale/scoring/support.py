"""Where packing is exact, and how to lay out a packed forward for a model's kernels.

Packing relies on the model building a block-diagonal causal mask from ``position_ids`` (sdpa, eager, flex) or
taking sequence boundaries (flash varlen, and the linear-attention / SSM layers of hybrids). Many families do
neither: OPT and Falcon ignore ``position_ids`` for their mask (a packed sequence attends to the one before it),
hybrids carry their recurrent state across sequences unless their kernels get ``seq_idx`` / ``cu_seq_lens`` (on
CPU transformers refuses those without the CUDA kernels). Rather than trust a list, :func:`packing_support` asks
the model itself, once: it packs three short sequences the way the engine would and checks that the middle one's
hidden states (a) equal that sequence run alone and (b) do not move when the sequence before it changes.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..logs import get_logger
from .packing import pack_padded_batch, packed_forward_kwargs
from .varlen import VARLEN_SDPA, varlen_forward

logger = get_logger(__name__)

# Model types whose layers carry state along the sequence (SSM, linear attention, short convolutions): their packed
# rows need `seq_idx` / `cu_seq_lens`, which only a single-row (varlen) layout can give.
_STATEFUL_MODEL_TYPES = {
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "mamba",
    "mamba2", "minimax", "nemotron_h", "plamo2", "qwen3_5", "qwen3_5_moe", "qwen3_next", "zamba", "zamba2",
}  # fmt: skip
_ATTENTION_LAYER_TYPES = {"attention", "full_attention", "sliding_attention", "chunked_attention"}

# Probe tolerances, relative to max(1, |hidden|). "alone" compares different shapes (rounding differs: loose in
# half precision); "leak" compares identical shapes whose only difference is the other sequence: an exact model
# gives identical numbers, so any change is a leak.
PROBE_TOLERANCES = {"full": {"alone": 1e-3, "leak": 1e-5}, "half": {"alone": 5e-2, "leak": 1e-3}}


@dataclass
class PackingSupport:
    """Whether a backbone packs exactly, and in which layout."""

    model_type: str
    varlen: bool  # one packed row per forward, with cu_seq_lens / seq_idx (flash kernels, stateful hybrids)
    one_row: bool = False  # one packed row per forward (varlen kernels, flex attention); else rows of the longest
    exact: bool | None = None  # None until probed
    reason: str = ""
    announced: bool = False  # the fallback warning was logged
    # A length-dependent RoPE (dynamic NTK, longrope) changes its frequencies with the longest position in a forward:
    # packing is exact only for forwards shorter than this (see `rope_length_limit`); None: no such RoPE.
    rope_length_limit: int | None = None
    long_forward_announced: bool = False
    mrope: bool = False  # positions along (time, height, width): packed rows take them as [4, rows, width]


def rope_length_limit(backbone: torch.nn.Module) -> int | None:
    """The forward length from which a length-dependent rotary embedding may change its frequencies, or None.

    transformers recomputes the frequencies of ``dynamic`` RoPE from the longest position of each forward once it
    reaches the model's context, and switches ``longrope`` to its long factors past
    ``original_max_position_embeddings``. A padded forward's longest position is its width, a packed one's is its
    longest sequence: the two agree only while both stay below that length (YaRN, linear and llama3 scaling are
    static and unaffected)."""
    limits = []
    for module in backbone.modules():
        rope_type = getattr(module, "rope_type", None)
        config = getattr(module, "config", None)
        if rope_type is None or config is None:
            continue
        per_layer = rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]
        for layer_type, kind in per_layer:
            if not isinstance(kind, str):
                continue
            if "dynamic" in kind:
                limits.append(int(getattr(module, "original_max_seq_len", config.max_position_embeddings)))
            elif kind == "longrope":
                parameters = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
                original = parameters.get("original_max_position_embeddings") or config.max_position_embeddings
                limits.append(int(original))
    return min(limits) if limits else None


def draws_random_numbers(model: torch.nn.Module, training: bool | None = None) -> bool:
    """Whether a forward of `model` draws from the generator (dropout in training mode; `training` overrides the
    model's own mode, to ask before training starts). A shared forward then draws differently from a forward per
    row: one prefill for a group shifts the sampler's draws; one tree node for its rows drops out alike in all."""
    if not (model.training if training is None else training):
        return False
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        # Llama-style attention keeps its dropout as a float (TRL's disable_dropout leaves it: it sets modules' p)
        rate = getattr(module, "attention_dropout", 0.0)
        if isinstance(rate, float) and rate > 0:
            return True
    return False


def is_stateful(config) -> bool:
    """Whether the model has layers that carry state along the sequence (SSM, linear attention, convolutions)."""
    text_config = config.get_text_config()
    if text_config.model_type in _STATEFUL_MODEL_TYPES:
        return True
    layer_types = getattr(text_config, "layer_types", None) or []
    return any(t not in _ATTENTION_LAYER_TYPES for t in layer_types)


def uses_varlen_layout(config) -> bool:
    """Flash kernels (flash_attn's, or torch's own behind :data:`.varlen.VARLEN_SDPA`) take a whole packed row at
    O(sum L_i^2); stateful layers need the boundaries only a single row can carry. Dense kernels (sdpa, eager) get
    rows no wider than the longest sequence instead."""
    attn = str(getattr(config, "_attn_implementation", None) or "")
    return "flash" in attn or attn == VARLEN_SDPA or is_stateful(config)


def uses_one_row(config) -> bool:
    """Whether a packed micro-batch is one row: varlen kernels, and flex attention, whose block mask skips the
    blocks between sequences of one row (rows as wide as the longest sequence would add filler: 12 % of the tokens
    of the GPU benchmark's long-tailed batch)."""
    attn = str(getattr(config, "_attn_implementation", None) or "")
    return uses_varlen_layout(config) or attn == "flex_attention"


def packing_support(backbone: torch.nn.Module, probe: bool = True) -> PackingSupport:
    """The backbone's :class:`PackingSupport`, probed once and cached on the module. With ``probe=False``, or while
    its parameters are not materialised (DeepSpeed ZeRO-3 partitions them until its forward hooks gather them), the
    probe waits for the first call made with materialised weights."""
    support = getattr(backbone, "_trl_scale_packing_support", None)
    if support is None:
        config = backbone.config
        support = PackingSupport(
            model_type=config.get_text_config().model_type,
            varlen=uses_varlen_layout(config),
            one_row=uses_one_row(config),
            rope_length_limit=rope_length_limit(backbone),
            mrope=takes_mrope(backbone),
        )
        backbone._trl_scale_packing_support = support
    if support.exact is None and probe and _materialised(backbone):
        support.exact, support.reason = probe_packing(backbone, support.varlen, support.one_row, support.mrope)
    return support


def _materialised(backbone: torch.nn.Module) -> bool:
    return all(p.numel() > 0 and not hasattr(p, "ds_id") for p in backbone.parameters())


def takes_mrope(backbone: torch.nn.Module) -> bool:
    """Whether the backbone's text positions run along (time, height, width), computed per image grid
    (`get_rope_index`: Qwen2-VL and its kin)."""
    return callable(getattr(backbone, "get_rope_index", None))


def probe_packing(
    backbone: torch.nn.Module, varlen: bool, one_row: bool | None = None, mrope: bool = False
) -> tuple[bool, str]:
    """Pack sequences A, B, C the way the engine would (B right after A in one row) and compare B's hidden states
    with B run alone and with B after a different A. Returns ``(exact, reason)``."""
    config = backbone.config.get_text_config()
    device = next(backbone.parameters()).device
    one_row = varlen if one_row is None else one_row
    generator = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    a, other_a = torch.randint(0, vocab, (2, 6), generator=generator)
    b, c = torch.randint(0, vocab, (5,), generator=generator), torch.randint(0, vocab, (4,), generator=generator)

    def packed_hidden_of_b(first: torch.Tensor) -> torch.Tensor:
        input_ids = torch.zeros(3, 6, dtype=torch.long)
        mask = torch.zeros(3, 6, dtype=torch.long)
        for row, seq in enumerate((first, b, c)):
            input_ids[row, : len(seq)], mask[row, : len(seq)] = seq, 1
        # Dense layout: rows of 11 tokens hold A+B, then C and filler (both mechanisms probed at once).
        (micro_batch,) = pack_padded_batch(
            input_ids.to(device), mask.to(device), row_capacity=None if one_row else 11
        ).micro_batches
        with varlen_forward() if varlen else nullcontext():
            hidden = backbone(**packed_forward_kwargs(micro_batch, varlen, mrope)).last_hidden_state
        scattered = hidden.new_zeros(3 * 6, hidden.size(-1))
        scattered[micro_batch.flat_index] = micro_batch.real_tokens(hidden)
        return scattered.view(3, 6, -1)[1, : len(b)].float()

    was_training = backbone.training
    backbone.eval()  # dropout would make every comparison differ
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            alone_out = backbone(input_ids=b[None].to(device), use_cache=False).last_hidden_state
            alone = alone_out[0].float()
            packed = packed_hidden_of_b(a)
            packed_after_other = packed_hidden_of_b(other_a)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        return False, f"its packed forward fails ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
    finally:
        backbone.train(was_training)
    tolerance = PROBE_TOLERANCES["full" if alone_out.dtype in (torch.float32, torch.float64) else "half"]
    scale = max(1.0, alone.abs().max().item())
    leak = (packed - packed_after_other).abs().max().item() / scale
    if leak > tolerance["leak"]:
        return False, f"a packed sequence sees the one before it (hidden states move by {leak:.1e})"
    error = (packed - alone).abs().max().item() / scale
    if error > tolerance["alone"]:
        return False, f"a packed sequence differs from the same sequence alone by {error:.1e} (positions ignored?)"
    return True, ""


def use_packing(
    backbone: torch.nn.Module, padding_free: bool | None, probe_now: bool = False, width: int | None = None
) -> bool:
    """Whether to pack this backbone's forwards: never with ``padding_free=False``; with ``None`` (the default)
    where the probe finds packing exact, else TRL's padded path with one warning; with ``True`` the same, but an
    inexact model is an error.

    At construction (``probe_now=False``) a model whose weights are not materialised stays undecided (True); the
    first scoring call decides with ``probe_now=True``, inside the forward where ZeRO-3 gathers the weights (every
    rank makes that call, so the probe's forwards match across ranks).

    ``width`` is the padded batch's width at a scoring call. With a length-dependent RoPE
    (:func:`rope_length_limit`), a call whose width (the widest on any rank) reaches the limit takes TRL's padded
    path, so its numbers stay TRL's; shorter calls pack."""
    if padding_free is False:
        return False
    support = packing_support(backbone)
    if support.exact is None:
        if not probe_now:
            return True
        support.exact, support.reason = probe_packing(backbone, support.varlen, support.one_row, support.mrope)
    if support.exact and support.rope_length_limit is not None and width is not None:
        return _below_rope_limit(support, width, next(backbone.parameters()).device)
    if support.exact:
        return True
    if padding_free:
        raise ValueError(
            f"padding_free=True, but packed scoring is not exact for model type '{support.model_type}': "
            f"{support.reason}. Fix: set padding_free=None (packs where exact, else TRL's padded path) or "
            "padding_free=False."
        )
    if not support.announced:
        logger.warning(
            f"trl-scale: packed scoring is not exact for model type '{support.model_type}' ({support.reason}); "
            "this model is scored with TRL's padded path (padding_free=None). Set padding_free=False to silence this."
        )
        support.announced = True
    return False


def _below_rope_limit(support: PackingSupport, width: int, device: torch.device) -> bool:
    """Whether a call of this width packs exactly under a length-dependent RoPE. Every rank decides on the widest
    call of any rank, so all take the same path (sharded parameters are gathered per forward, collectively)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tensor = torch.tensor([width], device=device if dist.get_backend() == "nccl" else torch.device("cpu"))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        width = int(tensor.item())
    if width < support.rope_length_limit:
        return True
    if not support.long_forward_announced:
        logger.warning(
            f"trl-scale: model type '{support.model_type}' has a length-dependent RoPE (dynamic NTK or longrope) "
            f"whose frequencies change from {support.rope_length_limit} positions on; forwards that long are scored "
            "with TRL's padded path (packing would give each sequence different frequencies), shorter ones packed."
        )
        support.long_forward_announced = True
    return False
