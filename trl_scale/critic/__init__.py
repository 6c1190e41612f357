"""PPO's critic, one package: the interface the trainer talks to (`Critic`), its settings and the batch of one
update (`CriticBatch`) (`base`), the update (`updater.CriticUpdater`: values, clipped value loss, accumulation,
stepping), how it is held across ranks (`holders`: replicated, a DeepSpeed engine, FSDP2), the critic on a Ray role
group (`ray.RayCritic`; its actors: `worker.CriticWorker`) and the one factory that picks and builds it
(`factory.build_critic`)."""

from .base import Critic, CriticBatch, CriticSettings, PendingCriticStep
from .factory import BuiltCritic, build_critic
from .updater import CriticUpdater, completion_values, load_critic

__all__ = [
    "BuiltCritic",
    "Critic",
    "CriticBatch",
    "CriticSettings",
    "CriticUpdater",
    "PendingCriticStep",
    "build_critic",
    "completion_values",
    "load_critic",
]
