"""Ordered rollout of what only the stream can run: environments' episodes and a `rollout_func`.

`async_rollout_mode="ordered"` promises a run whose numbers do not depend on timing. Its prefetch
(`async_rollout.RolloutPrefetcher`) sends whole generation batches and matches them to TRL's generate call by their
prompt ids; an episode cannot be matched that way (its prompts are made by each environment's `reset()`, its later
turns call the environment's tools) and a `rollout_func` is the user's own loop. So these go through the stream's
engine (`streaming.StreamingRollout`: a group's episode opened when it is sent, its turns and rewards in the stream,
the step taking finished groups) with the two rules that make it ordered:

- a weight sync first waits for every group out (`before_sync`): each group is generated whole, every turn, by the
  weights of the version it was sent at, and nothing is sent during a sync (sends happen in the trainer's thread:
  when its data is read ahead and when it takes a batch, both at fixed points between syncs);
- each generation batch trains on the oldest groups read, in read order, waited for (`_choose`), not on the first
  to finish.

Which weights generate a group and which batch trains it then depend on the run's steps alone; with seeded sampling
and deterministic environments and rewards, two runs give the same numbers. The staleness bound is the stream's (a
group sent at version V is trained by V + k at the latest). The cost: a sync waits for the longest episode out, as
the ordered prefetch waits for its batches.
"""

from __future__ import annotations

from .streaming import PromptGroup, StreamingRollout


class OrderedStream(StreamingRollout):
    """The stream's engine, reproducible: syncs settle the groups out, batches take groups in read order."""

    def before_sync(self) -> None:
        """Wait for every group out (a stream closed at the end of a run waits for nothing)."""
        with self._changed:
            while not self._closed and not all(group.done for group in self.out):
                self._changed.wait(timeout=1.0)

    def _choose(self, num_rows: int, oldest: int) -> list[PromptGroup] | None:
        """The first groups read that are out, `num_rows` rows of them, once all have finished."""
        chosen, rows = [], 0
        for group in sorted(self.out, key=lambda g: g.index):
            if rows + len(group.rows) > num_rows:
                break
            chosen.append(group)
            rows += len(group.rows)
        if rows != num_rows or not all(group.done for group in chosen):
            return None
        return chosen
