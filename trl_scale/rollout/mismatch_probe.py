"""The mismatch probe's sampling: every server, alone (no routing, no failover), draws completions of the same
prompts with the run's sampling settings and returns its log-probs of the tokens it drew (the trainer then scores the
same tokens with the policy: `trainers/mismatch_gate.py`)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests

from ..errors import RolloutError
from .choices import sampler_logprobs

COMPLETIONS_PER_PROMPT = 2


def sample_each_server(client, prompts: list[list[int]], sampling: dict, model: str | None = None) -> dict:
    """Per server URL: for each prompt, `COMPLETIONS_PER_PROMPT` choices `(completion_ids, sampler_logprobs)` that
    server drew. `sampling`: the run's settings (`max_tokens`, temperature, ...), sent as each request's; `model`:
    the name to ask for (a LoRA adapter's), else the one each server serves. A server that answers with an error or
    sends no log-probs is a RolloutError naming it; one whose connection fails (a managed server restarting: the
    fleet's business) gets None, and is measured at the first step it draws tokens in."""

    def drawn(server) -> list[list[tuple[list[int], list[float]]]] | None:
        try:
            return _drawn(server)
        except requests.ConnectionError:  # (the model's name asked, or the completions)
            return None

    def _drawn(server) -> list[list[tuple[list[int], list[float]]]]:
        name = model or client.transport.model_name(server)
        payload = {  # every prompt in one request (vLLM answers prompt-major: prompt i's choices i*n .. i*n+n-1)
            **sampling,
            "prompt": [list(prompt) for prompt in prompts],
            "n": COMPLETIONS_PER_PROMPT,
            "model": name,
            "logprobs": 0,
            "return_token_ids": True,
            "seed": 0,
        }
        response = client.transport.completions(server, payload, client.generation_timeout)
        if response.status_code >= 400:
            failed = f"({response.status_code}): {response.text[:200]}"
            missing = model and response.status_code in (400, 404) and "does not exist" in response.text
            unserved = f" (it does not serve {name!r}: the LoRA adapter is not loaded there)" if missing else ""
            raise RolloutError(f"{server.url}: the mismatch probe's request failed{unserved} {failed}")
        choices = sorted(response.json()["choices"], key=lambda choice: choice.get("index", 0))
        if len(choices) != len(prompts) * COMPLETIONS_PER_PROMPT:
            raise RolloutError(f"{server.url}: answered {len(choices)} choices to the mismatch probe's request")
        pairs = [(list(choice["token_ids"]), sampler_logprobs(choice)) for choice in choices]
        if any(logprobs is None for _, logprobs in pairs):
            raise RolloutError(
                f"{server.url}: sent no log-prob for some sampled token (the mismatch probe needs them)"
            )
        n = COMPLETIONS_PER_PROMPT
        return [pairs[i * n : (i + 1) * n] for i in range(len(prompts))]

    servers = list(client.servers)
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        return dict(zip((server.url for server in servers), pool.map(drawn, servers)))
