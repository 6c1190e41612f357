"""`GRPOTrainer`: a drop-in subclass of TRL's `trl.GRPOTrainer`."""

from __future__ import annotations

from trl import GRPOTrainer as _TRLGRPOTrainer

from .common import TRL_SCALE_TAG


class GRPOTrainer(_TRLGRPOTrainer):
    """TRL's `GRPOTrainer` with trl-scale's features; same constructor, same behaviour when they are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "grpo"]
