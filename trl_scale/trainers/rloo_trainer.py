"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`."""

from __future__ import annotations

from trl import RLOOTrainer as _TRLRLOOTrainer

from .common import (
    TRL_SCALE_TAG,
    ModelCardMixin,
    PackedScoringMixin,
    PhaseTimingMixin,
    ServerRolloutMixin,
    remote_reward_funcs,
)


class RLOOTrainer(ServerRolloutMixin, PhaseTimingMixin, ModelCardMixin, PackedScoringMixin, _TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's packed scoring (`padding_free`, `token_budget`, `logprob_chunk_size`);
    same constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]

    def __init__(self, model, reward_funcs, args=None, **kwargs):
        init = super().__init__
        reward_funcs = remote_reward_funcs(reward_funcs, args)
        self._init_with_server_rollout(lambda **kw: init(model=model, reward_funcs=reward_funcs, **kw), args, **kwargs)
        self._install_packed_scoring(temperature=self.temperature, policy_outputs=("entropy",))
