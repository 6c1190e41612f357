"""The trainer's rollout client over OpenAI-compatible completion servers: the router, weight sync, preflight, TRL's
generation interface over them, asynchronous rollout. The servers themselves are elsewhere: `trl_scale.serve`
(`trl-scale serve`) and `trl_scale.fleet` (managed vLLM servers); this package imports neither."""

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
