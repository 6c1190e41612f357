"""PPO's critic, one package: the interface the trainer talks to (`Critic`) and its settings (`base`), the update
(`updater.CriticUpdater`: values, clipped value loss, accumulation, stepping), how it is held across ranks
(`holders`: replicated, a DeepSpeed engine, FSDP2), the critic on a Ray role group (`ray.RayCritic`) and the one
factory that picks and builds it (`factory.build_critic`)."""

from .base import Critic, CriticSettings, PendingCriticStep
from .factory import BuiltCritic, build_critic
from .updater import CriticUpdater, completion_values, load_critic

__all__ = [
    "BuiltCritic",
    "Critic",
    "CriticSettings",
    "CriticUpdater",
    "PendingCriticStep",
    "build_critic",
    "completion_values",
    "load_critic",
]
