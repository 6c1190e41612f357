"""The seams of transformers' models, configs and DeepSpeed integration: private names trl-scale reads or sets on
the models it packs, shards and builds (see the package docstring)."""

from __future__ import annotations

from .seam import ATTRIBUTE, CALL, CONSTANT, Seam

C = "transformers.configuration_utils:PretrainedConfig"
M = "transformers.modeling_utils:PreTrainedModel"

MODEL_SEAMS: tuple[Seam, ...] = (
    Seam(
        C,
        ATTRIBUTE,
        "scoring/support.py, scoring/varlen.py, scoring/sequence_parallel.py, trainers/packing.py, "
        "trainers/remote_reference.py",
        "the attention implementation a model runs (a property over the config's own); read to choose packing's "
        "layout and to restore it, set only through model.set_attn_implementation",
        attribute="_attn_implementation",
    ),
    Seam(
        C,
        ATTRIBUTE,
        "trainers/ppo_trainer.py, trainers/fleet.py, distributed/roles.py",
        "the path or id a model was loaded from (what managed servers and Ray workers load)",
        attribute="_name_or_path",
    ),
    Seam(
        f"{M}._no_split_modules",
        CONSTANT,
        "critic/holders.py",
        "a model class's decoder-layer class names, or None (FSDP2 wraps each such layer of the critic)",
    ),
    Seam(
        f"{M}._can_set_attn_implementation",
        CALL,
        "scoring/varlen.py",
        "whether set_attn_implementation may switch this model's attention (a class method, no argument)",
        "() -> bool",
    ),
    Seam(
        "transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref",
        CONSTANT,
        "sharding/zero.py",
        "the module global that makes from_pretrained build under deepspeed.zero.Init; saved, unset (through "
        "unset_hf_deepspeed_config) and restored around a build that must stay whole",
    ),
)
