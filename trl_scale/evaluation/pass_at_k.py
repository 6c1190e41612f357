"""pass@k from n samples per prompt: the chance that at least one of k samples drawn without replacement from the n
passes, averaged over prompts (the unbiased estimator of Chen et al., 2021, "Evaluating Large Language Models
Trained on Code"): 1 - C(n - c, k) / C(n, k) for a prompt with c of its n samples passing."""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, passed: int, k: int) -> float:
    """One prompt's pass@k: `passed` of its `n` samples pass."""
    if not 1 <= k <= n or not 0 <= passed <= n:
        raise ValueError(f"pass@{k} of {passed} passing out of {n} samples: needs 1 <= k <= n and 0 <= passed <= n")
    if n - passed < k:  # every draw of k holds a passing sample
        return 1.0
    return 1.0 - math.comb(n - passed, k) / math.comb(n, k)


def pass_rates(rewards: Sequence[float], group_size: int, ks: Sequence[int], threshold: float) -> dict[int, float]:
    """pass@k for each k over `rewards` (one per sample, `group_size` consecutive samples per prompt): a sample
    passes when its reward is at least `threshold`. NaN (the function does not score that sample) is not a pass; a
    prompt none of whose samples it scores is left out. Empty where no prompt is scored."""
    if len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group_size}")
    groups = [rewards[start : start + group_size] for start in range(0, len(rewards), group_size)]
    scored = [group for group in groups if any(not math.isnan(value) for value in group)]
    if not scored:
        return {}
    passing = [sum(1 for value in group if value >= threshold) for group in scored]  # NaN >= x is False
    return {k: sum(pass_at_k(group_size, c, k) for c in passing) / len(scored) for k in ks}
