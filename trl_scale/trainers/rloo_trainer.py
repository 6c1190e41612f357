"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`."""

from __future__ import annotations

from trl import RLOOTrainer as _TRLRLOOTrainer

from .construction import with_signature_of
from .hub import TRL_SCALE_TAG
from .online import OnlineTrainerMixin


class RLOOTrainer(OnlineTrainerMixin, _TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's features (packed scoring, server rollout, Ray reward models); same
    constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]
    __init__ = with_signature_of(_TRLRLOOTrainer.__init__)(OnlineTrainerMixin.__init__)
