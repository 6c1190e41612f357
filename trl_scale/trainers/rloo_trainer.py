"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`."""

from __future__ import annotations

from trl import RLOOTrainer as _TRLRLOOTrainer

from .common import TRL_SCALE_TAG


class RLOOTrainer(_TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's features; same constructor, same behaviour when they are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]
