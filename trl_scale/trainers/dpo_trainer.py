"""`DPOTrainer`: a drop-in subclass of TRL's `trl.DPOTrainer`."""

from __future__ import annotations

from trl import DPOTrainer as _TRLDPOTrainer

from .adapter import PreferenceHooks
from .checkpoints import SafeCheckpoint
from .construction import (
    check_model_arguments,
    check_output_dir,
    check_train_dataset,
    overridden,
    trl_arguments,
    with_signature_of,
)
from .decoder_layers import DecoderLayers
from .feature import Feature, Patch
from .hub import TRL_SCALE_TAG, ModelCard
from .packing import PackedScoring, PackingRequest


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


class PreferencePackedScoring(PackedScoring):
    """DPO's packed scoring: its outputs, and its own `padding_free` (TRL 1.16 force-disables TRL's flag with a
    warning; ours is a different mechanism, a packed forward behind TRL's padded collator)."""

    PATCHES = (
        *PackedScoring.PATCHES,
        Patch(
            "config.padding_free (False)",
            "while TRL's constructor runs (TRL's own padding-free collator stays off; the packed forward replaces it)",
            "when it returns",
            "trainers/dpo_trainer.py",
        ),
    )

    def __init__(self, padding_free: bool | None = None, sequence_parallel_size: int = 1):
        super().__init__(sequence_parallel_size)
        self.padding_free = padding_free  # the user's value, read by the plan before TRL's constructor hides it

    @classmethod
    def build(cls, plan) -> Feature:
        return cls(plan.scoring.padding_free, plan.scoring.sequence_parallel_size)

    def request(self, trl) -> PackingRequest:
        outputs = ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if trl.use_weighting else ())
        return PackingRequest(1.0, outputs, self.padding_free)


class DPOTrainer(PreferenceHooks, _TRLDPOTrainer):
    """TRL's `DPOTrainer` with trl-scale's packed scoring (`padding_free`, `token_budget`, `logprob_chunk_size`);
    same constructor, and TRL's numbers when those are off."""

    _tag_names = ["trl", TRL_SCALE_TAG, "dpo"]
    FEATURES = (SafeCheckpoint, ModelCard, PreferencePackedScoring, DecoderLayers)  # outermost first

    @with_signature_of(_TRLDPOTrainer.__init__)
    def __init__(self, *args, **kwargs):
        arguments = trl_arguments(self, args, kwargs)
        config = arguments.get("args")
        check_output_dir(config)
        check_model_arguments(arguments)
        check_train_dataset(arguments.get("train_dataset"), ("chosen", "rejected"), "DPOTrainer")
        check_preference_pairs(arguments.get("train_dataset"))
        self._start_features(arguments)  # packed scoring is asked for inside TRL's constructor (reference log-probs)
        with overridden(config, padding_free=False):
            super().__init__(**arguments)
        self._set_up_features()
