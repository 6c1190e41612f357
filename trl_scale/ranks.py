"""Several trainer processes, one outcome: "the main process decides, every rank learns", written once.

- `is_main_process()`: rank 0 of the torch.distributed group, else by the launcher's `RANK`, else True (one process).
  It never imports torch just to ask (logging uses it at import time of the CLI).
- `agree(local)`: every rank runs its own part (`local`, e.g. the main process calls the servers while the others
  walk their parameter shards); the outcomes are combined, and if any rank failed every rank raises that failure:
  the same exception type as with one process, its message naming the rank. No rank goes on while another failed,
  and none waits for a collective that will never come.
- `decide_on_main(fn)`: `fn` runs on the main process, and every rank gets its result (or its exception).
With one process (no group) each runs in place and raises the original exception.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def _group():
    """torch.distributed when a group of more than one process is initialised, else None."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def is_main_process() -> bool:
    dist = _group()
    if dist is not None:
        return dist.get_rank() == 0
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def world_size() -> int:
    dist = _group()
    return 1 if dist is None else dist.get_world_size()


def gathered(value: T) -> list[T]:
    """Every rank's `value`, in rank order (a collective: every rank calls it; `[value]` with one process)."""
    dist = _group()
    if dist is None:
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def broadcast_from_main(value: Any) -> Any:
    """The main process's `value` on every rank (a collective: every rank calls it; in place with one process)."""
    dist = _group()
    if dist is None:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _sendable(error: BaseException) -> BaseException:
    """The exception itself where it survives pickling (its type kept), else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def _naming_rank(error: BaseException, rank: int, size: int) -> BaseException:
    if error.args and isinstance(error.args[0], str):
        error.args = (f"on rank {rank} of {size}: {error.args[0]}", *error.args[1:])
    else:
        error.args = (f"on rank {rank} of {size}: {error!r}",)
    return error


def agree(local: Callable[[], T]) -> T:
    """Run this rank's part; if any rank's part raised, raise (on every rank) the failure of the lowest such rank,
    naming it. Returns this rank's own result. A collective: every rank calls it, in the same order."""
    try:
        result, failure = local(), None
    except Exception as error:
        result, failure = None, error
    dist = _group()
    if dist is None:
        if failure is not None:
            raise failure
        return result
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if failure is None else _sendable(failure))
    failed = [(rank, error) for rank, error in enumerate(outcomes) if error is not None]
    if failed:
        rank, error = failed[0]
        if rank == dist.get_rank() and failure is not None and _sendable(failure) is failure:
            raise _naming_rank(failure, rank, len(outcomes))
        raise _naming_rank(error, rank, len(outcomes)) from failure
    return result


def decide_on_main(fn: Callable[[], T]) -> T:
    """`fn` on the main process only; every rank gets its result, or raises its exception (`agree`'s rules)."""
    main = is_main_process()
    return broadcast_from_main(agree(fn if main else lambda: None))


def run_on_main(fn: Callable[[], T]) -> T | None:
    """`fn` on the main process only (e.g. to start something only it holds); its result there, None elsewhere. If
    it raises, every rank raises the same error."""
    main = is_main_process()
    return agree(fn if main else lambda: None)


def decide_on_leader(fn: Callable[[], T], group: Any = None) -> T:
    """`fn` on rank 0 of `group` (a torch process group; None: the call runs in place), whose result, or exception,
    every rank of the group gets: e.g. one request for the ranks of a sequence-parallel group, which train on the
    same batch. A collective over `group` only."""
    if group is None:
        return fn()
    import torch.distributed as dist

    payload: list = [None]
    if dist.get_rank(group) == 0:
        try:
            payload[0] = (fn(), None)
        except Exception as error:
            payload[0] = (None, _sendable(error))
            dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
            raise
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    result, failure = payload[0]
    if failure is not None:
        raise _naming_rank(failure, dist.get_global_rank(group, 0), dist.get_world_size())
    return result
