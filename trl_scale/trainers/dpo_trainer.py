"""`DPOTrainer`: a drop-in subclass of TRL's `trl.DPOTrainer`."""

from __future__ import annotations

from trl import DPOTrainer as _TRLDPOTrainer

from .common import TRL_SCALE_TAG


class DPOTrainer(_TRLDPOTrainer):
    """TRL's `DPOTrainer` with trl-scale's features; same constructor, same behaviour when they are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "dpo"]
