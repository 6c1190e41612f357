"""Packed scoring on torch's own flash varlen kernel, for models that run ``sdpa`` on CUDA.

A packed row scored with sdpa needs a block-diagonal mask, and with an explicit mask sdpa cannot use its flash
kernel: it materialises ``[rows, 1, W, W]`` booleans and runs the slower masked kernel. torch (2.10 and later)
ships the flash kernel's variable-length form (``torch.nn.attention.varlen``), which takes the sequence boundaries
instead of a mask and spends nothing on other sequences or filler: what ``flash_attn`` gives, without installing it.

:func:`install_varlen_attention` switches such a model to the attention implementation :data:`VARLEN_SDPA`, which
*is* sdpa (same function, same mask) for every call except packed scoring forwards: those carry ``cu_seq_lens_q``
(the engine passes them, :func:`.packing.packed_forward_kwargs`) and are run as varlen. The switch is permanent on
the model, not a context, because activation checkpointing re-runs the layers during backward, outside any
context; the boundaries travel with the layer's saved kwargs. Only the mask is chosen by context
(:func:`varlen_forward`), since it is built once per model forward, before the layers run.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .tree_kernel import TREE_SEGMENTS_KWARG, tree_attention

VARLEN_SDPA = "trl_scale_sdpa_varlen"
# sdpa, except for tree-row forwards (:mod:`.tree_kernel`): where the varlen switch does not apply (CPU, fp32)
TREE_SDPA = "trl_scale_sdpa_tree"

_in_varlen_forward = contextvars.ContextVar("trl_scale_varlen_forward", default=False)


@contextmanager
def varlen_forward() -> Iterator[None]:
    """While a packed forward with varlen boundaries runs: the model builds no mask (the kernel needs none)."""
    token = _in_varlen_forward.set(True)
    try:
        yield
    finally:
        _in_varlen_forward.reset(token)


@functools.cache
def varlen_kernel() -> Callable | None:
    """torch's ``varlen_attn`` where this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


# (kernel, its keyword names), looked up once at registration: nothing to resolve inside a compiled layer.
_KERNEL: list[tuple[Callable, frozenset[str]]] = []


def _kernel_attention(
    query, key, value, cu_seq_lens: torch.Tensor, max_length: int, scale: float | None, keys: tuple | None = None
):
    """Causal attention of packed ``[N, heads, dim]`` tensors with torch's flash varlen kernel (`keys`: other key
    bounds and longest, for tree segments; causal is then bottom-right aligned). The keyword for causality and
    grouped-query heads changed across torch releases: read this torch's signature."""
    kernel, parameters = _KERNEL[0]
    options: dict = {"scale": scale}
    if "window_size" in parameters:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    if key.size(1) != query.size(1):
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:  # a release whose wrapper may not take fewer key/value heads: give it as many
            repeats = query.size(1) // key.size(1)
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    cu_seq_lens_k, max_length_k = keys or (cu_seq_lens, max_length)
    return kernel(query, key, value, cu_seq_lens, cu_seq_lens_k, max_length, max_length_k, **options)


def _flash_segments(query, key, value, cu_q, cu_k, max_q, max_k, scale):
    return _kernel_attention(query, key, value, cu_q, max_q, scale, keys=(cu_k, max_k))


def _segment_attention(query, key, value, cu_seq_lens: torch.Tensor, scale: float | None):
    """The same attention, one sequence at a time with sdpa: for inputs the flash kernel does not take (fp32, not
    CUDA). Exact, and slow only where the kernel would not run anyway."""
    repeats = query.size(1) // key.size(1)
    bounds = cu_seq_lens.tolist()
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = query[start:end].transpose(0, 1)
        k = key[start:end].transpose(0, 1).repeat_interleave(repeats, dim=0)
        v = value[start:end].transpose(0, 1).repeat_interleave(repeats, dim=0)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if outputs else query.new_zeros(query.shape)


