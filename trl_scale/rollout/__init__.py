"""Rollout over OpenAI-compatible completion servers: the client, TRL's generation interface over it, and a
transformers-backed server (`trl-scale serve`)."""

from .client import RolloutClient, RolloutError
from .generation import ServerRolloutGeneration

__all__ = ["RolloutClient", "RolloutError", "ServerRolloutGeneration"]
