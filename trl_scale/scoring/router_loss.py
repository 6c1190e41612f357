"""An MoE policy's router load-balancing loss on packed rows, as TRL's fused forward computes it on padded ones.

TRL 1.16 asks a scoring call for the router's logits when the policy's config asks for them (`output_router_logits`)
or when its loss adds the router term (`compute_aux_loss`), and computes the loss with transformers' (Mixtral's)
`load_balancing_loss_func` over the call's real tokens (the attention mask leaves the padding out), adding
`router_aux_loss_coef` times it to the output's loss (`trl/trainer/utils.py`, `_fused_forward`). Packed rows hold the
same real tokens and filler: the engine takes each layer's logits at the real tokens only, so the function, without
a mask, averages over the same tokens (the sums in another order: equal to float rounding).
"""

from __future__ import annotations

import dataclasses

import torch
import transformers
from packaging.version import Version


def asks_router_logits(config, kwargs: dict) -> bool:
    """Whether this scoring call asks for the router's logits: its own `output_router_logits`, else the text
    config's (as TRL's fused forward sets it)."""
    asked = kwargs.get("output_router_logits")
    if asked is not None:
        return bool(asked)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "output_router_logits", False))


def router_loss_settings(model) -> tuple[int, int, float]:
    """(experts, experts per token, the loss's coefficient) as TRL's fused forward reads them (GPT-OSS's config under
    transformers 5.0-5.5 names no `num_experts`: the model's own attribute, as TRL takes it). GraniteMoE's config
    names only `num_local_experts`, where TRL's forward stops (AttributeError): read there."""
    text = model.config.get_text_config()
    version = Version(transformers.__version__)
    if version < Version("5.0.0") or (text.model_type == "gpt_oss" and version < Version("5.6.0")):
        experts = model.num_experts
    else:
        experts = getattr(text, "num_experts", None) or text.num_local_experts
    top_k = model.num_experts_per_tok if version < Version("5.0.0") else text.num_experts_per_tok
    return experts, top_k, float(getattr(text, "router_aux_loss_coef", 0.0))


def packed_router_loss(router_logits: list[list[torch.Tensor]], experts: int, top_k: int) -> torch.Tensor | None:
    """The load-balancing loss over every micro-batch's real tokens: `router_logits` holds, per micro-batch, each
    layer's `[n, experts]` logits at its real tokens. None where no token was forwarded."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    if not router_logits:
        return None
    layers = len(router_logits[0])
    per_layer = tuple(torch.cat([piece[layer] for piece in router_logits]) for layer in range(layers))
    return load_balancing_loss_func(per_layer, experts, top_k, None)


def with_router_loss(model, output, router_logits: list[list[torch.Tensor]]):
    """`output` (a `FusedCausalLMOutput`) with the router's loss: its `aux_loss`, and added to its `loss` with the
    config's coefficient, as TRL adds it."""
    experts, top_k, coefficient = router_loss_settings(model)
    aux_loss = packed_router_loss(router_logits, experts, top_k)
    if aux_loss is None:
        return output
    return dataclasses.replace(output, aux_loss=aux_loss, loss=output.loss + coefficient * aux_loss)