def varlen_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, except for calls carrying ``cu_seq_lens_q``: those are one packed row of
    whole sequences (``[1, heads, N, dim]``), attended causally within each sequence; and calls carrying tree
    segments (:data:`.tree_kernel.TREE_SEGMENTS_KWARG`): tree rows, each token attending to its path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    segments = kwargs.get(TREE_SEGMENTS_KWARG)
    if cu_seq_lens is None and segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.size(0) != 1:
        raise ValueError(f"varlen attention takes one packed row, got a batch of {query.size(0)}")
    if kwargs.get("dropout", 0.0):
        raise ValueError("varlen attention runs without dropout (TRL disables it); set the model's dropout to 0")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, dim]
    scale = kwargs.get("scaling")
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and bool(_KERNEL)
    if segments is not None:
        out = tree_attention(q, k, v, segments, scale, _flash_segments if flash else None)
    elif flash:
        out = _kernel_attention(q, k, v, cu_seq_lens, int(kwargs["max_length_q"]), scale)
    else:
        out = _segment_attention(q, k, v, cu_seq_lens, scale)
    return out.unsqueeze(0), None  # [1, N, heads, dim], as transformers' attention functions return


def varlen_sdpa_mask(*args, **kwargs):
    """sdpa's mask, except inside a packed varlen forward, which needs none."""
    from transformers.masking_utils import sdpa_mask

    return None if _in_varlen_forward.get() else sdpa_mask(*args, **kwargs)


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    kernel = varlen_kernel()
    if kernel is not None:
        _KERNEL.append((kernel, frozenset(inspect.signature(kernel).parameters)))
    for name in (VARLEN_SDPA, TREE_SDPA):
        AttentionInterface.register(name, varlen_sdpa_attention)
        AttentionMaskInterface.register(name, varlen_sdpa_mask)


def varlen_unsupported(model) -> str | None:
    """Why :func:`install_varlen_attention` would leave this model as it is, or None where it can switch."""
    why_not = varlen_unsupported_config(model.config, next(model.parameters()).device)
    if why_not is None and not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return "its attention cannot be switched (no AttentionInterface)"
    return why_not


def varlen_unsupported_config(model_config, device: torch.device) -> str | None:
    """Why a model of this config on ``device`` keeps sdpa with its rows, or None where it can run varlen."""
    config = model_config.get_text_config()
    attention = getattr(model_config, "_attn_implementation", None)
    if attention != "sdpa":
        return f"attn_implementation={attention!r} (only sdpa is switched)"
    if device.type != "cuda":
        return "not on a CUDA device"
    if varlen_kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    layer_types = set(getattr(config, "layer_types", None) or [])
    if getattr(config, "sliding_window", None) and (
        getattr(config, "use_sliding_window", True) or "sliding_attention" in layer_types
    ):
        return "sliding-window attention"
    if layer_types - {"full_attention"}:
        return f"layer types {sorted(layer_types)}"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    return None


def install_varlen_attention(model) -> bool:
    """Switch an sdpa model on CUDA to :data:`VARLEN_SDPA` (see the module docstring). Returns whether it did."""
    if varlen_unsupported(model) is not None:
        return False
    _register()
    model.set_attn_implementation(VARLEN_SDPA)
    return True


def uninstall_varlen_attention(model) -> None:
    """Back to sdpa (e.g. when the packing probe finds the kernel inexact for this model)."""
    if getattr(model.config, "_attn_implementation", None) in (VARLEN_SDPA, TREE_SDPA):
        model.set_attn_implementation("sdpa")


def install_tree_attention(model) -> bool:
    """Let an sdpa model take tree-row forwards (:data:`TREE_SDPA`: sdpa for every other call; permanent on the
    model, as :func:`install_varlen_attention`, for activation checkpointing's re-run). A model already on
    :data:`VARLEN_SDPA` takes them as it is. Returns whether the model takes tree segments now."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention == VARLEN_SDPA:
        return True
    if attention != "sdpa" or not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return False
    _register()
    model.set_attn_implementation(TREE_SDPA)
    return True


def plain_attention(name: str | None) -> str | None:
    """The attention implementation a fresh copy of a model should load with: sdpa for trl-scale's own (they are
    registered in this process only, and installed by the scoring engine again where it applies)."""
    return "sdpa" if name in (VARLEN_SDPA, TREE_SDPA) else name
