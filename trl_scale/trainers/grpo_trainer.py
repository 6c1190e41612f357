"""`GRPOTrainer`: a drop-in subclass of TRL's `trl.GRPOTrainer`."""

from __future__ import annotations

from trl import GRPOTrainer as _TRLGRPOTrainer

from .construction import with_signature_of
from .hub import TRL_SCALE_TAG
from .online import OnlineTrainerMixin


class GRPOTrainer(OnlineTrainerMixin, _TRLGRPOTrainer):
    """TRL's `GRPOTrainer` with trl-scale's features (packed scoring, server rollout, Ray reward models); same
    constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "grpo"]
    __init__ = with_signature_of(_TRLGRPOTrainer.__init__)(OnlineTrainerMixin.__init__)
