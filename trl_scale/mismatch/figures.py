"""Per-server mismatch figures from the tokens a server sampled: its log-probs of them against the policy's.

For each completion token t drawn by the server, d = log p_policy(t) - log p_sampler(t). A server that serves the
policy at the trainer's precision gives d = 0 up to float noise (measured on vLLM's CPU build, fp32: about 1e-6);
every other cause leaves its own shape:

- another model or revision: large on every token;
- another tokenizer or chat template: large from the first tokens (the server reads other tokens as the prompt);
- another dtype or a quantization: small and uniform (no heavy tail);
- a LoRA adapter not loaded: the figures against the policy's base model (its adapter off) are the small ones;
- weights a sync did not reach: the figures against an earlier checkpoint are (checked per step, `rollout/...`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# how many of a completion's first tokens show a tokenizer or template mismatch (the first tokens carry it most)
FIRST_TOKENS = 2


@dataclass(frozen=True)
class MismatchFigures:
    """One server's figures over the tokens it sampled (nats per token)."""

    server: str
    tokens: int
    mean_abs: float | None  # mean |d| (None: only sequence sums were measured, RLOO)
    p99_abs: float | None  # the 99th percentile of |d|
    kl: float  # the sampler-to-policy KL per token, estimated from the sampler's own draws: mean(e^d - 1 - d)
    past_cap: float  # the share of tokens (sequences, RLOO's correction) whose ratio lies outside its bounds
    first_tokens_abs: float | None  # mean |d| over each completion's first FIRST_TOKENS tokens
    base_kl: float | None = None  # the same KL against the policy's base model (a LoRA run's adapter off)

    def as_logs(self, prefix: str) -> dict[str, float]:
        """`prefix/<figure>` for a training log (`prefix` names the server)."""
        values = {k: v for k, v in asdict(self).items() if k not in ("server",) and v is not None}
        return {f"{prefix}/{name}": float(value) for name, value in values.items()}


def mismatch_figures(
    server: str,
    sampler: Sequence[Sequence[float]],
    policy: Sequence[Sequence[float]],
    clip_max: float | None = None,
    clip_min: float | None = None,
    base: Sequence[Sequence[float]] | None = None,
) -> MismatchFigures:
    """The figures of one server's completions: `sampler[i]` and `policy[i]` are completion i's per-token log-probs
    (the sampler's, the policy's of the same tokens; equal lengths). `clip_max`/`clip_min`: the run's correction
    bounds on the per-token ratio (None: unbounded there). `base`: the policy's base model's log-probs (LoRA)."""
    diffs = [p - s for sampled, scored in zip(sampler, policy, strict=True) for s, p in _paired(sampled, scored)]
    if not diffs:
        raise ValueError(f"{server}: no sampled tokens to measure the mismatch on")
    absolute = sorted(abs(d) for d in diffs)
    first = [
        abs(p - s) for sampled, scored in zip(sampler, policy) for s, p in _paired(sampled, scored)[:FIRST_TOKENS]
    ]
    outside = _outside_bounds(diffs, clip_max, clip_min)
    base_kl = None
    if base is not None:
        base_diffs = [
            b - s for sampled, scored in zip(sampler, base, strict=True) for s, b in _paired(sampled, scored)
        ]
        base_kl = _k3_sum(base_diffs) / len(base_diffs)
    return MismatchFigures(
        server=server,
        tokens=len(diffs),
        mean_abs=sum(absolute) / len(absolute),
        p99_abs=absolute[min(len(absolute) - 1, math.ceil(0.99 * len(absolute)) - 1)],
        kl=_k3_sum(diffs) / len(diffs),
        past_cap=outside / len(diffs),
        first_tokens_abs=sum(first) / len(first),
        base_kl=base_kl,
    )


