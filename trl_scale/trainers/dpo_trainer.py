"""`DPOTrainer`: a drop-in subclass of TRL's `trl.DPOTrainer`."""

from __future__ import annotations

from trl import DPOTrainer as _TRLDPOTrainer

from .common import TRL_SCALE_TAG, ModelCardMixin, PackedScoringMixin, overridden


class DPOTrainer(ModelCardMixin, PackedScoringMixin, _TRLDPOTrainer):
    """TRL's `DPOTrainer` with trl-scale's packed scoring (`padding_free`, `token_budget`, `logprob_chunk_size`);
    same constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "dpo"]

    def __init__(self, *args, **kwargs):
        args_index = 2  # DPOTrainer(model, ref_model, args, ...)
        config = kwargs.get("args", args[args_index] if len(args) > args_index else None)
        # TRL 1.16 force-disables its own `padding_free` with a warning; ours is a different mechanism (a packed
        # forward behind TRL's padded collator), so hide the flag from TRL's constructor.
        with overridden(config, padding_free=False):
            super().__init__(*args, **kwargs)
        outputs = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        self._install_packed_scoring(temperature=1.0, policy_outputs=outputs)
