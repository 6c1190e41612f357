"""Which server takes a request, for every client of a set of HTTP servers (the rollout router, the remote reward
client): the servers' routing state, the routing policies (one chosen by name) and the rotation.

A policy only orders and picks among the usable servers (in the rotation, not excluded, and whatever the caller adds,
such as current weights); the rotation holds the lock, counts what is in flight, takes a failing server out for
`retry_after` seconds and waits when the policy picks none."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from .logs import get_logger

logger = get_logger(__name__)


@dataclass
class ServerState:
    url: str
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    version: str | None = None  # the weight version this server reported or took last
    unchecked: bool = False  # failed since its version was last read: it may have restarted
    last_error: str = ""
    latency: float = 0.0  # moving average of seconds per request (0 until measured: tried first)
    measured_at: float = 0.0  # time.monotonic() of its last measurement (an old estimate is forgotten)
    world_size: int = 0  # ranks it brings to the weight-transfer group (0: not read yet)
    busy_seconds: float = 0.0  # time with at least one request in flight, up to `busy_since` where one is
    busy_since: float = 0.0  # time.monotonic() its in-flight requests went from none to one

    def busy_until(self, now: float) -> float:
        """Its busy seconds so far, the current stretch counted up to `now`."""
        return self.busy_seconds + (now - self.busy_since if self.outstanding > 0 else 0.0)


class RoutingPolicy(Protocol):
    """Called under the client's lock."""

    def pick(self, usable: list[ServerState], cap: int, backlog: int, now: float) -> ServerState | None:
        """The server to send one request to now, or None to wait for one to free up (`cap`: in-flight requests
        per server; `backlog`: requests submitted and not yet sent)."""

    def observe(self, server: ServerState, seconds: float, now: float) -> None:
        """A request to `server` took `seconds`."""


class LatencyRouting:
    """Free servers (below their in-flight cap) are tried fastest first (observed latency). A slower one takes the
    request only if it would finish it before the faster servers could clear the backlog of requests not yet
    dispatched; otherwise the request waits for a faster server. With a long queue every server works; at the tail
    a slow server is not handed the request that would finish last."""

    # Seconds a latency estimate is trusted unrenewed: a server measured slow gets nothing while faster ones keep up,
    # so one slow for a while would idle for the rest of the run. Forgotten, it is tried again as an unmeasured one.
    LATENCY_MEMORY = 10.0

    def latency(self, server: ServerState, now: float) -> float:
        return server.latency if now - server.measured_at <= self.LATENCY_MEMORY else 0.0

    def pick(self, usable: list[ServerState], cap: int, backlog: int, now: float) -> ServerState | None:
        latency = {s.url: self.latency(s, now) for s in usable}
        free = sorted(
            (s for s in usable if s.outstanding < cap), key=lambda s: (latency[s.url], s.outstanding, s.served)
        )
        for server in free:
            mine = latency[server.url]
            faster = [t for t in usable if 0.0 < latency[t.url] < mine]
            rate = sum(cap / latency[t.url] for t in faster)
            if mine == 0.0 or not faster or mine <= max(1, backlog) / rate:
                return server
        return None

    def observe(self, server: ServerState, seconds: float, now: float) -> None:
        known = self.latency(server, now) > 0.0
        server.measured_at = now
        server.latency = 0.7 * server.latency + 0.3 * seconds if known else seconds


class LeastOutstandingRouting:
    """The free server with the fewest requests in flight (then the fewest served): an even split, blind to speed."""

    def pick(self, usable: list[ServerState], cap: int, backlog: int, now: float) -> ServerState | None:
        free = [s for s in usable if s.outstanding < cap]
        return min(free, key=lambda s: (s.outstanding, s.served), default=None)

    def observe(self, server: ServerState, seconds: float, now: float) -> None:
        pass


RoutingName = Literal["latency", "least_outstanding"]
ROUTING_POLICIES: dict[str, type] = {"latency": LatencyRouting, "least_outstanding": LeastOutstandingRouting}


def routing_policy(name: str) -> RoutingPolicy:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}: one of {sorted(ROUTING_POLICIES)}")
    return ROUTING_POLICIES[name]()


class Rotation:
    """The servers a client routes over: `acquire` a server for one request (the policy's pick among the usable
    ones, at most `cap` in flight each), `release` it with the outcome. A failure takes the server out of the
    rotation for `retry_after` seconds. `lock` is shared with whatever else reads the servers' state."""

    def __init__(
        self,
        servers: list[ServerState],
        policy: RoutingPolicy,
        cap: int,
        retry_after: float,
        lock: threading.Condition | None = None,
        what: str = "server",
    ):
        self.servers, self.policy, self.cap, self.retry_after = servers, policy, cap, retry_after
        self.lock = lock or threading.Condition()
        self.backlog = 0  # requests submitted and not yet sent (the latency policy weighs them)
        self.what = what  # how the log names a server ("rollout server", "reward server")

    def acquire(
        self, exclude: set[str], deadline: float, usable: Callable[[ServerState], bool] = lambda server: True
    ) -> ServerState | None:
        """A server for one request, or None when none is usable (all down or excluded, or refused by `usable`) or
        none was free before `deadline`."""
        with self.lock:
            while True:
                now = time.monotonic()
                candidates = [s for s in self.servers if s.url not in exclude and usable(s) and s.down_until <= now]
                if not candidates:
                    return None
                server = self.policy.pick(candidates, self.cap, self.backlog, now)
                if server is not None:
                    if server.outstanding == 0:
                        server.busy_since = now
                    server.outstanding += 1
                    self.backlog = max(0, self.backlog - 1)
                    return server
                if now >= deadline:
                    return None
                self.lock.wait(timeout=min(0.5, deadline - now))

    def release(self, server: ServerState, ok: bool, error: str = "", seconds: float | None = None) -> None:
        with self.lock:
            self.lock.notify_all()
            server.outstanding -= 1
            if server.outstanding == 0:
                server.busy_seconds += time.monotonic() - server.busy_since
            if seconds is not None:
                self.policy.observe(server, seconds, time.monotonic())
            if ok:
                server.served += 1
                server.failures = 0
                server.down_until = 0.0
            else:
                server.failures += 1
                server.last_error = error
                server.unchecked = True  # it may come back restarted
                server.down_until = time.monotonic() + self.retry_after
                logger.warning("%s %s left the rotation: %s", self.what, server.url, error)