def sequence_mismatch_figures(
    server: str,
    sampler: Sequence[float],
    policy: Sequence[float],
    lengths: Sequence[int],
    clip_max: float | None = None,
    clip_min: float | None = None,
) -> MismatchFigures:
    """The figures where only each completion's summed log-probs are at hand (RLOO keeps the sequence's old log-prob):
    D = log p_policy(y) - log p_sampler(y) per completion. A sequence's KL is the sum of its tokens' (the chain rule),
    so sum(e^D - 1 - D) / tokens estimates the same KL per token as the per-token figure, from the sampler's draws,
    with more variance; the per-token shapes (mean, P99, first tokens) are not measured (None). `past_cap`: the share
    of completions whose ratio e^D lies outside RLOO's sequence-level correction bounds."""
    diffs = [p - s for s, p in zip(sampler, policy, strict=True)]
    tokens = sum(lengths)
    if not diffs or tokens == 0:
        raise ValueError(f"{server}: no sampled tokens to measure the mismatch on")
    outside = _outside_bounds(diffs, clip_max, clip_min)
    return MismatchFigures(server, tokens, None, None, _k3_sum(diffs) / tokens, outside / len(diffs), None)


def _paired(sampled: Sequence[float], scored: Sequence[float]) -> list[tuple[float, float]]:
    if len(sampled) != len(scored):
        raise ValueError(f"a completion's sampler log-probs ({len(sampled)}) and policy's ({len(scored)}) differ")
    return list(zip(sampled, scored))


def _k3_sum(diffs: list[float]) -> float:
    # k3 = e^d - 1 - d >= 0, unbiased for KL(sampler || policy) under the sampler's draws (per token, or per sequence
    # with d its sum); d is clamped so that one overflow cannot make the figure inf (it is then past any budget anyway)
    return sum(math.expm1(min(d, 50.0)) - d for d in diffs)


def _outside_bounds(diffs: list[float], clip_max: float | None, clip_min: float | None) -> int:
    """How many ratios e^d lie outside the correction's bounds (None: unbounded there)."""
    return sum(
        (clip_max is not None and math.exp(min(d, 700.0)) > clip_max)
        or (clip_min is not None and math.exp(d) < clip_min)
        for d in diffs
    )


def likely_cause(figures: MismatchFigures) -> str:
    """What a mismatch past its budget most likely is, told apart by its shape (see the module's docstring)."""
    if figures.base_kl is not None and figures.base_kl < figures.kl / 4:
        return "the LoRA adapter is not loaded on it (its tokens match the policy's base model, adapter off)"
    if figures.mean_abs is None:  # sequence sums only: the shapes below are not measured
        return "weights other than the policy's (another model or revision, a sync that did not reach it)"
    rest = figures.mean_abs
    if figures.first_tokens_abs > 4 * max(rest, 1e-6) and figures.first_tokens_abs > 0.5:
        return "another tokenizer or chat template (the mismatch is largest at the completions' first tokens)"
    if figures.mean_abs > 0.5:
        return "another model or revision than the policy (large on every token)"
    if figures.p99_abs < 6 * max(figures.mean_abs, 1e-9):
        return "another dtype or a quantization (small and uniform over the tokens)"
    return "weights other than the policy's (a sync that did not reach it, another checkpoint)"


def verdict(figures: MismatchFigures, budget: float) -> str | None:
    """None where the server is within `budget` (KL per token, nats); else one line naming the server, the figure,
    the budget and the likely cause."""
    if figures.kl <= budget:
        return None
    return (
        f"{figures.server}: its sampler is {figures.kl:.4g} nats/token (KL) from the policy, past "
        f"rollout_mismatch_budget={budget:g} ({_shape(figures)}, over {figures.tokens} tokens). Likely: "
        f"{likely_cause(figures)}"
    )


def _shape(figures: MismatchFigures) -> str:
    if figures.mean_abs is None:
        return f"{figures.past_cap:.0%} of completions past the correction's bounds"
    return (
        f"mean |d log p| {figures.mean_abs:.3g}, P99 {figures.p99_abs:.3g}, {figures.past_cap:.0%} of tokens past "
        "the correction's bounds"
    )


def format_figures(figures: list[MismatchFigures]) -> str:
    """The probe's table: one row per server."""
    header = f"{'server':<32} {'tokens':>6} {'KL/token':>10} {'mean |d|':>9} {'P99 |d|':>8} {'past cap':>8}"
    lines = [header]
    for f in figures:
        lines.append(
            f"{f.server:<32} {f.tokens:>6} {f.kl:>10.3g} {f.mean_abs:>9.3g} {f.p99_abs:>8.3g} {f.past_cap:>8.1%}"
        )
    return "\n".join(lines)
