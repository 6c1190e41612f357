"""`RLOOTrainer`: a drop-in subclass of TRL's `trl.RLOOTrainer`, with an off-policy correction for async rollout."""

from __future__ import annotations

import torch
from trl import RLOOTrainer as _TRLRLOOTrainer

from ..rollout.correction import ratio_statistics, record_ratio_statistics, sequence_importance_weights
from .construction import with_signature_of
from .hub import TRL_SCALE_TAG
from .online import OnlineTrainerMixin


class RLOOTrainer(OnlineTrainerMixin, _TRLRLOOTrainer):
    """TRL's `RLOOTrainer` with trl-scale's features (packed scoring, server rollout, Ray reward models); same
    constructor, and TRL's numbers when those are off. With `async_rollout_staleness >= 1` each sequence's loss is
    weighted by its importance weight (`RLOOCorrectionArguments`): TRL's RLOO has no correction."""

    _tag_names = ["trl", TRL_SCALE_TAG, "rloo"]
    takes_sequence_parallel = True  # every scoring path goes through the packed engine
    __init__ = with_signature_of(_TRLRLOOTrainer.__init__)(OnlineTrainerMixin.__init__)

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if self.args.corrects_sampler_logprobs:
            weights = self._importance_weights(batch)
            # RLOO's loss is -min(r A, clip(r) A) per sequence: with w > 0, scaling A by w scales the loss by w
            batch["advantages"] = batch["advantages"] * weights
            batch["importance_sampling_ratio"] = weights
        return batch

    def _importance_weights(self, batch: dict) -> torch.Tensor:
        """Each sequence's weight from the servers' log-probs of its sampled tokens (`generate`'s, which TRL's RLOO
        drops) and the old log-probs TRL scored with the current weights."""
        completion_ids, mask = batch["completion_ids"], batch["completion_mask"]
        rows = self.vllm_generation.last_sampler_logprobs
        if len(rows) != completion_ids.size(0):
            raise RuntimeError(
                f"RLOO's off-policy correction: {len(rows)} completions' sampler log-probs for a batch of "
                f"{completion_ids.size(0)} (TRL's generation order is not the one trl-scale was built on)"
            )
        sampling = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        for i, values in enumerate(rows):
            width = min(len(values), sampling.size(1))
            sampling[i, :width] = torch.tensor(values[:width], dtype=torch.float32)
        log_ratios = batch["old_logps"] - (sampling * mask).sum(1)
        args = self.args
        clip_min, clip_max = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        stats = ratio_statistics(log_ratios.exp(), clip_min, clip_max)
        metrics = self._metrics["train" if self.model.training else "eval"]
        record_ratio_statistics(metrics, self.accelerator.gather, stats)
        return sequence_importance_weights(log_ratios, args.vllm_importance_sampling_mode, clip_min, clip_max)
