"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`."""

from __future__ import annotations

from trl import RLOOTrainer as _TRLRLOOTrainer

from .common import TRL_SCALE_TAG, ModelCardMixin, PackedScoringMixin, PhaseTimingMixin


class RLOOTrainer(PhaseTimingMixin, ModelCardMixin, PackedScoringMixin, _TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's packed scoring (`padding_free`, `token_budget`, `logprob_chunk_size`);
    same constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._install_packed_scoring(temperature=self.temperature, policy_outputs=("entropy",))
