"""Shared prefill as a trainer feature: local generation (`use_vllm=False`) prefills each prompt of a generation
batch once for its G completions (`generation/prefill.py`), under the `tree_packing` switch that shares the prompt
in scoring. TRL's `_generate_single_turn` runs as it is; only the policy's `generate` is wrapped while it runs."""

from __future__ import annotations

from ..generation import PrefillStats, shared_prefill_generate, why_not_shared
from ..logs import get_logger
from .feature import Feature, Patch

logger = get_logger(__name__)


def _collective_forwards(trl) -> str | None:
    """Why a forward of the policy during generation is collective (each rank must run as many as the others), or
    None. A rank whose rows repeat would run one forward more than a rank whose rows do not."""
    if trl.is_fsdp_enabled:
        return "FSDP gathers parameters in every forward"
    if trl.is_deepspeed_enabled and not trl.args.ds3_gather_for_generation:
        from trl.distributed import DistributedBackend

        if DistributedBackend(trl.accelerator).is_zero3:
            return "ZeRO-3 with ds3_gather_for_generation=False gathers parameters in every forward"
    return None


class SharedPrefill(Feature):
    """Each repeated prompt of a local generation batch prefilled once, its KV cache copied to its G rows."""

    name = "shared_prefill"
    STEPS_ASIDE = {"single_turn": "where vLLM generates, or for a policy it does not prefill for"}
    PATCHES = (
        Patch(
            "model.generate",
            "each turn of local generation (use_vllm=False), where prompts repeat",
            "when the turn returns",
            "trainers/shared_prefill.py",
        ),
    )

    def __init__(self, tree_packing, continuous_batching: bool = False):
        self.tree_packing = tree_packing
        self.continuous_batching = continuous_batching
        self.stats = PrefillStats()
        self.model = None  # the policy whose generate is wrapped; None where the sharing steps aside

    @classmethod
    def build(cls, plan):
        scoring = plan.scoring
        if not scoring.local_generation or scoring.tree_packing is False:
            return None
        return cls(scoring.tree_packing, scoring.continuous_batching)

    def check(self, run) -> None:
        model = run.trl.accelerator.unwrap_model(run.trl.model_wrapped)
        reason = _collective_forwards(run.trl) or why_not_shared(model, run.trl.generation_config, {}, training=True)
        if self.continuous_batching:
            reason = "use_transformers_continuous_batching=True (generate_batch, not generate)"
        if reason is None:
            self.model = model
            return
        if self.tree_packing is True:
            raise ValueError(
                f"tree_packing=True, but local generation cannot prefill a group's prompt once: {reason}. Fix: "
                "tree_packing='auto' (shares where it can, steps aside with a warning) or tree_packing=False"
            )
        logger.warning(f"trl-scale: local generation prefills every row's prompt ({reason}); scoring still shares it")

    def single_turn(self, run, proceed, *args, **kwargs):
        if self.model is None or run.trl.use_vllm:
            run.trace.stepped_aside(self.name, "single_turn")
            return proceed(*args, **kwargs)
        model, generate = self.model, self.model.generate

        def shared(*positional, **named):
            if positional:  # TRL passes keywords; anything else runs as it was
                return generate(*positional, **named)
            return shared_prefill_generate(generate, model, stats=self.stats, **named)

        before = model.__dict__.get("generate")  # an instance attribute already there (someone's own patch)
        model.generate = shared
        try:
            return proceed(*args, **kwargs)
        finally:
            if before is None:
                del model.generate  # the class's generate again
            else:
                model.generate = before

    def log(self, run, logs: dict[str, float]) -> None:
        logs.update(self.stats.pop())

    def card_tags(self, run) -> list[str]:
        return ["shared-prefill"] if self.model is not None else []
