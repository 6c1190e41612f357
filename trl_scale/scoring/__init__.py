"""The scoring engine: remove-padding packing, the chunked log-prob head, and the forward that joins them."""

from .engine import PackedScoringConfig, PackingStats, install_packed_scoring, packed_fused_forward, token_scores
from .logprob_head import ChunkedLogProbHead, chunked_logprobs
from .packing import (
    PackedBatch,
    PackedMicroBatch,
    UnpaddedRows,
    check_packing_attention,
    pack_padded_batch,
    pack_sequences,
    packed_forward_kwargs,
    plan_micro_batches,
    unpack,
)

__all__ = [
    "ChunkedLogProbHead",
    "PackedBatch",
    "PackedMicroBatch",
    "PackedScoringConfig",
    "PackingStats",
    "UnpaddedRows",
    "check_packing_attention",
    "chunked_logprobs",
    "install_packed_scoring",
    "pack_padded_batch",
    "pack_sequences",
    "packed_forward_kwargs",
    "packed_fused_forward",
    "plan_micro_batches",
    "token_scores",
    "unpack",
]
