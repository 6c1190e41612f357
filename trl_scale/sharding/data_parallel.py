"""A sequence-parallel group as one data-parallel rank.

Under sequence parallelism (`sequence_parallel_size` = sp > 1) the ranks of an SP group (sp consecutive ranks, as
DeepSpeed lays them out) share every sequence of one batch: data parallelism is `world / sp`. TRL's trainers know
one kind of rank, so trl-scale shows them the data-parallel one: the trainer's `Accelerator` answers
`num_processes` (world / sp) and `process_index` (the group's index) as a data-parallel run of that size would, so
accelerate shards the data loader by group and TRL's per-process slices and normalisers are a group's; its
`gather` / `reduce` / `gather_for_metrics` take one copy per group (every rank of a group holds the same values),
as do TRL's module-level `gather` / `gather_object` while :func:`data_parallel_gathers` is active. The gradients
need nothing: every rank of a group computes the group's loss, the scoring engine's summing all-reduce gives each
rank `sp` x its slice's share, and averaging over all `world` ranks (DDP, DeepSpeed) is then the average over the
groups of each group's whole-batch gradient (see `trl_scale.scoring.sequence_parallel`).

DeepSpeed itself keeps the world view (its batch-size check counts every rank that averages gradients).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def one_copy_per_group(gathered: torch.Tensor, world: int, sp_size: int) -> torch.Tensor:
    """From a tensor gathered over `world` ranks (each rank's part stacked along dim 0, as accelerate's `gather`
    does; a scalar gives one row per rank), the parts of rank 0 of each SP group of `sp_size` consecutive ranks."""
    per_rank = gathered.reshape(world, -1, *gathered.shape[1:])
    return per_rank[::sp_size].reshape(-1, *gathered.shape[1:])


def objects_one_copy_per_group(objects: list, sp_size: int) -> list:
    """accelerate's `gather_object` over data-parallel ranks: every rank's list, one per group, flattened."""
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size == 1:
        return list(objects)
    everyone: list = [None] * size
    dist.all_gather_object(everyone, objects)
    return [item for per_rank in everyone[::sp_size] for item in per_rank]


class DataParallelAccelerator:
    """Mixed into the trainer's `Accelerator` (see :func:`share_batches_within_groups`): ranks and collectives of
    the data-parallel view."""

    sequence_parallel_size: int = 1
    _world_view: bool = False  # inside `_prepare_deepspeed`: DeepSpeed counts every rank

    @property
    def num_processes(self) -> int:
        world = self.state.num_processes
        return world if self._world_view else world // self.sequence_parallel_size

    @property
    def process_index(self) -> int:
        rank = self.state.process_index
        return rank if self._world_view else rank // self.sequence_parallel_size

    @property
    def is_last_process(self) -> bool:
        return self.state.process_index == self.state.num_processes - 1

    def gather(self, tensor):
        from accelerate.utils import recursively_apply

        gathered = super().gather(tensor)
        world, sp = self.state.num_processes, self.sequence_parallel_size
        return recursively_apply(lambda t: one_copy_per_group(t, world, sp), gathered)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        from accelerate.utils import recursively_apply

        def reduced(value: torch.Tensor) -> torch.Tensor:
            per_group = self.gather(value.unsqueeze(0))  # [groups, ...]
            total = per_group.sum(0) if reduction == "sum" else per_group.mean(0)
            return total * scale if reduction in ("sum", "mean") else value

        return recursively_apply(reduced, tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        from accelerate.utils import recursively_apply

        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object:
            data = objects_one_copy_per_group(input_data, self.sequence_parallel_size)
        else:
            data = self.gather(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:  # the last batch's duplicated samples (accelerate's rule)
            cut = state.remainder
            return data[:cut] if use_gather_object else recursively_apply(lambda t: t[:cut], data)
        return data

    def _prepare_deepspeed(self, *args):
        self._world_view = True  # DeepSpeed's batch-size check counts every rank that averages gradients ...
        try:
            return super()._prepare_deepspeed(*args)
        finally:
            self._world_view = False

    def prepare_data_loader(self, *args, **kwargs):
        world, self._world_view = self._world_view, False  # ... but its data loaders are sharded by group
        try:
            return super().prepare_data_loader(*args, **kwargs)
        finally:
            self._world_view = world


def share_batches_within_groups(accelerator, sp_size: int):
    """Give `accelerator` the data-parallel view of SP groups of `sp_size` ranks (in place; returns it). Before
    the data loader is prepared (the trainer's `train()` prepares it)."""
    if sp_size <= 1 or isinstance(accelerator, DataParallelAccelerator):
        return accelerator
    world = accelerator.state.num_processes
    if world % sp_size:
        raise ValueError(f"sp_size={sp_size} does not divide the {world} processes")
    accelerator.__class__ = type(
        f"DataParallel{type(accelerator).__name__}", (DataParallelAccelerator, type(accelerator)), {}
    )
    accelerator.sequence_parallel_size = sp_size
    return accelerator


@contextmanager
def data_parallel_gathers(accelerator, *modules: Any):
    """Within the block, the `gather` / `gather_object` that `modules` (TRL's trainer modules) imported from
    accelerate take one copy per SP group, as the accelerator's own do. Nothing changes without the view."""
    if not isinstance(accelerator, DataParallelAccelerator):
        yield
        return
    sp = accelerator.sequence_parallel_size
    replaced = {"gather": accelerator.gather, "gather_object": lambda objects: objects_one_copy_per_group(objects, sp)}
    saved = [(module, name, getattr(module, name)) for module in modules for name in replaced if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, replaced[name])
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def writes_group_files(accelerator) -> bool:
    """Whether this rank writes its data-parallel rank's own checkpoint files (named by `process_index`): under
    the view, rank 0 of each SP group does (its ranks hold the same state, and two writers of one file race)."""
    if not isinstance(accelerator, DataParallelAccelerator):
        return True
    return accelerator.state.process_index % accelerator.sequence_parallel_size == 0


def draw_like_group_leader(group, rank: int) -> None:
    """Give every rank of an SP group (`group`, a process group; this rank is `rank` in it) the random state of its
    rank 0: they run the same steps on the same batch, so they must draw the same numbers (TRL seeds each process
    apart, `set_seed(seed, device_specific=True)`, and shuffles each generation batch with it). Rank 0 keeps its
    own, so a group draws what a data-parallel rank of that index draws without sequence parallelism."""
    import random

    import numpy as np

    state: list = [None]
    if rank == 0:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        state[0] = (torch.get_rng_state(), cuda, random.getstate(), np.random.get_state())
    dist.broadcast_object_list(state, src=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        cpu, cuda, python, numpy_state = state[0]
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(python)
        np.random.set_state(numpy_state)
