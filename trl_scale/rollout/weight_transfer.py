"""The weight-transfer group vLLM's servers join: the trainer is rank 0, server i's workers take ranks
`offsetᵢ .. offsetᵢ + wᵢ - 1` with `offsetᵢ = 1 + Σ_{j<i} wⱼ` and `W = 1 + Σ wᵢ` (vLLM 0.31
`distributed/weight_transfer/nccl_common.py:71-100`: a worker's rank is its index plus `rank_offset`).

Two engines behind the same HTTP calls: vLLM's NCCL engine (trainer side from vLLM's own helpers, so it needs
vLLM and CUDA in the trainer, as TRL's does) and a gloo engine that `trl-scale serve` offers, so the same
orchestration (offsets, ordering, versions, timeouts) runs on CPU. Tensors go out in exactly the order of the
announced `update_info` (names, dtype_names, shapes)."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator

import torch


def group_layout(world_sizes: list[int]) -> tuple[int, list[int]]:
    """World size of the group and each server's rank offset, the trainer being rank 0."""
    offsets, next_rank = [], 1
    for size in world_sizes:
        if size < 1:
            raise ValueError(f"a server reported world_size={size}; expected at least 1")
        offsets.append(next_rank)
        next_rank += size
    return next_rank, offsets


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout: float):
    """A gloo process group outside `torch.distributed`'s default group (the trainer's own ranks keep theirs).
    Rank 0 hosts the rendezvous store; every collective is bounded by `timeout` seconds."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    delta = datetime.timedelta(seconds=timeout)
    store = TCPStore(address, port, world_size, is_master=rank == 0, timeout=delta, wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore("trl-scale-weights/", store), rank, world_size, delta), store


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in update_info.dtype_names")
    return dtype


def receive_gloo(group, names: list[str], dtype_names: list[str], shapes: list[list[int]], timeout: float):
    """A server rank's side of one update: the tensors rank 0 broadcasts, in the announced order."""
    delta = datetime.timedelta(seconds=timeout)
    for name, dtype_name, shape in zip(names, dtype_names, shapes, strict=True):
        tensor = torch.empty(shape, dtype=dtype_from_name(dtype_name))
        group.broadcast(tensor, 0, delta).wait()
        yield name, tensor


class GlooSender:
    """Rank 0 of a gloo weight-transfer group (CPU trainers, `trl-scale serve`)."""

    backend = "gloo"
    packed = False

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.group = self._store = None

    def join(self, address: str, port: int, world_size: int) -> None:
        self.group, self._store = open_gloo_group(address, port, 0, world_size, self.timeout)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        delta = datetime.timedelta(seconds=self.timeout)
        for _, tensor in named_tensors:
            self.group.broadcast(tensor.detach().contiguous().cpu(), 0, delta).wait()

    def close(self) -> None:
        self.group = self._store = None


class NcclSender:
    """Rank 0 of vLLM's NCCL weight-transfer group, from vLLM's own trainer helpers (TRL 1.16 does the same for
    one server, `trl/generation/vllm_client.py:726-777,821-859`)."""

    backend = "nccl"

    def __init__(self, timeout: float):
        check_nccl_sender()
        from packaging.version import Version
        from vllm import __version__ as vllm_version

        self.timeout = timeout
        self.packed = Version(vllm_version) >= Version("0.28")
        self.group = None

    def join(self, address: str, port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": address, "master_port": port, "world_size": world_size})

    def send(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if self.packed:
            from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

            packed_nccl_broadcast_producer(
                iterator=iter(named_tensors), group=self.group, src=0, post_iter_func=lambda item: item[1]
            )
            return
        stream = torch.cuda.current_stream()
        for _, tensor in named_tensors:
            self.group.broadcast(tensor.contiguous().cuda(), src=0, stream=stream)
        stream.synchronize()

    def close(self) -> None:
        self.group = None


def check_nccl_sender() -> None:
    """vLLM's NCCL engine needs vLLM and a CUDA device in the trainer: say so, with the alternatives."""
    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device in this process")
    try:
        import vllm  # noqa: F401
    except ImportError:
        problems.append("vllm is not installed here (pip install vllm)")
    if problems:
        raise RuntimeError(
            "weight_sync='nccl' joins the servers' NCCL weight-transfer group as rank 0, as TRL does, which needs "
            f"vLLM and CUDA in the trainer: {'; '.join(problems)}. Fix: install vllm on a CUDA trainer, or use "
            "weight_sync='shared_dir' (a directory the servers can read; works from a CPU trainer) or 'lora'"
        )


def make_sender(backend: str, timeout: float):
    if backend == "gloo":
        return GlooSender(timeout)
    if backend == "nccl":
        return NcclSender(timeout)
    raise RuntimeError(
        f"the servers' weight-transfer backend is {backend!r}; trl-scale drives 'nccl' (vLLM) and 'gloo' "
        '(trl-scale serve). Fix: start vLLM with --weight-transfer-config \'{"backend":"nccl"}\', or use '
        "weight_sync='shared_dir'"
    )
