"""`DPOTrainer`: a drop-in subclass of TRL's `trl.DPOTrainer`."""

from __future__ import annotations

from trl import DPOTrainer as _TRLDPOTrainer

from .checkpoints import SafeCheckpointMixin
from .construction import (
    check_model_arguments,
    check_output_dir,
    check_train_dataset,
    overridden,
    trl_arguments,
    with_signature_of,
)
from .hub import TRL_SCALE_TAG, ModelCardMixin
from .wiring import PackedScoringMixin


def check_preference_pairs(dataset) -> None:
    """An empty chosen or rejected answer gives DPO nothing to compare (a zero-token log-prob): name the first row."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "column_names"):
        return
    for column in ("chosen", "rejected"):
        for index, value in enumerate(dataset[column]):
            empty = not value if isinstance(value, (str, list)) else value is None
            if isinstance(value, list) and value and isinstance(value[-1], dict):  # conversational: the last turn
                empty = not value[-1].get("content")
            if empty:
                raise ValueError(
                    f"train_dataset row {index} has an empty {column!r} answer: DPO needs a non-empty chosen and "
                    "rejected completion in every pair. Fix: drop such rows, e.g. dataset.filter(lambda r: "
                    "r['chosen'] and r['rejected'])"
                )


class DPOTrainer(SafeCheckpointMixin, ModelCardMixin, PackedScoringMixin, _TRLDPOTrainer):
    """TRL's `DPOTrainer` with trl-scale's packed scoring (`padding_free`, `token_budget`, `logprob_chunk_size`);
    same constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "dpo"]
    takes_sequence_parallel = True  # the policy and reference scoring calls go through the packed engine

    @with_signature_of(_TRLDPOTrainer.__init__)
    def __init__(self, *args, **kwargs):
        arguments = trl_arguments(self, args, kwargs)
        config = arguments.get("args")
        check_output_dir(config)
        check_model_arguments(arguments)
        check_train_dataset(arguments.get("train_dataset"), ("chosen", "rejected"), "DPOTrainer")
        check_preference_pairs(arguments.get("train_dataset"))
        # TRL 1.16 force-disables its own `padding_free` with a warning; ours is a different mechanism (a packed
        # forward behind TRL's padded collator), so hide the flag from TRL's constructor, and keep its value for
        # `_precompute_ref_logps`, which TRL runs inside its constructor.
        self._scoring_padding_free = getattr(config, "padding_free", None) if config is not None else None
        with overridden(config, padding_free=False):
            super().__init__(**arguments)
        self._install_dpo_packed_scoring()

    def _install_dpo_packed_scoring(self) -> None:
        outputs = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())
        self._install_packed_scoring(1.0, outputs, self._scoring_padding_free)

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        # TRL precomputes the reference log-probs inside its constructor; pack them as the policy will be packed.
        self._install_dpo_packed_scoring()
        return super()._precompute_ref_logps(dataset, name, batch_size)
