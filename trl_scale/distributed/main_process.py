"""Several trainer processes, one set of role groups: the main process (global rank 0) owns the Ray groups, and
these collectives route every rank's work through it.

Each call gathers every rank's payload to the main process, which makes one call to its groups and sends each rank
its own part of the answer. A failure on the main process (a dead worker, a timeout) reaches every rank as the
same exception, so no rank waits on a collective that will never come. With one process (no process group) the
calls run in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ranks import is_main_process, run_on_main, world_size

__all__ = ["PendingOnMain", "call_on_main", "is_main_process", "run_on_main", "start_on_main", "world_size"]


class _Failure:
    """An exception raised on the main process, sent to the ranks in place of their results."""

    def __init__(self, error: BaseException):
        self.error = error


def _process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _gather_to_main(payload: Any) -> list | None:
    dist = _process_group()
    if dist is None:
        return [payload]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    return gathered


def _scatter_from_main(parts: list | None) -> Any:
    dist = _process_group()
    if dist is None:
        part = parts[0]
    else:
        received = [None]
        dist.scatter_object_list(received, parts if dist.get_rank() == 0 else None, src=0)
        part = received[0]
    if isinstance(part, _Failure):
        raise part.error
    return part


class PendingOnMain:
    """A call started on the main process for every rank; ``result()`` (a collective) gives this rank its part."""

    def __init__(self, finish: Callable[[], list] | None, failure: _Failure | None = None):
        self._finish, self._failure = finish, failure

    def result(self) -> Any:
        parts = None
        if is_main_process():
            if self._failure is None:
                try:
                    parts = self._finish()
                except Exception as error:  # sent to every rank
                    self._failure = _Failure(error)
            if self._failure is not None:
                parts = [self._failure] * world_size()
        return _scatter_from_main(parts)


def start_on_main(payload: Any, start: Callable[[list], Callable[[], list]]) -> PendingOnMain:
    """Gather each rank's ``payload`` to the main process and ``start(payloads)`` there, which launches the work
    and returns a function that waits for it and gives one result per rank. Returns at once, so the caller can
    overlap its own work; every rank must call ``result()`` on the handle, in the same order."""
    payloads = _gather_to_main(payload)
    if not is_main_process():
        return PendingOnMain(None)
    try:
        return PendingOnMain(start(payloads))
    except Exception as error:  # reported on every rank by result()
        return PendingOnMain(None, _Failure(error))


def call_on_main(payload: Any, fn: Callable[[list], list]) -> Any:
    """Gather each rank's ``payload`` to the main process, run ``fn(payloads) -> one result per rank`` there, and
    return this rank's result (a collective: every rank calls it, in the same order)."""
    return start_on_main(payload, lambda payloads: lambda: fn(payloads)).result()
