"""Rollout-only modes on the same client (as slime offers): no training, no weight update.

- `rejection_sample`: n completions per prompt, scored by TRL-style reward functions; keep the best k per
  prompt (optionally only above a reward threshold) and return them as a dataset (prompt, completion, reward).
- `evaluate`: n completions per prompt, scored; returns mean/std reward, per-function means and pass@n.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from datasets import Dataset

from .client import RolloutClient, RolloutError


def check_servers_for(client: RolloutClient, tokenizer, timeout: float) -> None:
    """Before any generation: every server answers (a refused connection or a wrong URL at once, not after every
    request has failed over), and serves a model this tokenizer belongs to (its vocabulary and its encoding of a
    probe text). Raises RolloutError naming each problem and its fix."""
    from .preflight import RunNeeds, all_problems, check_tokenizer, check_vocabulary, inspect_all

    client.refused_is_definite = True  # running servers, not starting ones
    client.wait_until_ready(timeout)
    reports = inspect_all(client.transport.get_url, client.transport.post_url, [s.url for s in client.servers])
    problems, _ = all_problems(reports, RunNeeds())
    for report in (r for r in reports if r.reachable and not r.paused):  # a paused one would not answer
        problems += [p for p in (check_vocabulary(client.transport.complete_url, report, len(tokenizer)),) if p]
        problems += [p for p in (check_tokenizer(client.transport.prompt_ids_url, report, tokenizer),) if p]
    if problems:
        raise RolloutError("the rollout servers cannot serve this tokenizer:\n  - " + "\n  - ".join(problems))


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):  # conversational
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _score(dataset: Dataset, reward_funcs: list[Callable], tokenizer, client: RolloutClient, n: int, sampling):
    rows = list(dataset)
    prompt_ids = [_prompt_ids(tokenizer, row["prompt"]) for row in rows]
    results = client.generate(prompt_ids, n=n, **sampling)
    prompts, completions, completion_ids, columns = [], [], [], {}
    for row, choices in zip(rows, results):
        for choice in choices:
            text = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
            prompts.append(row["prompt"])
            completions.append([{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text)
            completion_ids.append(choice["token_ids"])
            for key, value in row.items():
                if key != "prompt":
                    columns.setdefault(key, []).append(value)
    per_func = {}
    for func in reward_funcs:
        name = getattr(func, "__name__", type(func).__name__)
        values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        per_func[name] = [math.nan if v is None else float(v) for v in values]
    total = [sum(values[i] for values in per_func.values()) for i in range(len(prompts))]
    return prompts, completions, per_func, total


def rejection_sample(
    client: RolloutClient,
    dataset: Dataset,
    reward_funcs: list[Callable],
    tokenizer,
    num_samples: int = 8,
    keep_top_k: int = 1,
    min_reward: float | None = None,
    **sampling,
) -> Dataset:
    """The best `keep_top_k` of `num_samples` completions per prompt, as (prompt, completion, reward) rows."""
    if keep_top_k < 1 or keep_top_k > num_samples:
        raise ValueError(f"keep_top_k={keep_top_k} must be between 1 and num_samples={num_samples}")
    prompts, completions, per_func, total = _score(dataset, reward_funcs, tokenizer, client, num_samples, sampling)
    kept = []
    for start in range(0, len(prompts), num_samples):
        group = range(start, start + num_samples)
        best = sorted(group, key=lambda i: -total[i] if not math.isnan(total[i]) else math.inf)[:keep_top_k]
        for i in best:
            if math.isnan(total[i]) or (min_reward is not None and total[i] < min_reward):
                continue
            row = {"prompt": prompts[i], "completion": completions[i], "reward": total[i]}
            row.update({f"reward/{name}": values[i] for name, values in per_func.items()})
            kept.append(row)
    return Dataset.from_list(kept)


def evaluate(
    client: RolloutClient,
    dataset: Dataset,
    reward_funcs: list[Callable],
    tokenizer,
    num_samples: int = 1,
    success_threshold: float = 1.0,
    **sampling,
) -> dict[str, float]:
    """Mean and std of the summed reward, per-function means, and pass@num_samples (a prompt passes when any of
    its samples reaches `success_threshold`)."""
    prompts, _, per_func, total = _score(dataset, reward_funcs, tokenizer, client, num_samples, sampling)
    valid = [t for t in total if not math.isnan(t)]
    mean = sum(valid) / max(1, len(valid))
    metrics = {
        "eval/reward": mean,
        "eval/reward_std": math.sqrt(sum((t - mean) ** 2 for t in valid) / max(1, len(valid))),
        "eval/num_completions": float(len(total)),
    }
    for name, values in per_func.items():
        finite = [v for v in values if not math.isnan(v)]
        metrics[f"eval/rewards/{name}"] = sum(finite) / max(1, len(finite))
    groups = [total[i : i + num_samples] for i in range(0, len(total), num_samples)]
    metrics[f"eval/pass@{num_samples}"] = sum(any(t >= success_threshold for t in g) for g in groups) / len(groups)
    return metrics
