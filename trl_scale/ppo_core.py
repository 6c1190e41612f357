"""PPO's per-token algebra, on padded ``[B, T]`` tensors with a mask (1 = real completion token).

Kept apart from the trainer so each piece is tested against a plain reference: KL estimators, the KL-shaped
per-token reward, GAE, whitening, and the clipped policy and value losses (as in TRL <= 1.12 and the
"Implementation Matters"/N+ implementation-details papers).
"""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, sum_across_ranks=None
) -> torch.Tensor:
    """Normalise to unit (unbiased) variance over the masked entries; zero-mean too when ``shift_mean``.
    ``sum_across_ranks`` (a sum all-reduce) takes the statistics over the whole data-parallel batch, so a run's
    advantages do not depend on how many processes share it."""

    def total(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.sum()
        return sum_across_ranks(tensor) if sum_across_ranks is not None else tensor

    mask = mask.to(values.dtype)
    count = total(mask)
    mean = total(values * mask) / count.clamp(min=1.0)
    centered = values - mean
    unbiased = count.clamp(min=2.0)
    variance = total(centered**2 * mask) / count.clamp(min=1.0) * unbiased / (unbiased - 1)
    whitened = centered * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens: k1 = log p - log q, k3 = (r - 1) - log r
    with r = q / p (unbiased and non-negative, Schulman's "Approximating KL divergence")."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator={estimator!r} is not supported; use 'k1' or 'k3'")


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the index of the last position where ``mask`` is 1 (a completion's last real token, also when tool
    results leave holes in the mask), and whether the row has one at all."""
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).amax(dim=1)
    return last.clamp(min=0), last >= 0


def ends_with(token_ids: torch.Tensor, mask: torch.Tensor, end_ids: list[int]) -> torch.Tensor:
    """Per row, whether the last real token (the last 1 of ``mask``) is one of ``end_ids``: an EOS inside a tool
    turn, or padding that reuses the EOS id, does not end a completion."""
    last, has_tokens = last_token_index(mask)
    final = token_ids.gather(1, last.unsqueeze(1)).squeeze(1)
    return has_tokens & torch.isin(final, torch.tensor(end_ids, device=token_ids.device))


def shaped_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * kl`` on every completion token, plus the sequence score on its last real
    token (the last 1 of ``mask``, not ``mask.sum() - 1``: tool-result holes come before it). Returns
    ``(rewards, non_score_rewards)``, zero where ``mask`` is 0."""
    mask = mask.to(kl.dtype)
    non_score = -kl_coef * kl * mask
    rewards = non_score.clone()
    last, has_tokens = last_token_index(mask)
    rows = torch.arange(rewards.size(0), device=rewards.device)
    rewards[rows[has_tokens], last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards, non_score


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over completion tokens; the value after the last real token is 0.

    Positions where ``mask`` is 0 inside a completion (tool results in a multi-turn rollout) are not steps of the
    policy: the recursion passes over them, carrying the next value and the running advantage across (as verl does),
    so the tokens before a tool call see the reward after it. Returns ``(advantages, returns)``; masked positions
    carry the running advantage and take no loss (every loss is masked)."""
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    last_gae = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * last_gae
        keep = mask[:, t]
        next_value = keep * values[:, t] + (1 - keep) * next_value
        last_gae = keep * step + (1 - keep) * last_gae
        advantages[:, t] = last_gae
    return advantages, (advantages + values) * mask


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * mean(max((v - R)^2, (clip(v, v_old +- c) - R)^2))`` over the mask, and the fraction clipped."""
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    clipfrac = masked_mean((clipped_loss > unclipped_loss).float(), mask)
    return loss, clipfrac


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange_low: float,
    cliprange_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token ``max(-A r, -A clip(r, 1 - c, 1 + c))`` (unreduced) and masked diagnostics."""
    cliprange_high = cliprange_low if cliprange_high is None else cliprange_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange_low, 1.0 + cliprange_high)
    per_token = torch.maximum(unclipped, clipped)
    stats = {
        "approxkl": 0.5 * masked_mean(log_ratio.detach() ** 2, mask),
        "clipfrac": masked_mean((clipped > unclipped).float().detach(), mask),
        "ratio": masked_mean(ratio.detach(), mask),
    }
    return per_token, stats
