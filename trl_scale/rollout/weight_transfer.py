"""The weight-transfer group vLLM's servers join: the trainer is rank 0, server i's workers take ranks
`offsetᵢ .. offsetᵢ + wᵢ - 1` with `offsetᵢ = 1 + Σ_{j<i} wⱼ` and `W = 1 + Σ wᵢ` (vLLM 0.31
`distributed/weight_transfer/nccl_common.py:71-100`: a worker's rank is its index plus `rank_offset`).

Two engines behind the same HTTP calls: vLLM's NCCL engine (trainer side from vLLM's own helpers, so it needs
vLLM and CUDA in the trainer, as TRL's does) and the `trl_scale_gloo` engine (package `trl_scale_vllm_plugin`), which
real vLLM loads as a plugin and `trl-scale serve` runs too, so the same orchestration (offsets, ordering, versions,
timeouts) runs on CPU against real vLLM. Tensors go out in exactly the order of the announced `update_info`
(names, dtype_names, shapes)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from trl_scale_vllm_plugin.gloo import BACKEND as GLOO_BACKEND
from trl_scale_vllm_plugin.gloo import BUFFER_BYTES, open_gloo_group, send


def group_layout(world_sizes: list[int]) -> tuple[int, list[int]]:
    """World size of the group and each server's rank offset, the trainer being rank 0."""
    offsets, next_rank = [], 1
    for size in world_sizes:
        if size < 1:
            raise ValueError(f"a server reported world_size={size}; expected at least 1")
        offsets.append(next_rank)
        next_rank += size
    return next_rank, offsets


class GlooSender:
    """Rank 0 of a `trl_scale_gloo` weight-transfer group (CPU trainers; vLLM with the plugin, `trl-scale serve`)."""

    backend = GLOO_BACKEND

    def __init__(self, timeout: float, packed: bool = True, buffer_bytes: int = BUFFER_BYTES):
        self.timeout, self.packed, self.buffer_bytes = timeout, packed, buffer_bytes
        self.group = self._store = None

    def wire(self) -> dict:
        """The wire fields of `/init_weight_transfer_engine`'s init_info: both sides cut the same buckets."""
        return {"packed": self.packed, "packed_buffer_size_bytes": self.buffer_bytes}

    def join(self, address: str, port: int, world_size: int) -> None:
        self.group, self._store = open_gloo_group(address, port, 0, world_size, self.timeout)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        send(self.group, (tensor for _, tensor in named_tensors), self.timeout, self.packed, self.buffer_bytes)

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

    def wire(self) -> dict:
        return {"packed": self.packed}  # vLLM's default bucket size on both sides

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
    if backend == GLOO_BACKEND:
        return GlooSender(timeout)
    if backend == "nccl":
        return NcclSender(timeout)
    raise RuntimeError(
        f"the servers' weight-transfer backend is {backend!r}; trl-scale drives 'nccl' (vLLM's) and "
        f"'{GLOO_BACKEND}' (trl-scale's vLLM plugin, and trl-scale serve). Fix: start vLLM with "
        '--weight-transfer-config \'{"backend":"nccl"}\' (CUDA trainer) or \'{"backend":"trl_scale_gloo"}\' (with '
        "the plugin: pip install trl-scale-vllm-plugin), or use weight_sync='shared_dir'"
    )
