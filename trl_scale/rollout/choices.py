"""What a server's completion choices carry, read for the trainer: each choice's sampled tokens' log-probs, its
expert routes (vLLM's `routed_experts`), and TRL's `VLLMGeneration.generate` return built from them."""

from __future__ import annotations


def sampled_routes(choices: list[dict]) -> tuple:
    """Each choice's prompt and completion ids with the routes its server chose for them (vLLM's `routed_experts`,
    from prompt token 0), or None where it sent none; () where no choice carries routes."""
    if not any(choice.get("routed_experts") for choice in choices):
        return ()
    from ..scoring.routing_replay import decode_routes

    routes = []
    for choice in choices:
        encoded, prompt = choice.get("routed_experts"), choice.get("prompt_token_ids")
        if not encoded or prompt is None:
            routes.append(None)
            continue
        routes.append((tuple(prompt) + tuple(choice["token_ids"]), decode_routes(encoded)))
    return tuple(routes)


def sampler_logprobs(choice: dict) -> list[float] | None:
    """The sampled tokens' log-probs of one vLLM choice, one per completion token, or None where the server sent
    none (or not one per token)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) != len(choice["token_ids"]) or any(v is None for v in values):
        return None
    return [float(v) for v in values]


def generate_output(prompts, choices: list[dict], completion_ids: list[list[int]], logprobs: list[list[float]]):
    """TRL's `VLLMGeneration.generate` return for `choices` (their `turn_outputs`): prompt ids, completion ids, and
    per-token log-probs and token ids, each token's a one-entry list as vLLM's `logprobs=0` gives them."""
    return (
        [list(p) for p in prompts],
        completion_ids,
        [[[v] for v in row] for row in logprobs],
        [[[t] for t in choice["token_ids"]] for choice in choices],
    )
