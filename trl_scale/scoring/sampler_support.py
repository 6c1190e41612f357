"""Log-probs on the sampler's support: what a vLLM server reports under top-k / top-p / min-p.

vLLM's `processed_logprobs` are renormalised over the tokens that survive its truncation (temperature, then min-p,
then top-k, then top-p: `vllm/v1/sample/sampler.py` and `ops/topk_topp_sampler.py`), while TRL scores the whole
vocabulary. Every sampled token's importance ratio then carries the kept mass ``S`` (about 0.9 at top_p=0.9)
instead of 1 for an unchanged policy (huggingface/trl#6789). Scoring the trainer on the same support, with the
same rule applied to its own logits, gives ``log p_K(t) = log p(t) - log S``: :func:`kept_log_mass` computes
``log S`` per token, chunked like the head, with its gradient (the policy trained is the one that samples).

The sampled token is always counted in the support: with unchanged weights it is in it (the sampler drew it from
there), and after an update that pushed it out its log-prob stays finite instead of becoming ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprob_head import DEFAULT_LOGPROB_CHUNK_SIZE, _logits, through_head


@dataclass(frozen=True)
class SamplerSupport:
    """The truncation a server samples with (vLLM's conventions: ``top_k`` 0 or -1 and ``top_p`` 1 are off)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_sampling(cls, top_k: int | None, top_p: float | None, min_p: float | None) -> SamplerSupport:
        return cls(top_k=max(0, top_k or 0), top_p=1.0 if top_p is None else top_p, min_p=min_p or 0.0)

    @classmethod
    def from_config(cls, args) -> SamplerSupport | None:
        """The truncation an online trainer's vLLM samples with (its fields, then `generation_kwargs`, as the
        request is built), where it truncates; None otherwise. The caller asks only where the sampler's log-probs
        feed an importance-sampling correction and `logprobs_on_sampler_support` is on (the run plan decides it:
        `ScoringPlan`). Refuses what changes the support in a way the trainer cannot repeat from its own logits
        (penalties that depend on the text so far, logit biases)."""
        sampling = {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
        sampling.update({k: v for k, v in (args.generation_kwargs or {}).items() if k in sampling})
        support = cls.from_sampling(sampling["top_k"], sampling["top_p"], sampling["min_p"])
        if not support.truncates:
            return None
        extra = dict(args.generation_kwargs or {}, repetition_penalty=args.repetition_penalty)
        unrepeatable = [
            name
            for name, neutral in _NEUTRAL_LOGIT_CHANGES.items()
            if extra.get(name) not in (None, neutral) and extra.get(name) != {}
        ]
        if unrepeatable:
            raise ValueError(
                f"top_k/top_p/min_p truncate the sampler's distribution after {unrepeatable} changed its logits, "
                "which the trainer cannot repeat from its own logits: the importance ratios would be biased. Fix: "
                f"drop {unrepeatable} (repetition_penalty=1.0), sample without truncation, or set "
                "logprobs_on_sampler_support=False (ratios then carry the kept mass, as in TRL)"
            )
        return support


# vLLM sampling fields that change the logits before truncation, with their neutral values.
_NEUTRAL_LOGIT_CHANGES = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
}


def kept_tokens(z: torch.Tensor, support: SamplerSupport, targets: torch.Tensor) -> torch.Tensor:
    """``[n, V]`` bool: the tokens vLLM's sampler keeps for logits ``z`` (temperature already applied), plus each
    row's target. vLLM's order and comparisons: min-p on the probabilities (``p >= min_p * max p``), then top-k
    (logits ``>=`` the k-th largest), then top-p on what is left (ascending sort, cumulative probability ``<= 1 - p``
    dropped, the most likely token always kept)."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if support.min_p > 0.0:
        probs = z.softmax(1)
        keep &= probs >= probs.amax(1, keepdim=True) * support.min_p
    masked = z.masked_fill(~keep, float("-inf"))
    if 0 < support.top_k < z.size(1):
        kth = masked.topk(support.top_k, dim=1).values[:, -1:]
        keep &= masked >= kth
        masked = masked.masked_fill(~keep, float("-inf"))
    if support.top_p < 1.0:
        ascending, order = masked.sort(dim=1)
        cumulative = ascending.softmax(1).cumsum_(1)
        dropped = cumulative <= 1.0 - support.top_p
        dropped[:, -1] = False
        keep &= ~torch.zeros_like(keep).scatter_(1, order, dropped)
    keep.scatter_(1, targets.unsqueeze(1), True)
    return keep


class KeptLogMass(torch.autograd.Function):
    """Per-token ``log S = logsumexp(z over the kept tokens) - logsumexp(z)`` under the head's logit transform,
    one token chunk at a time, recomputing each chunk's logits in backward (``d log S / dz = p_K - p``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, support):
        device = hidden.device
        compute_dtype = (
            torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        )
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
        inv_t = 1.0 / temperature
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        log_z = torch.empty(n_tokens, device=device, dtype=acc)
        log_z_kept = torch.empty_like(log_z)
        tile = torch.empty(min(chunk_size, n_tokens), vocab, device=device, dtype=acc)
        for start in range(0, n_tokens, chunk_size):
            sl = slice(start, min(start + chunk_size, n_tokens))
            chunk_tile = tile[: sl.stop - start]
            z, _ = _logits(hidden[sl], weight, bias, logit_scale, softcap, inv_t, compute_dtype, chunk_tile)
            log_z[sl] = z.logsumexp(1)
            log_z_kept[sl] = z.masked_fill(~kept_tokens(z, support, targets[sl]), float("-inf")).logsumexp(1)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z_kept)
        ctx.args = (chunk_size, softcap, logit_scale, inv_t, compute_dtype, support)
        return log_z_kept - log_z

    @staticmethod
    def backward(ctx, grad_mass):
        hidden, weight, bias, targets, log_z, log_z_kept = ctx.saved_tensors
        chunk_size, softcap, logit_scale, inv_t, compute_dtype, support = ctx.args
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        acc = log_z.dtype
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=acc) if need_w else None
        grad_bias = torch.zeros(bias.shape, device=bias.device, dtype=acc) if need_b else None
        tile = torch.empty(min(chunk_size, hidden.shape[0]), weight.shape[0], device=hidden.device, dtype=acc)
        softcap_tile = torch.empty_like(tile) if softcap is not None else None
        with maybe_gather_lm_head_ctx(weight, bias):
            for start in range(0, hidden.shape[0], chunk_size):
                sl = slice(start, min(start + chunk_size, hidden.shape[0]))
                n = sl.stop - start
                z, softcap_grad = _logits(
                    hidden[sl],
                    weight,
                    bias,
                    logit_scale,
                    softcap,
                    inv_t,
                    compute_dtype,
                    tile[:n],
                    softcap_tile[:n] if softcap_tile is not None else None,
                )
                keep = kept_tokens(z, support, targets[sl])
                p_kept = (z - log_z_kept[sl].unsqueeze(1)).exp_().mul_(keep)
                grad_z = p_kept.sub_(z.sub_(log_z[sl].unsqueeze(1)).exp_()).mul_(grad_mass[sl].unsqueeze(1))
                transform = (softcap, logit_scale, inv_t, compute_dtype)
                through_head(grad_z, sl, hidden, weight, transform, softcap_grad, grad_hidden, grad_weight, grad_bias)
        grad_weight = grad_weight.to(weight.dtype) if need_w else None
        grad_bias = grad_bias.to(bias.dtype) if need_b else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def kept_log_mass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    support: SamplerSupport,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_LOGPROB_CHUNK_SIZE,
    final_logit_softcapping: float | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """``[N]`` log of the probability mass the sampler keeps at each token's position (0 where nothing is cut)."""
    return KeptLogMass.apply(
        hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, support
    )
