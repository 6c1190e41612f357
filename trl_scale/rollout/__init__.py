"""Rollout over OpenAI-compatible completion servers: the client, TRL's generation interface over it, and a
transformers-backed server (`trl-scale serve`)."""

__all__ = ["RolloutClient", "RolloutError", "ServerRolloutGeneration"]


def __getattr__(name: str):
    # Imported on first use: the client needs only `requests`; the generation interface imports TRL.
    if name in ("RolloutClient", "RolloutError"):
        from . import client

        return getattr(client, name)
    if name == "ServerRolloutGeneration":
        from .generation import ServerRolloutGeneration

        return ServerRolloutGeneration
    raise AttributeError(f"module 'trl_scale.rollout' has no attribute {name!r}")
