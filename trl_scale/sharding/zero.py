"""DeepSpeed ZeRO-3 helpers for models the trainer holds outside DeepSpeed's engine."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def whole_parameters():
    """Build a model whole, even in a process whose TrainingArguments enabled DeepSpeed ZeRO-3: transformers would
    otherwise create it under `deepspeed.zero.Init`, which partitions each parameter with a collective broadcast.
    That is wrong for a model no DeepSpeed engine manages (PPO's local critic: its forward would see empty
    partitions), and it deadlocks where one process builds alone (the toy builder, the others at a barrier)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


@contextmanager
def gathered(module):
    """`module`'s ZeRO-3 partitions gathered for reading (a no-op for a model that is not partitioned)."""
    parameters = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not parameters:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
        yield
