"""Chunked log-prob head: per-token log-probs (and entropy and TRL's other per-token statistics) from hidden
states, one token chunk at a time, recomputing each chunk's logits in backward. The ``[tokens, vocab]``
logits never exist; peak memory is about two ``[chunk, vocab]`` fp32 tiles plus the weight gradient.

On CUDA/XPU with Triton, :func:`chunked_logprobs` calls TRL's own kernel (``trl.kernels``), which folds tiles
in place. Elsewhere TRL's torch fallback keeps 8-9 tile-sized temporaries (at its default tile it needs more
memory than full logits on CPU), so we use :class:`ChunkedLogProbHead`. Both take the same arguments and
return the same 5-tuple, with TRL's logit transform: ``z = softcap(raw * logit_scale) / temperature``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

DEFAULT_LOGPROB_CHUNK_SIZE = 256  # tokens projected onto the vocabulary at once by the chunked head


def _logits(hidden, weight, bias, logit_scale, softcap, inv_t, compute_dtype, out, softcap_grad_out=None):
    """Transformed logits of one chunk, written into the reusable tile ``out`` ([n, V], accumulation dtype).

    Tiles are reused across chunks on purpose: a fresh 64 MiB tensor per chunk is a fresh mmap that page-faults
    all over again, which made the head 1.6x slower than it is with reuse."""
    if out.dtype == compute_dtype:
        torch.mm(hidden.to(compute_dtype), weight.to(compute_dtype).t(), out=out)
    else:
        out.copy_(torch.mm(hidden.to(compute_dtype), weight.to(compute_dtype).t()))
    z = out
    if bias is not None:
        z.add_(bias.to(z.dtype))
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    softcap_grad = None
    if softcap is not None:
        z.div_(softcap).tanh_()
        if softcap_grad_out is not None:
            softcap_grad = torch.mul(z, z, out=softcap_grad_out).neg_().add_(1.0)
        z.mul_(softcap)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z, softcap_grad


def through_head(grad_z, sl, hidden, weight, transform, softcap_grad, grad_hidden, grad_weight, grad_bias) -> None:
    """Carry one chunk's gradient with respect to its transformed logits ``z`` back through the transform
    (temperature, softcap, logit scale) and the projection, into the hidden rows ``sl`` and the accumulated weight
    and bias gradients (each None where not needed). ``transform``: ``(softcap, logit_scale, inv_t, compute_dtype)``,
    as a head's forward saved them."""
    _, logit_scale, inv_t, compute_dtype = transform
    if inv_t != 1.0:
        grad_z.mul_(inv_t)
    if softcap_grad is not None:
        grad_z.mul_(softcap_grad)
    if logit_scale != 1.0:
        grad_z.mul_(logit_scale)
    if grad_hidden is not None:
        grad_hidden[sl] = torch.mm(grad_z.to(compute_dtype), weight.to(compute_dtype)).to(hidden.dtype)
    if grad_weight is not None:
        grad_weight.addmm_(grad_z.t(), hidden[sl].to(grad_weight.dtype))
    if grad_bias is not None:
        grad_bias.add_(grad_z.sum(0))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) without an [n, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class ChunkedLogProbHead(torch.autograd.Function):
    """Same signature and outputs as TRL's ``ChunkedLogProbFunction``, except that ``chunk_size`` counts tokens
    (each chunk projects onto the whole vocabulary)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,
        targets: torch.Tensor,  # [N]
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ):
        ctx.set_materialize_grads(False)
        device = hidden.device
        compute_dtype = (
            torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        )
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        inv_t = 1.0 / temperature
        want = {name: name in outputs for name in OPTIONAL_OUTPUTS}
        f32 = dict(device=device, dtype=torch.float64 if compute_dtype == torch.float64 else torch.float32)
        logprobs = torch.empty(n_tokens, **f32)
        log_z = torch.empty(n_tokens, **f32)
        entropy = torch.empty(n_tokens, **f32) if want["entropy"] else None
        log_sum_sq = torch.empty(n_tokens, **f32) if want["log_sum_sq_probs"] else None
        mean_logits = torch.empty(n_tokens, **f32) if want["mean_logits"] else None
        is_top1 = torch.empty(n_tokens, device=device, dtype=torch.bool) if want["is_top1"] else None
        tile_rows = min(chunk_size, n_tokens)
        z_tile = torch.empty(tile_rows, vocab, **f32)
        e_tile = torch.empty(tile_rows, vocab, **f32) if (entropy is not None or log_sum_sq is not None) else None
        for start in range(0, n_tokens, chunk_size):
            sl = slice(start, min(start + chunk_size, n_tokens))
            n = sl.stop - sl.start
            t = targets[sl].unsqueeze(1)
            z, _ = _logits(
                hidden[sl], weight, bias, logit_scale, final_logit_softcapping, inv_t, compute_dtype, z_tile[:n]
            )
            target_z = z.gather(1, t).squeeze(1)
            if mean_logits is not None:
                mean_logits[sl] = z.sum(1) / vocab
            if is_top1 is not None:
                is_top1[sl] = z.argmax(1) == targets[sl]  # argmax takes the first maximum, as TRL does
            z_max = z.amax(1)
            z.sub_(z_max.unsqueeze(1))
            if entropy is None and log_sum_sq is None:
                sum_exp = z.exp_().sum(1)
            else:
                e = torch.exp(z, out=e_tile[:n])
                sum_exp = e.sum(1)
                if entropy is not None:
                    entropy[sl] = sum_exp.log() - _rowdot(e, z) / sum_exp
                if log_sum_sq is not None:
                    log_sum_sq[sl] = _rowdot(e, e).log() - 2 * sum_exp.log()
            log_z[sl] = z_max + sum_exp.log()
            logprobs[sl] = target_z - log_z[sl]
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if entropy is not None else log_z)
        ctx.args = (chunk_size, final_logit_softcapping, logit_scale, inv_t, compute_dtype)
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 9
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        # Under ZeRO-3 the head's weight is partitioned again after the forward: gather it for the recompute.
        with maybe_gather_lm_head_ctx(weight, bias):
            return ChunkedLogProbHead._backward(
                ctx, hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy
            )

    @staticmethod
    def _backward(ctx, hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy):
        chunk_size, softcap, logit_scale, inv_t, compute_dtype = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if need_w else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=acc_dtype) if need_b else None
        tile_rows, vocab = min(chunk_size, hidden.shape[0]), weight.shape[0]
        z_tile = torch.empty(tile_rows, vocab, device=hidden.device, dtype=acc_dtype)
        p_tile = torch.empty_like(z_tile)
        softcap_tile = torch.empty_like(z_tile) if softcap is not None else None
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, min(start + chunk_size, hidden.shape[0]))
            n = sl.stop - sl.start
            z, softcap_grad = _logits(
                hidden[sl],
                weight,
                bias,
                logit_scale,
                softcap,
                inv_t,
                compute_dtype,
                z_tile[:n],
                softcap_tile[:n] if softcap_tile is not None else None,
            )
            z.sub_(log_z[sl].unsqueeze(1))  # log p
            p = torch.exp(z, out=p_tile[:n])
            # dL/dz_j = g_lp * (1[j=t] - p_j) - g_H * p_j * (log p_j + H)
            g_lp = grad_logprobs[sl] if grad_logprobs is not None else torch.zeros_like(log_z[sl])
            if grad_entropy is not None:
                z.add_(entropy[sl].unsqueeze(1)).mul_(grad_entropy[sl].unsqueeze(1)).add_(g_lp.unsqueeze(1))
                grad_z = p.mul_(z).neg_()
            else:
                grad_z = p.mul_(g_lp.unsqueeze(1)).neg_()
            grad_z.scatter_add_(1, targets[sl].unsqueeze(1), g_lp.unsqueeze(1))
            through_head(grad_z, sl, hidden, weight, ctx.args[1:], softcap_grad, grad_hidden, grad_weight, grad_bias)
        grad_weight = grad_weight.to(weight.dtype) if need_w else None
        grad_bias = grad_bias.to(bias.dtype) if need_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
    outputs: tuple[str, ...] = (),
):
    """Per-token ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of ``targets`` under
    ``softcap(hidden @ weight.T + bias) / temperature``; fields not in ``outputs`` are None.

    ``chunk_size`` is the number of tokens projected at once on our path. On CUDA/XPU with Triton, TRL's kernel
    runs instead, with its own tiling.
    """
    if use_trl_kernel(hidden.device):
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils as trl_utils

        return ChunkedLogProbFunction.apply(
            hidden,
            weight,
            bias,
            targets,
            temperature,
            trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE,
            final_logit_softcapping,
            logit_scale,
            tuple(outputs),
        )
    return ChunkedLogProbHead.apply(
        hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, tuple(outputs)
    )


@contextmanager
def gathered_lm_head(lm_head: torch.nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``(weight, bias)`` of the LM head, whole, as TRL's fused head reads them: FSDP2 DTensors gathered with
    ``full_tensor()``, DeepSpeed ZeRO-3 partitions gathered for the duration of the block."""
    from torch.distributed.tensor import DTensor
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    weight, bias = lm_head.weight, lm_head.bias
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None else None
    with maybe_gather_lm_head_ctx(weight, bias):
        yield weight, bias


def use_trl_kernel(device: torch.device) -> bool:
    """TRL's Triton kernel serves on CUDA/XPU when Triton is importable; our recompute path elsewhere."""
    from trl.kernels.chunked_logprob import _use_triton

    return _use_triton(device)


def logit_transform_of(config) -> tuple[float | None, float]:
    """``(final_logit_softcapping, logit_scale)`` read from a model config the way TRL's fused head reads them."""
    text_config = config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return softcap, 1.0 if scale is None else scale
