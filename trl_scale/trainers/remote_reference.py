"""The reference model on its own Ray group (`backend="ray"`, `reference_placement`), as a trainer feature."""

from __future__ import annotations

from ..distributed.role_workers import ReferenceWorkerSettings
from ..distributed.roles import RayReference, start_reference
from ..distributed.row_images import RowImages
from ..scoring import ScoringSettings
from ..scoring.varlen import plain_attention
from .feature import Feature, Patch


class RemoteReference(Feature):
    """TRL built no reference (beta=0 while it built, see the adapter); the reference group stands in for it, and
    TRL's reference scoring calls are answered by it (log-probs only, as TRL asks of it)."""

    name = "remote_reference"
    PATCHES = (
        Patch(
            "config.beta (0.0)",
            "while TRL's constructor runs (TRL builds no reference)",
            "when it returns",
            "trainers/online.py",
        ),
    )

    @classmethod
    def build(cls, plan) -> RemoteReference | None:
        return cls() if plan.remote_reference else None  # decided by the plan (a PEFT policy needs none)

    def setup(self, run) -> None:
        run.trl.use_remote_reference(start_remote_reference(run.trl, run.plan.scoring))

    def scoring(self, run, proceed, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if isinstance(model, RayReference):  # TRL passes the image inputs by name, with `num_images`
            images = RowImages.from_kwargs(kwargs, input_ids.size(0))
            return model.logps(input_ids, attention_mask, logits_to_keep, images), None, None
        return proceed(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)


def start_remote_reference(trl, scoring) -> RayReference:
    """The reference on its group, loaded as TRL would load it: from the policy's path, in the policy's dtype and
    attention implementation, scored with the same head (temperature, fp32 cast, packing)."""
    from trl.trainer.utils import get_config_model_id

    args = trl.args
    init_kwargs = args.model_init_kwargs or {}
    model = trl.model
    dtype = init_kwargs.get("dtype", model.dtype)
    mixed = {"bf16": "bfloat16", "fp16": "float16"}.get(str(trl.accelerator.mixed_precision))
    settings = ReferenceWorkerSettings(
        dtype=str(dtype).removeprefix("torch."),  # "auto" passes through, as TRL passes it
        attn_implementation=init_kwargs.get("attn_implementation", plain_attention(model.config._attn_implementation)),
        scoring=ScoringSettings.from_config(
            args, trl.temperature, scoring.sampler_support, scoring.cast_lm_head_to_fp32
        ),
        autocast_dtype=mixed,
    )
    model_path = get_config_model_id(trl.accelerator.unwrap_model(model).config)
    return start_reference(model_path, settings, args)
