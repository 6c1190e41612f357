"""The trainer's batch iterator read ahead (asynchronous rollout, either engine): each upcoming generation batch is
told to the read-ahead engine (the ordered prefetch, `prefetch.py`, or the stream, `streaming.py`) as soon as it is
known, so that it is generated before the trainer reaches it."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator


class LookaheadIterator:
    """The trainer's batch iterator, read `reader.batches_ahead × every` batches ahead; each upcoming generation
    batch (one in `every` batches: TRL repeats a generation batch `steps_per_generation × num_iterations` times) is
    noted with the reader (the prefetcher or the streamer) as soon as it is known. `phase`: batches of the current
    generation window already trained before a resume (they are repeats, not new generation batches)."""

    def __init__(self, source: Iterator, reader, every: int, limit: int | None = None, phase: int = 0):
        self.source, self.reader, self.every = source, reader, every
        self.limit = limit  # batches the run will still take (max_steps): none past it is read for generation
        self.phase = phase
        self.buffer: deque = deque()
        self.noted: deque[bool] = deque()  # per buffered batch: was it noted with the reader
        self.position = 0  # batches handed to the trainer
        self.read = 0  # batches read from the source
        self.exhausted = False

    def __iter__(self):
        return self

    def noted_ahead(self) -> int:
        """Generation batches read and noted, not yet handed to the trainer (a checkpoint records them)."""
        return sum(self.noted)

    def _fill(self) -> None:
        wanted = 1 + self.reader.batches_ahead * self.every
        while not self.exhausted and len(self.buffer) < wanted:
            try:
                batch = next(self.source)
            except StopIteration:
                self.exhausted = True
                return
            index = self.read + self.phase
            first = index == 0 and not self.reader.notes_first
            note = index % self.every == 0 and not first and (self.limit is None or self.read < self.limit)
            if note:
                self.reader.note_upcoming(batch)
            self.read += 1
            self.buffer.append(batch)
            self.noted.append(note)

    def __next__(self):
        self._fill()
        if not self.buffer:
            raise StopIteration
        self.position += 1
        self.noted.popleft()
        return self.buffer.popleft()
