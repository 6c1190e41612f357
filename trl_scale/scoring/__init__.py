"""The scoring engine: remove-padding packing, the chunked log-prob head, and the forward that joins them."""

from .engine import install_packed_scoring, packed_fused_forward
from .logprob_head import DEFAULT_LOGPROB_CHUNK_SIZE, ChunkedLogProbHead, chunked_logprobs
from .packing import (
    PackedBatch,
    PackedMicroBatch,
    UnpaddedRows,
    pack_padded_batch,
    packed_forward_kwargs,
    plan_micro_batches,
    plan_rows,
    unpack,
)
from .settings import PackedScoringConfig, PackingStats, ScoringSettings
from .support import PackingSupport, packing_support, probe_packing, use_packing
from .token_scores import token_scores

__all__ = [
    "DEFAULT_LOGPROB_CHUNK_SIZE",
    "ScoringSettings",
    "ChunkedLogProbHead",
    "PackedBatch",
    "PackedMicroBatch",
    "PackedScoringConfig",
    "PackingStats",
    "PackingSupport",
    "UnpaddedRows",
    "chunked_logprobs",
    "install_packed_scoring",
    "pack_padded_batch",
    "packed_forward_kwargs",
    "packed_fused_forward",
    "packing_support",
    "plan_micro_batches",
    "plan_rows",
    "probe_packing",
    "token_scores",
    "unpack",
    "use_packing",
]
