"""Seeded requests, each its own draws: a seed per request derived from the run's seeds and the request's identity.

`generation_kwargs={"seed": s}` used to send `s` with every request: each prompt group of each step drew the same
random numbers, so a group's completions (which vLLM seeds `s + i`) were the same noise step after step, and a run
with environments or tools learned nothing (every completion of a group the same text). Now `s` and the trainer's
`seed` are the base of a seed per request: hash(base, rank, identity), where the identity says which request it is
in a run, in an order no thread's timing changes: a synchronous or prefetched batch by its number among the
trainer's batches and the prompt's place in it; a streamed prompt group by the order it was read in and its attempt,
each of its requests (later turns, an episode's rows, a rollout_func's calls) numbered as the group sends them. Two
runs with the same seeds draw the same numbers request for request (ordered runs are reproducible to the bit), and
every request draws its own.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

_GROUP: contextvars.ContextVar[_Numbered | None] = contextvars.ContextVar("trl_scale_request_group", default=None)


class _Numbered:
    """One identity's requests, numbered in the order its thread sends them."""

    def __init__(self, key: tuple):
        self.key, self._next = key, itertools.count()

    def next(self) -> tuple:
        return (*self.key, next(self._next))


@contextmanager
def identified(*key):
    """Within the block (one thread: a stream's attempt at a group), each request takes `key` and its number."""
    token = _GROUP.set(_Numbered(key))
    try:
        yield
    finally:
        _GROUP.reset(token)


def next_identity() -> tuple | None:
    """The identity of the next request sent in this thread's `identified` block; None outside one. A request sent
    from another thread (a pool) takes the identity its sender drew here, passed along."""
    numbered = _GROUP.get()
    return None if numbered is None else numbered.next()


@dataclass
class RequestSeeds:
    """Seeds per request from `base` (None: requests unseeded, as vLLM and TRL leave them) and this process's
    `rank` (each data-parallel rank sends its own prompts); and the run's batches, numbered."""

    base: tuple | None
    rank: int = 0
    _batches: itertools.count = field(default_factory=itertools.count, repr=False)

    def next_batch(self) -> int:
        """The next batch's number among the run's (its requests' identity): taken in the trainer's thread, in the
        order batches are asked for, never as a pool thread happens to run them."""
        return next(self._batches)

    @classmethod
    def from_config(cls, generation_seed, run_seed, rank: int) -> RequestSeeds:
        return cls(None if generation_seed is None else (int(generation_seed), int(run_seed or 0)), rank)

    def seed(self, identity: tuple) -> int | None:
        if self.base is None:
            return None
        digest = hashlib.sha256(repr((self.base, self.rank, identity)).encode()).digest()
        return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF  # vLLM seeds a request's n choices seed + i

    def sampling(self, sampling: dict, identity: tuple | None) -> dict:
        """`sampling` with this request's seed (unchanged where requests are unseeded)."""
        if self.base is None:
            return sampling
        if identity is None:
            raise RuntimeError("a seeded request sent without its identity: its draws would repeat another's")
        return {**sampling, "seed": self.seed(identity)}


def continued_seed(seed: int | None, done: int) -> int | None:
    """The seed of a cut answer's continuation after `done` tokens: its own draws, not its first part's again."""
    if seed is None:
        return None
    digest = hashlib.sha256(repr((seed, "continued", done)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFFFFFF
