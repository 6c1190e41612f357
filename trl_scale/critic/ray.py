"""The critic on its own Ray role group (`backend="ray"`), behind the `Critic` interface PPOTrainer uses.

Started and called by the main trainer process only; every rank's rows are gathered to it, split over the group's
workers (each a `CriticWorker` holding a `CriticUpdater`), and the results go back to each rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..distributed.main_process import call_on_main, run_on_main, start_on_main
from ..distributed.ray_backend import RoleGroup, init_ray
from ..distributed.role_workers import RoleRows
from ..distributed.roles import per_row_forward, saved_model_dir
from ..distributed.row_images import RowImages
from ..scoring.packing import UnpaddedRows
from .base import CriticBatch, CriticSettings
from .holders import read_optimizer_files, write_optimizer_files
from .worker import CriticWorkerSettings


class _MovedTo:
    """A pending result whose tensors land on `device` when it is collected."""

    def __init__(self, pending, device):
        self.pending, self.device = pending, device

    def result(self):
        loss, stats = self.pending.result()
        return loss.to(self.device), {k: v.to(self.device) for k, v in stats.items()}


class RayCritic:
    """The `CriticUpdater` interface, served by a critic role group held by the main trainer process.

    Every rank's rows are gathered to the main process, which splits each rank's rows over the group's workers.
    Each shard's loss is weighted by its share of its rank's tokens and by 1/num_ranks, and the workers average
    their gradients, so one worker step equals the local backend's update (every rank's critic averaging its
    gradients over the ranks)."""

    def __init__(self, group: RoleGroup | None):
        self.group = group  # None on every process but the main one
        self.scheduler = None  # set once the step count is known (the workers hold the real one)
        self.grad_norm = None  # the workers step the critic: not measured in the trainer

    def values(
        self, input_ids, attention_mask, prompt_len: int, num_tokens: int, multimodal_inputs: dict | None = None
    ) -> torch.Tensor:
        rows = UnpaddedRows.from_padded(input_ids, attention_mask)
        images = RowImages.from_kwargs(multimodal_inputs or {}, input_ids.size(0))  # each worker its rows' own
        piece = RoleRows(rows, prompt_len, num_tokens, images=images)
        return call_on_main(piece, lambda pieces: per_row_forward(self.group, "values", pieces)).to(input_ids.device)

    def step_async(self, batch: CriticBatch, train: bool = True):
        """Start the critic's update on its group and return at once; `.result()` waits (bounded) for it, so the
        policy's update runs meanwhile. A collective: every rank calls it, then `.result()`, in the same order."""
        piece = RoleRows(
            UnpaddedRows.from_padded(batch.input_ids, batch.attention_mask),
            batch.prompt_len,
            batch.mask.size(1),
            batch.old_values.detach().cpu(),
            batch.returns.detach().cpu(),
            batch.mask.detach().cpu(),
            batch.loss_scale,
            RowImages.from_kwargs(batch.multimodal_inputs or {}, batch.input_ids.size(0)),
        )
        pending = start_on_main(piece, lambda pieces: self._start_step(pieces, train))
        return _MovedTo(pending, batch.input_ids.device)

    def _start_step(self, pieces: list[RoleRows], train: bool):
        workers = self.group.workers
        shards, weights = [], []
        for piece in pieces:
            parts = piece.split(len(workers))
            total = piece.mask.sum().clamp(min=1.0).item()
            shares = [part.mask.sum().item() / total for part in parts]
            scale = piece.loss_scale * len(workers) / len(pieces)  # the trainer rank's weight, averaged over ranks
            shards.append([replace(p, loss_scale=w * scale) for p, w in zip(parts, shares)])
            weights.append(shares)
        collect = self.group.start_map("step", [([s[k] for s in shards], train) for k in range(len(workers))])

        def finish() -> list[tuple[torch.Tensor, dict]]:
            per_worker = collect()  # [worker][piece] -> (loss, stats)
            results = []
            for p, shares in enumerate(weights):
                parts = [per_worker[k][p] for k in range(len(workers))]
                loss = sum(w * part[0] for w, part in zip(shares, parts))
                stats = {key: sum(w * part[1][key] for w, part in zip(shares, parts)) for key in parts[0][1]}
                results.append((loss, stats))
            return results

        return finish

    def step(self, batch: CriticBatch, train: bool = True):
        return self.step_async(batch, train).result()

    # Called on every rank; only the main process talks to the group, and its errors reach every rank.
    def set_scheduler(self, scheduler_type: str, num_warmup_steps: int, num_training_steps: int, kwargs=None) -> None:
        args = (scheduler_type, num_warmup_steps, num_training_steps, kwargs)
        run_on_main(lambda: self.group.call_all("set_scheduler", *args))
        self.scheduler = True

    def state(self, with_weights: bool = True) -> dict | None:
        """The critic's state on the main process, None elsewhere. Replicas are identical: the first worker's.
        Sharded, gathering is a collective of all workers, and the first one holds the whole."""

        def fetch() -> dict:
            if self.group.settings.sharding == "replicated":
                return self.group.call("state", with_weights)
            return self.group.call_all("state", with_weights)[0]

        return run_on_main(fetch)

    def load_state(self, state: dict) -> None:
        run_on_main(lambda: self.group.call_all("load_state", state))

    def worker_shard_bytes(self) -> list[dict[str, int]] | None:
        """What each critic worker holds of the critic's parameters and AdamW state (main process; None elsewhere)."""
        return run_on_main(lambda: self.group.call_all("shard_bytes"))

    def shard_bytes(self) -> dict[str, int]:
        """The trainer processes hold nothing of a critic on its group."""
        return {"parameters": 0, "optimizer": 0}

    def weights(self) -> dict | None:
        state = self.state()
        return state["model"] if state is not None else None

    def save_training_state(self, directory: str, is_main_process: bool) -> None:
        """The workers' optimizer and scheduler, in the files a local replicated critic writes (not the weights:
        `save_model` fetched those for the same checkpoint)."""
        state = self.state(with_weights=False)
        if is_main_process:
            write_optimizer_files(directory, state["optimizer"], state["scheduler"])

    def load_training_state(self, directory: str, weights: dict) -> None:
        optimizer, scheduler = read_optimizer_files(directory)
        self.load_state({"model": weights, "optimizer": optimizer, "scheduler": scheduler})


def start_critic(model_source: Callable[[], Any], settings: CriticSettings, args, check=None) -> RayCritic:
    """The critic group for a trainer with ``args`` (its `DistributedArguments`), started by the main process from
    ``model_source()`` (a path or a model object, built there only; ``check(path)`` validates it first). Every rank
    gets a `RayCritic`; a failure to start reaches every rank."""

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        path = saved_model_dir(model_source(), "trl-scale-critic-")
        if check is not None:
            check(path)
        placement = args.placement("critic")
        # the seed of a new value head, as locally; FSDP2 needs the workers' process group, so only with several
        sharding = placement.sharding if placement.num_workers > 1 else "replicated"
        worker_settings = CriticWorkerSettings(updater=settings, seed=args.seed, sharding=sharding)
        return RoleGroup("critic", path, placement, worker_settings, timeout=args.ray_call_timeout)

    return RayCritic(run_on_main(start))
