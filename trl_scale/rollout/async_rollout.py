"""Asynchronous rollout: the servers generate the next generation batches while the trainer trains.

With `async_rollout_staleness = k ≥ 1`, the trainer's batch iterator looks `k` generation batches ahead
(`LookaheadIterator`). Right after a weight sync serves batch n, the prompts of batches n+1 .. n+k are sent to the
servers in the background (`RolloutPrefetcher.submit_upcoming`), tagged with the weight version that was current
(the sync count). When TRL later asks `vllm_generation.generate` for batch n+1, its completions are taken from
that request if it is at most `k` versions old, and generated now otherwise. The sampling log-probs the servers
return feed TRL's importance-sampling correction (`vllm_importance_sampling_*`), which is what keeps the policy
gradient of these slightly off-policy completions corrected; PPO's old log-probs, values and reference
log-probs are computed at training time as usual.

A request is matched to its batch by the batch's prompt token ids, so nothing is ever trained on completions of
other prompts: a batch whose prompts differ from what was prefetched (or whose prefetch failed) is generated
synchronously. A resumed run starts with nothing in flight and regenerates what was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ..logs import get_logger

logger = get_logger(__name__)


def _key(prompt_ids) -> tuple:
    return tuple(tuple(p) for p in prompt_ids)


class RolloutPrefetcher:
    """Requests for upcoming generation batches, keyed by their prompt ids, with the version they were sent at."""

    def __init__(self, staleness: int, tokenize: Callable[[list], list[list[int]]], request: Callable):
        self.staleness = staleness
        self.tokenize = tokenize  # raw rows' prompts -> prompt token ids, as the trainer tokenizes them
        self.request = request  # prompt ids -> a Future of the generation's result
        self.upcoming: deque[list] = deque()  # raw generation batches not yet requested
        self.in_flight: dict[tuple, tuple[Future, int]] = {}
        self.served_from_prefetch = 0
        self.generated_now = 0

    def note_upcoming(self, batch: list) -> None:
        self.upcoming.append(batch)

    def submit_upcoming(self, version: int) -> None:
        """Send every noted batch to the servers now, tagged with `version` (called right after a sync)."""
        while self.upcoming:
            batch = self.upcoming.popleft()
            try:
                prompt_ids = self.tokenize([row["prompt"] for row in batch])
            except Exception as error:  # an unusual row: that batch is generated synchronously when it comes
                logger.warning("async rollout: cannot prefetch a batch (%s); it will be generated in turn", error)
                continue
            key = _key(prompt_ids)
            if key not in self.in_flight:
                self.in_flight[key] = (self.request(prompt_ids), version)

    def take(self, prompt_ids, version: int):
        """The prefetched result for these prompts and the version it was requested at, or None: not prefetched,
        failed, or more than `staleness` versions old (then the caller generates now)."""
        entry = self.in_flight.pop(_key(prompt_ids), None)
        if entry is None:
            self.generated_now += 1
            return None
        future, requested_at = entry
        if version - requested_at > self.staleness:
            future.cancel()
            self.generated_now += 1
            return None
        try:
            result = future.result()
        except Exception as error:
            logger.warning("async rollout: a prefetched request failed (%s); generating now", error)
            self.generated_now += 1
            return None
        self.served_from_prefetch += 1
        return result, requested_at

    def drop_all(self) -> None:
        for future, _ in self.in_flight.values():
            future.cancel()
        self.in_flight.clear()
        self.upcoming.clear()


class LookaheadIterator:
    """The trainer's batch iterator, read `staleness × every` batches ahead; each upcoming generation batch (one
    in `every` batches: TRL repeats a generation batch `steps_per_generation × num_iterations` times) is noted with
    the prefetcher as soon as it is known."""

    def __init__(self, source: Iterator, prefetcher: RolloutPrefetcher, every: int):
        self.source, self.prefetcher, self.every = source, prefetcher, every
        self.buffer: deque = deque()
        self.position = 0  # batches handed to the trainer
        self.read = 0  # batches read from the source
        self.exhausted = False

    def __iter__(self):
        return self

    def _fill(self) -> None:
        wanted = 1 + self.prefetcher.staleness * self.every
        while not self.exhausted and len(self.buffer) < wanted:
            try:
                batch = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            if self.read % self.every == 0 and self.read > 0:
                self.prefetcher.note_upcoming(batch)
            self.read += 1
            self.buffer.append(batch)

    def __next__(self):
        self._fill()
        if not self.buffer:
            raise StopIteration
        self.position += 1
        return self.buffer.popleft()
