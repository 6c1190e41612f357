"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`, with an off-policy correction for async rollout."""

from __future__ import annotations

from trl import RLOOTrainer as _TRLRLOOTrainer

from .construction import with_signature_of
from .correction import SequenceCorrection
from .hub import TRL_SCALE_TAG
from .online import ONLINE_FEATURES, OnlineTrainerMixin


class RLOOTrainer(OnlineTrainerMixin, _TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's features (packed scoring, server rollout, Ray reward models); same
    constructor, and TRL's numbers when those are off. With `async_rollout_staleness >= 1` each sequence's loss is
    weighted by its importance weight (`RLOOCorrectionArguments`): TRL's RLOO has no correction."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]
    FEATURES = (SequenceCorrection, *ONLINE_FEATURES)
    __init__ = with_signature_of(_TRLRLOOTrainer.__init__)(OnlineTrainerMixin.__init__)
