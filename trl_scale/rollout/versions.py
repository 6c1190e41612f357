"""The weight version book: the version every server should serve, each server's as last read or synced, and who is
current (only current servers get requests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..routing import ServerState


class VersionBook:
    """Shares the client's condition: a server coming back on the current version wakes requests waiting for one."""

    def __init__(self, servers: list[ServerState], lock: threading.Condition, reader: Callable):
        self.servers = servers
        self._lock = lock
        self.version: str | None = None  # the weights every server should serve; None until the first sync
        self.reader: Callable[[ServerState], str | None] = reader  # a server's version, as it reports it

    def read_with(self, reader: Callable[[ServerState], str | None]) -> None:
        """Read each server's version with `reader` from now on (the weight sync mode's: `WeightSyncer.choose`)."""
        self.reader = reader

    def is_current(self, server: ServerState) -> bool:
        """Serves the current weights (as far as we know): before the first sync every server does."""
        return not server.unchecked and (self.version is None or server.version == self.version)

    def refresh(self, submit: Callable[..., Future], only_unchecked: bool = False) -> None:
        """Read back each server's weight version (concurrently, bounded): a server that restarted reports its
        original version and leaves the rotation until a sync reaches it. Unreachable servers keep what we knew and
        stay unchecked. Only after a first sync: before it, every server serves the initial weights."""
        if self.version is None:
            with self._lock:
                for server in self.servers:
                    server.unchecked = False
            return
        targets = [s for s in self.servers if s.unchecked or not only_unchecked]
        futures = {submit(self.reader, s): s for s in targets}
        for future, server in futures.items():
            try:
                version = future.result(timeout=10)
            except Exception:  # unreachable or not ready: stays as it was, failover handles it
                continue
            with self._lock:
                server.version, server.unchecked = version, False
                self._lock.notify_all()

    def record_sync(self, version: str, took: list[ServerState]) -> None:
        """A sync to `version` reached `took`: they are current; every other server stays out of the rotation until
        a sync (or a catch-up) reaches it."""
        with self._lock:
            self.version = version
            for server in self.servers:
                if server in took:
                    server.version, server.unchecked = version, False
            self._lock.notify_all()

    def rejoin(self, server: ServerState, version: str) -> None:
        """One server caught up to `version` on its own (a restarted server): back in the rotation."""
        with self._lock:
            server.version, server.unchecked, server.down_until = version, False, 0.0
            self._lock.notify_all()
