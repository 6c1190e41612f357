"""An MoE policy whose config asks for its router's logits (`output_router_logits=True`), generating in the trainer.

transformers' MoE models (Qwen3-MoE, Mixtral, OLMoE, ...) compute the router's load-balancing loss in every forward
their config asks it of, with the attention mask the forward is given; inside `generate`, a decoding step's forward
gets the whole sequence's mask and one token's router logits, and the loss fails on the shapes (`RuntimeError: The
size of tensor a ... must match the size of tensor b`, `modeling_qwen3_moe.py`), in stock TRL as in trl-scale. The
loss is a training term: generation needs the router's choices, not its loss. So while TRL's local generation runs,
the policy's config asks for no router logits; scoring, where TRL adds the loss, is untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .feature import Feature, Patch


def _router_configs(model) -> list:
    """The model's config and its text config, where either asks for the router's logits."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    configs = [config] if text is config else [config, text]
    return [c for c in configs if getattr(c, "output_router_logits", False)]


@contextmanager
def router_logits_off(model) -> Iterator[None]:
    """Within the block, `model`'s config asks for no router logits (restored after, whatever happens)."""
    configs = _router_configs(model)
    for config in configs:
        config.output_router_logits = False
    try:
        yield
    finally:
        for config in configs:
            config.output_router_logits = True


class RouterLogitsInGeneration(Feature):
    """Local generation of an MoE policy whose config asks for router logits: asked for none while it generates."""

    name = "router_logits_in_generation"
    PATCHES = (
        Patch(
            "model.config.output_router_logits (False)",
            "each turn of local generation (use_vllm=False) of an MoE policy whose config asks for router logits",
            "when the turn returns",
            "trainers/router_logits.py",
        ),
    )

    @classmethod
    def build(cls, plan) -> RouterLogitsInGeneration | None:
        return cls() if plan.scoring.local_generation and plan.router_logits else None

    def single_turn(self, run, proceed, *args, **kwargs):
        with router_logits_off(run.trl.accelerator.unwrap_model(run.trl.model)):
            return proceed(*args, **kwargs)
