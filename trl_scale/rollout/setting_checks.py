"""Checks of TRL's sampling fields, run by `RolloutArguments` at construction: each error names the field and the
fix. (The asynchronous settings check themselves: `settings.AsyncRollout`.)"""

from __future__ import annotations

from ..numbers import check_number, check_whole


def check_sampling(args) -> None:
    """TRL's sampling fields, in the ranges vLLM's SamplingParams and transformers' generate take: at
    construction, not as a server's 422 (or a generate error) at the first step."""
    check_number("temperature", args.temperature, fix="use a number > 0 (the trainer divides logits by it)")
    if args.temperature <= 0:
        raise ValueError(
            f"temperature={args.temperature}: the trainer scores log-probs of logits / temperature, so it must be "
            "> 0. Fix: a positive temperature (e.g. 1.0; near-greedy sampling: 0.01)"
        )
    check_number("top_p", args.top_p, fix="use a number in (0, 1]: 1.0 keeps every token")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"top_p={args.top_p}: use a number in (0, 1] (1.0 keeps every token, 0.9 the top 90 %)")
    check_whole("top_k", args.top_k, minimum=-1, fix="use a whole number: 0 (or -1) keeps every token, k >= 1")
    if args.min_p is not None:
        check_number("min_p", args.min_p, fix="use a number in [0, 1], or None")
        if not 0 <= args.min_p <= 1:
            raise ValueError(f"min_p={args.min_p}: use a number in [0, 1] (typical: 0.01-0.2), or None")
