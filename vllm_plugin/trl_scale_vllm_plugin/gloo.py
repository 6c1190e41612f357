"""The gloo weight-transfer group, plain torch: the trainer is rank 0 and broadcasts each tensor in the order the
update announced (names, dtype_names, shapes); a server's workers are ranks `rank_offset + i`. Every collective is
bounded by a timeout, so a member that dies mid-broadcast fails the others instead of hanging them.

Used by the vLLM engine (`engine.py`), by `trl-scale serve`, and by the trainer's sender."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BACKEND = "trl_scale_gloo"  # the name servers report in /server_info's weight_transfer_config


@dataclass
class GlooInitInfo:
    """`/init_weight_transfer_engine`'s `init_info` for this backend (the same fields as vLLM's NCCL engine)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False

    def __post_init__(self):
        if self.packed:
            raise ValueError("the trl_scale_gloo engine takes unpacked broadcasts: send packed=false")
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


def receive(group, update: GlooUpdateInfo, timeout: float) -> Iterator[tuple[str, torch.Tensor]]:
    """A server rank's side of one update: the tensors rank 0 broadcasts, in the announced order."""
    delta = datetime.timedelta(seconds=timeout)
    for name, dtype_name, shape in zip(update.names, update.dtype_names, update.shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype_from_name(dtype_name))
        group.broadcast(tensor, 0, delta).wait()
        yield name, tensor


def send(group, tensors, timeout: float) -> None:
    """Rank 0's side: broadcast each tensor, in the announced order."""
    delta = datetime.timedelta(seconds=timeout)
    for tensor in tensors:
        group.broadcast(tensor.detach().contiguous().cpu(), 0, delta).wait()
