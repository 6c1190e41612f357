"""What the rollout knows of a generated batch that TRL's generation interface does not carry: one record per batch.

TRL's `vllm_generation.generate` returns token ids and log-probs; a trl-scale batch also has, per completion, the
weight versions its tokens were drawn with, the sampler's log-probs of its tokens (TRL's RLOO drops them), and, for a
streamed tool-using group, its whole conversation. `ServerRolloutGeneration.generate` adds a `GeneratedBatch` to its
record for each batch it generates to the records of the build it is part of (`StepState.records`,
`rollout.step_state`); the trainer's rollout feature hands that batch's record out with the batch (`RECORD_KEY`),
where the features that need it read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

# The key under which a built batch carries its record out of the rollout feature, to the features outside it (the
# trainer's adapter removes it before TRL sees the batch).
RECORD_KEY = "trl_scale_generated_batch"


@dataclass(frozen=True)
class GeneratedBatch:
    """One generated batch, per completion in TRL's row order."""

    version_spans: tuple[tuple[int, int], ...]  # (first, newest possible) sync counts of its tokens' weights
    sampler_logprobs: tuple[list[float], ...] = ()  # the sampler's log-prob of each of its tokens (NaN: none asked)
    conversations: tuple | None = None  # a streamed tool-using group's whole conversation, per completion
    servers: tuple[str | None, ...] = ()  # the server that drew each completion (its first turn), where known
    # the sampler's routes (servers that return them, `routing_replay`): per completion, its prompt and completion
    # token ids and their routes `[tokens - 1, layers, top_k]` (vLLM's `routed_experts`), or None
    routes: tuple = ()

    @property
    def versions(self) -> list[int]:
        """Per completion: the sync count of the weights that drew its first token."""
        return [first for first, _ in self.version_spans]

    def __len__(self) -> int:
        return len(self.version_spans)

    def with_spans(self, spans: Sequence[tuple[int, int]]) -> GeneratedBatch:
        return replace(self, version_spans=tuple(spans))

    def rows(self, start: int, stop: int) -> GeneratedBatch:
        """The record of rows `start:stop`."""
        conversations = self.conversations[start:stop] if self.conversations is not None else None
        logprobs = self.sampler_logprobs[start:stop] if self.sampler_logprobs else ()
        servers = self.servers[start:stop] if self.servers else ()
        routes = self.routes[start:stop] if self.routes else ()
        return GeneratedBatch(self.version_spans[start:stop], logprobs, conversations, servers, routes)

    @staticmethod
    def joined(records: Sequence[GeneratedBatch]) -> GeneratedBatch:
        """The record of these batches' rows, one after another (dynamic sampling's chosen rows)."""
        spans = tuple(span for record in records for span in record.version_spans)
        with_logprobs = all(len(record.sampler_logprobs) == len(record) for record in records)
        logprobs = tuple(row for record in records for row in record.sampler_logprobs) if with_logprobs else ()
        with_servers = all(len(record.servers) == len(record) for record in records)
        servers = tuple(url for record in records for url in record.servers) if with_servers else ()
        with_routes = all(len(record.routes) == len(record) for record in records)
        routes = tuple(row for record in records for row in record.routes) if with_routes else ()
        return GeneratedBatch(spans, logprobs, servers=servers, routes=routes)


class BatchRecords:
    """The records of the batches generated in one training batch's build (`StepState.records`), newest last
    (dynamic sampling's rounds generate several; the step trains on the newest, or on the one a feature assembled
    and added)."""

    def __init__(self) -> None:
        self._records: list[GeneratedBatch] = []

    def add(self, record: GeneratedBatch) -> None:
        self._records.append(record)

    def newest(self) -> GeneratedBatch | None:
        return self._records[-1] if self._records else None

    def all(self) -> list[GeneratedBatch]:
        """Every record of the build, oldest first (a tool loop's later turns add their own)."""
        return list(self._records)

    def replace_newest(self, record: GeneratedBatch) -> None:
        """A later stage of the same batch (the tool loop's turns widen its version spans)."""
        self._records[-1] = record
