"""Which server takes a request: the servers' routing state and the routing policies, one chosen by name.

A policy only orders and picks among the usable servers (current weights, in the rotation, not excluded); the client
holds the lock, counts what is in flight and waits when the policy picks none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol


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
