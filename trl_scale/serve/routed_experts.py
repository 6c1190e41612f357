"""The routes vLLM returns with `--enable-return-routed-experts` (vLLM 0.32, `entrypoints/openai/completion/
protocol.py:671-679`): per choice, `routed_experts`, the base64 of a `.npy` array `[tokens - 1 - start, layers,
top_k]` (uint8 up to 256 experts, else uint16): the experts each MoE layer's router chose for each token of the prompt
and completion from prompt token `start` (`routed_experts_prompt_start`) to the one before the last (the last sampled
token was never forwarded). Read here from the experts transformers' own router modules choose over the whole sequence
(one forward per choice, with the weights and adapter that generated it): this server's routes, not the trainer's
replay code."""

from __future__ import annotations

import numpy as np
import torch

from ..scoring.routing_replay import ROUTERS, encode_routes, routers_of


def check_routes_servable(model) -> None:
    """`--enable-return-routed-experts` on a model without a router this server reads is refused at start, as a
    setting nothing reads."""
    if not routers_of(model):
        family = type(model.config.get_text_config()).__name__
        raise ValueError(
            f"--enable-return-routed-experts: {family} has no mixture-of-experts router this server reads "
            f"({', '.join(sorted(ROUTERS))}): it has no routes to return. Fix: drop the flag"
        )


@torch.no_grad()
def routed_experts(model, sequences: list[list[int]], start: int) -> list[str]:
    """Each sequence's routes from token `start` to its second-to-last, encoded as vLLM sends them: the indices
    each router module returned (transformers' own choice: group-limited and bias-corrected where the family is)."""
    routers = routers_of(model)
    experts = max(int(router.num_experts) for router in routers)
    dtype = np.uint8 if experts <= 256 else np.uint16
    chosen: list[torch.Tensor] = []
    hooks = [router.register_forward_hook(lambda _, __, output: chosen.append(output[2])) for router in routers]
    encoded = []
    device = next(model.parameters()).device
    try:
        for sequence in sequences:
            chosen.clear()
            forwarded = torch.tensor([sequence[:-1]], device=device)
            model(input_ids=forwarded, use_cache=False)
            per_layer = [indices.reshape(forwarded.size(1), -1) for indices in chosen]  # in the layers' order
            routes = torch.stack(per_layer, dim=1)[start:].cpu().numpy().astype(dtype)  # [tokens - 1 - start, L, k]
            encoded.append(encode_routes(routes))
    finally:
        for hook in hooks:
            hook.remove()
    return encoded
