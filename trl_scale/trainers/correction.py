"""The off-policy correction's figures and RLOO's correction, as trainer features."""

from __future__ import annotations

import torch

from ..rollout.correction import (
    ratio_statistics,
    raw_ratio_statistics,
    record_ratio_statistics,
    sequence_importance_weights,
)
from ..rollout.record import RECORD_KEY, GeneratedBatch
from .feature import Feature


class RatioMetrics(Feature):
    """The correction's ratios before TRL clips them (`sampling/importance_sampling_ratio_raw/*`), the share clipped,
    the share of completions generated across a weight sync (streaming: tokens of two versions), and the tokens'
    ages (`record_token_ages`)."""

    name = "ratio_metrics"

    def generate_and_score(self, run, proceed, inputs):
        batch = proceed(inputs)
        record = batch.get(RECORD_KEY)  # trl-scale's client: the batch's versions
        if "importance_sampling_ratio" in batch and "sampling_per_token_logps" in batch:
            self._record(run.trl, batch, record)
        if run.trl.model.training and "completion_mask" in batch and record is not None:
            record_token_ages(run.trl, batch["completion_mask"], record)
        return batch

    def _record(self, trl, batch: dict, record) -> None:
        mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
        stats = raw_ratio_statistics(
            batch["old_per_token_logps"],
            batch["sampling_per_token_logps"],
            mask,
            trl.importance_sampling_mode,
            trl.importance_sampling_clip_min,
            trl.importance_sampling_clip_max,
        )
        metrics = trl.metrics()
        record_ratio_statistics(metrics, trl.accelerator.gather, stats)
        spans = record.version_spans if record is not None else ()
        if spans:
            spanning = torch.tensor(sum(first != newest for first, newest in spans) / len(spans), device=mask.device)
            metrics["rollout/completions_overlapping_a_sync"].append(trl.accelerator.gather(spanning).mean().item())


def record_token_ages(trl, completion_mask: torch.Tensor, record: GeneratedBatch) -> None:
    """The share of the batch's completion tokens (every process's) by age: the syncs between the weights that drew
    a completion's first token and the weights it is trained at, 0 to `async_rollout_staleness`, as
    `rollout/token_age/<age>` (a completion's later tokens may be younger: this is their oldest). Any older than the
    bound would show as `rollout/token_age/over_bound`. Server rollout only (it tags each completion's weights)."""
    generation, spans = trl.vllm_generation, record.version_spans
    if not spans or len(spans) != completion_mask.size(0):
        return
    bound = trl.args.async_rollout_staleness
    counts = torch.zeros(bound + 2, dtype=torch.float64)
    for (first, _), tokens in zip(spans, completion_mask.sum(1).tolist()):
        counts[min(max(0, generation.sync_count - first), bound + 1)] += tokens
    totals = trl.accelerator.gather(counts.to(completion_mask.device)).view(-1, bound + 2).sum(0).tolist()
    total = max(1.0, sum(totals))
    metrics = trl.metrics("train")
    for age in range(bound + 1):
        metrics[f"rollout/token_age/{age}"].append(totals[age] / total)
    if totals[-1]:
        metrics["rollout/token_age/over_bound"].append(totals[-1] / total)


class SequenceCorrection(Feature):
    """RLOO's off-policy correction for asynchronous rollout (`RLOOCorrectionArguments`): each sequence's loss weighted
    by its importance weight. TRL's RLOO has none."""

    name = "sequence_correction"

    @classmethod
    def build(cls, plan) -> SequenceCorrection | None:
        return cls() if plan.corrects_sampler_logprobs else None

    def generate_and_score(self, run, proceed, inputs):
        batch = proceed(inputs)
        if run.trl.args.corrects_sampler_logprobs:
            weights = importance_weights(run.trl, batch)
            # RLOO's loss is -min(r A, clip(r) A) per sequence: with w > 0, scaling A by w scales the loss by w
            batch["advantages"] = batch["advantages"] * weights
            batch["importance_sampling_ratio"] = weights
        return batch


def importance_weights(trl, batch: dict) -> torch.Tensor:
    """Each sequence's weight from the servers' log-probs of its sampled tokens (`generate`'s, which TRL's RLOO drops)
    and the old log-probs TRL scored with the current weights."""
    completion_ids, mask = batch["completion_ids"], batch["completion_mask"]
    record = batch.get(RECORD_KEY)
    rows = record.sampler_logprobs if record is not None else ()
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
    args = trl.args
    clip_min, clip_max = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
    stats = ratio_statistics(log_ratios.exp(), clip_min, clip_max)
    metrics = trl.metrics()
    record_ratio_statistics(metrics, trl.accelerator.gather, stats)
    return sequence_importance_weights(log_ratios, args.vllm_importance_sampling_mode, clip_min, clip_max)
