"""The critic's Ray worker (`CriticWorker`, on the role workers' base): a `CriticUpdater` in a Ray actor, its values
and updates over `RoleRows`, its state for checkpoints. Several workers of one group join their own process group and
start from rank 0's weights; with `sharding="fsdp2"` they then shard the critic over it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..distributed.role_workers import RoleRows, RoleWorker
from .base import CriticBatch, CriticSettings


@dataclass(frozen=True)
class CriticWorkerSettings:
    """A critic worker: its updater's settings, the seed of a new value head (as the local critic's), and how its
    group holds the critic across workers (FSDP2 needs the group's process group: with several workers only)."""

    updater: CriticSettings
    seed: int
    sharding: Literal["fsdp2", "replicated"] = "replicated"

    @staticmethod
    def worker_class() -> type:
        return CriticWorker


class CriticWorker(RoleWorker):
    """Its state (weights, optimizer) lives here, so a dead worker is not replaced: the run stops naming the role and
    the last checkpoint resumes it."""

    stateless = False
    uses_process_group = True

    def __init__(self, role: str, model_path: str, settings: CriticWorkerSettings):
        super().__init__(role, settings)
        from .updater import CriticUpdater, load_critic

        critic = load_critic(model_path, settings.seed).to(self.device)
        # Replicated until the group's process group exists (`init_process_group`): FSDP2 shards over it.
        self.updater = CriticUpdater(critic, settings.updater)
        self.sharding = settings.sharding

    def joined_group(self) -> None:
        """Start from rank 0's weights, then shard over the group (FSDP2)."""
        import torch.distributed as dist

        from .updater import CriticUpdater

        with torch.no_grad():
            for parameter in self.updater.critic.parameters():
                dist.broadcast(parameter.data, src=0)
        if self.sharding != "replicated":
            self.updater = CriticUpdater(self.updater.critic, self.settings.updater, sharding=self.sharding)

    def values(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        out = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            images = piece.model_images(self.device)
            out.append(
                self.updater.values(input_ids, attention_mask, piece.prompt_len, piece.num_tokens, images).cpu()
            )
        return out

    def step(self, pieces: list[RoleRows], train: bool) -> list[tuple[torch.Tensor, dict]]:
        """One micro-step of the critic over every piece (one per trainer rank): backward on each, then a single
        optimizer step at the end of the accumulation window."""
        results = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            old_values, returns, mask = (t.to(self.device) for t in (piece.old_values, piece.returns, piece.mask))
            batch = CriticBatch(
                input_ids, attention_mask, piece.prompt_len, old_values, returns, mask,
                multimodal_inputs=piece.model_images(self.device), loss_scale=piece.loss_scale,
            )  # fmt: skip
            loss, stats = self.updater.loss_and_backward(batch, train)
            results.append((loss.cpu(), {k: v.cpu() for k, v in stats.items()}))
        if train:
            self.updater.end_micro_step()
        return results

    def set_scheduler(self, *args):
        self.updater.set_scheduler(*args)

    def state(self, with_weights: bool = True):
        return self.updater.state(with_weights)

    def shard_bytes(self) -> dict[str, int]:
        return self.updater.shard_bytes()

    def load_state(self, state):
        self.updater.load_state(state)
