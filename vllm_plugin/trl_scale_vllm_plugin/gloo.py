"""The gloo weight-transfer group, plain torch: the trainer is rank 0 and broadcasts the tensors in the order the
update announced (names, dtype_names, shapes); a server's workers are ranks `rank_offset + i`. Every collective is
bounded by a timeout, so a member that dies mid-broadcast fails the others instead of hanging them.

The tensors travel in buckets, cut as vLLM's packed NCCL transfer cuts them (`packed_tensor.py`: a bucket closes once
it holds more than `packed_buffer_size_bytes`): packed, a bucket is one broadcast of its bytes; unpacked, one
broadcast per tensor. Either way a receiver loads a whole bucket at once, after its broadcasts: loading tensor by
tensor between broadcasts held every member of the group (the trainer and every other server) at each tensor for
the slowest server's load (a 6-layer toy over two vLLM servers synced in 1.21 s; 0.40 s packed).

Used by the vLLM engine (`engine.py`), by `trl-scale serve`, and by the trainer's sender."""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

BACKEND = "trl_scale_gloo"  # the name servers report in /server_info's weight_transfer_config
BUFFER_BYTES = 1024**3  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
T = TypeVar("T")


@dataclass
class GlooInitInfo:
    """`/init_weight_transfer_engine`'s `init_info` for this backend (the same fields as vLLM's NCCL engine)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = BUFFER_BYTES

    def __post_init__(self):
        size = self.packed_buffer_size_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"packed_buffer_size_bytes={size!r}: use a whole number of bytes >= 1")
        if self.rank_offset < 1 or self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} does not fit a group of world_size={self.world_size}")


@dataclass
class GlooUpdateInfo:
    """`/update_weights`'s `update_info`: what rank 0 is about to broadcast, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("`names`, `dtype_names` and `shapes` must have the same length")


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout: float):
    """A gloo process group outside `torch.distributed`'s default group (a trainer's own ranks keep theirs).
    Rank 0 hosts the rendezvous store. Returns `(group, store)`: keep the store alive as long as the group."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    delta = datetime.timedelta(seconds=timeout)
    store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=delta, wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("trl-scale-weights/", store), rank, world_size, delta), store


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in update_info.dtype_names")
    return dtype


def _cut(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive items in buckets, vLLM's packed rule: a bucket closes once its bytes exceed `limit`. The one rule
    both sides cut by (the receiver from the announced sizes, the sender as the tensors come)."""
    bucket, held = [], 0
    for item in items:
        bucket.append(item)
        held += size(item)
        if held > limit:
            yield bucket
            bucket, held = [], 0
    if bucket:
        yield bucket


def buckets(sizes: list[int], limit: int) -> list[range]:
    """Tensor indices per bucket, for tensors of `sizes` bytes."""
    return [range(cut[0], cut[-1] + 1) for cut in _cut(range(len(sizes)), sizes.__getitem__, limit)]


def receive(
    group, update: GlooUpdateInfo, timeout: float, packed: bool = False, limit: int = BUFFER_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A server rank's side of one update: rank 0's tensors, in the announced order, a bucket at a time."""
    delta = datetime.timedelta(seconds=timeout)
    dtypes = [dtype_from_name(name) for name in update.dtype_names]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update.shapes, dtypes)]
    for bucket in buckets(sizes, limit):
        if not packed:
            tensors = [torch.empty(update.shapes[i], dtype=dtypes[i]) for i in bucket]
            for tensor in tensors:
                group.broadcast(tensor, 0, delta).wait()
            yield [(update.names[i], tensor) for i, tensor in zip(bucket, tensors)]
            continue
        flat = torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8)
        group.broadcast(flat, 0, delta).wait()
        received, offset = [], 0
        for i in bucket:
            part = flat[offset : offset + sizes[i]]
            if offset % dtypes[i].itemsize:  # a view as a wider type must start on its alignment
                part = part.clone()
            received.append((update.names[i], part.view(dtypes[i]).reshape(update.shapes[i])))
            offset += sizes[i]
        yield received


def send(group, tensors, timeout: float, packed: bool = False, limit: int = BUFFER_BYTES) -> None:
    """Rank 0's side: the tensors in the announced order, cut into the receivers' buckets."""
    delta = datetime.timedelta(seconds=timeout)
    if not packed:
        for tensor in tensors:
            group.broadcast(tensor.detach().contiguous().cpu(), 0, delta).wait()
        return
    flat = (tensor.detach().cpu().reshape(-1).view(torch.uint8) for tensor in tensors)
    for bucket in _cut(flat, torch.Tensor.numel, limit):
        group.broadcast(torch.cat(bucket), 0, delta).wait()
