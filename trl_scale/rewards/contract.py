"""The JSON a reward server speaks: OpenRLHF's remote reward contract by default, or a user's adapter.

OpenRLHF (`openrlhf/utils/agent.py`, the request at lines 322-356 and the answer read at 289-296, HEAD 3c3be62;
`openrlhf/cli/serve_rm.py` is its reference server; its flag is `--reward.remote_url`, formerly `--remote_rm_url`):
- request: `POST <url>` with `{"query": [prompt + response, as text], "prompts": [prompt text], "labels": [label]}`;
- answer: `{"rewards": [number], "scores": [number], "extra_logs": {name: [number] or number}}`; `rewards` is the
  reward, `scores` (optional, defaults to `rewards`) what OpenRLHF's dynamic filtering reads.
"""

from __future__ import annotations

import math
from typing import Protocol


class RewardServiceError(RuntimeError):
    """A reward service that cannot score: every server failed, or one answered what the contract does not allow.
    The message names the servers (or the server) and the cause."""


class RewardContract(Protocol):
    """How requests are written and answers read; `RemoteReward(adapter=...)` takes any object with these two."""

    def request(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        """The JSON body of one request scoring these rows."""

    def rewards(self, answer: dict, count: int) -> tuple[list[float | None], dict[str, float]]:
        """The `count` rewards in an answer (None: no reward for that row, NaN to TRL) and numbers to log; raises
        `ValueError` naming the field for an answer the contract does not allow."""


def _number(value, field: str, index: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field}[{index}] is {value!r}, not a number")
    return float(value)


class OpenRLHFContract:
    """OpenRLHF's remote reward request and answer (module docstring)."""

    def request(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        return {"query": list(queries), "prompts": list(prompts), "labels": list(labels)}

    def rewards(self, answer: dict, count: int) -> tuple[list[float | None], dict[str, float]]:
        if not isinstance(answer, dict) or "rewards" not in answer:
            keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise ValueError(f"the answer has no 'rewards' field (got {keys})")
        rewards = answer["rewards"]
        if not isinstance(rewards, list) or len(rewards) != count:
            size = len(rewards) if isinstance(rewards, list) else type(rewards).__name__
            raise ValueError(f"'rewards' holds {size} values for {count} rows")
        values = [_number(value, "rewards", i) for i, value in enumerate(rewards)]
        logs = {}
        extra = answer.get("extra_logs") or {}
        if isinstance(extra, dict):
            for name, value in extra.items():
                numbers = value if isinstance(value, list) else [value]
                numbers = [float(v) for v in numbers if isinstance(v, (int, float)) and not isinstance(v, bool)]
                if numbers and all(math.isfinite(v) for v in numbers):
                    logs[name] = sum(numbers) / len(numbers)
        return values, logs


def read_request(body) -> tuple[list[str], list[str], list]:
    """A server's side of the request: (queries, prompts, labels), checked; prompts and labels default to empty."""
    if not isinstance(body, dict) or not isinstance(body.get("query"), list):
        raise ValueError("the request needs a 'query' list (OpenRLHF's remote reward contract)")
    queries = body["query"]
    prompts = body.get("prompts") or [""] * len(queries)
    labels = body.get("labels") or [""] * len(queries)
    if not all(isinstance(q, str) for q in queries) or len(prompts) != len(queries) or len(labels) != len(queries):
        raise ValueError("'query' must be strings, with as many 'prompts' and 'labels'")
    return queries, prompts, labels
