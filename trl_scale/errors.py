"""Errors shared by the parts that must not import each other (the rollout client, the fleet of servers)."""

from __future__ import annotations


class RolloutError(RuntimeError):
    """A rollout, weight sync or server fleet that cannot go on; the message names the servers and the cause."""
