"""The routes vLLM returns with `--enable-return-routed-experts` (vLLM 0.32, `entrypoints/openai/completion/
protocol.py:671-679`): per choice, `routed_experts`, the base64 of a `.npy` array `[tokens - 1 - start, layers,
top_k]` (uint8 up to 256 experts, else uint16): the experts each MoE layer's router chose for each token of the prompt
and completion from prompt token `start` (`routed_experts_prompt_start`) to the one before the last (the last sampled
token was never forwarded). Read here from transformers' own router logits over the whole sequence (one forward per
choice, with the weights and adapter that generated it): this server's routes, not the trainer's code."""

from __future__ import annotations

import numpy as np
import torch

from ..scoring.routing_replay import encode_routes


def top_k_of(config) -> int:
    text = config.get_text_config()
    return int(text.num_experts_per_tok)


def check_routes_servable(config) -> None:
    """`--enable-return-routed-experts` on a model with no router is refused at start, as a setting nothing reads."""
    text = config.get_text_config()
    if getattr(text, "num_experts_per_tok", None) is None:
        raise ValueError(
            f"--enable-return-routed-experts: {type(text).__name__} is not a mixture-of-experts model (no "
            "num_experts_per_tok): it has no routes to return. Fix: drop the flag"
        )


@torch.no_grad()
def routed_experts(model, sequences: list[list[int]], start: int) -> list[str]:
    """Each sequence's routes from token `start` to its second-to-last, encoded as vLLM sends them."""
    text = model.config.get_text_config()
    experts = int(getattr(text, "num_experts", None) or text.num_local_experts)
    dtype = np.uint8 if experts <= 256 else np.uint16
    k = top_k_of(model.config)
    encoded = []
    device = next(model.parameters()).device
    for sequence in sequences:
        forwarded = torch.tensor([sequence[:-1]], device=device)
        layers = model(input_ids=forwarded, output_router_logits=True, use_cache=False).router_logits
        # each layer's [tokens, experts]: the router's top-k (softmax keeps the order of the logits)
        chosen = [layer.reshape(forwarded.size(1), -1).float().topk(k, dim=-1).indices for layer in layers]
        routes = torch.stack(chosen, dim=1)[start:].cpu().numpy().astype(dtype)  # [tokens - 1 - start, layers, k]
        encoded.append(encode_routes(routes))
    return encoded
