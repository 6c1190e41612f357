"""The chaos run's faults (benchmarks/chaos.py): the seeded schedule, and `FaultProxy`, which stands in front of one
`trl-scale serve` server and can make it answer 500 or answer slowly for a while.

A server killed or stopped is killed or stopped for real (`kill -9` / `SIGSTOP` to its process group); the proxy then
behaves as the missing server would: it closes a connection it cannot forward (as a dead server's refused
connection), and waits on one that hangs (as a stopped server's). It also notes when each completion was asked and
answered (the trainer's requests: when a server is back in the trainer's rotation), and probes a server from the
moment its fault is lifted until it answers (when it is serving again).
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import requests

SERVER_FAULTS = ("kill", "stop", "error", "slow")
# No server fault this many steps before the trainer's kill, nor this many after it: a server's recovery is measured
# while the trainer sends requests (a trainer that is down asks nothing, so nothing can be answered).
QUIET_BEFORE_KILL, QUIET_AFTER_KILL = 3, 3
SPACING = 8  # steps between two faults of one server: each recovery is its own
PROBE_HEADER = "X-Chaos-Probe"  # the harness's own requests: not the trainer's, not counted as its rotation
KINDS = (*SERVER_FAULTS, "trainer_kill")


@dataclass
class Fault:
    step: int  # injected once the trainer has finished this step
    kind: str  # one of KINDS
    server: int | None = None  # the server's index (None: the trainer)
    seconds: float = 0.0  # how long a stop, an error spell or a slow spell lasts
    started: float | None = None  # time.time() of the injection
    ended: float | None = None  # when the fault was lifted (a kill: at once; the fleet restarts the server)
    recovered: float | None = None  # the server answering a completion again (the harness's probe, from `ended`)
    in_rotation: float | None = None  # the trainer's first request it answered, asked after `ended`

    def record(self) -> dict:
        return asdict(self)


def schedule(
    seed: int, steps: int, servers: int, faults: int, save_steps: int, stop_seconds: float, spell_seconds: float
) -> list[Fault]:
    """`faults` faults at seeded steps: the server fault kinds in turn, the trainer killed once (between two
    checkpoints, in the second half, so its checkpoint and the steps it loses are both real), the rest drawn at
    random. Two faults of one server are `SPACING` steps apart, and none is near the trainer's kill, so each recovery
    is its own."""
    if faults < len(KINDS):
        raise ValueError(f"--faults must be at least {len(KINDS)} (one of each kind: {', '.join(KINDS)})")
    rng = random.Random(seed)
    kinds = [SERVER_FAULTS[i % len(SERVER_FAULTS)] for i in range(faults - 1)]  # as even as the count allows
    rng.shuffle(kinds)
    first, last = 3, steps - max(6, steps // 4)  # the last quarter left for the trainer to use the servers again
    trainer_candidates = [s for s in range(max(save_steps + 1, steps // 2), last) if s % save_steps not in (0, 1)]
    if not trainer_candidates:
        raise ValueError(f"no step to kill the trainer at: --steps {steps} is too short for --save-steps {save_steps}")
    trainer_step = rng.choice(trainer_candidates)
    quiet = range(trainer_step - QUIET_BEFORE_KILL, trainer_step + QUIET_AFTER_KILL)
    allowed = [s for s in range(first, last) if s not in quiet]
    taken: list[list[int]] = [[] for _ in range(servers)]  # each server's fault steps
    chosen: list[Fault] = []
    for kind in kinds:
        for _ in range(1000):
            step = rng.choice(allowed)
            free = [i for i in range(servers) if all(abs(step - other) >= SPACING for other in taken[i])]
            if free:
                break
        else:
            raise ValueError(f"{faults} faults do not fit {steps} steps on {servers} servers: raise --steps")
        server = rng.choice(free)
        taken[server].append(step)
        chosen.append(Fault(step, kind, server, {"kill": 0.0, "stop": stop_seconds}.get(kind, spell_seconds)))
    chosen.append(Fault(trainer_step, "trainer_kill"))
    return sorted(chosen, key=lambda f: f.step)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a client that gave up (its timeout): expected here
        pass


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of one server (see the module docstring)."""

    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.error_until = 0.0  # time.time() until which every route answers 500
        self.slow_until = 0.0
        self.slow_seconds = 0.0  # added before each completion while slow
        self.completions: list[tuple[float, float, int]] = []  # (asked, answered, status)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                proxy.forward(self)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    def forward(self, handler: BaseHTTPRequestHandler) -> None:
        asked = time.time()
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        completion = handler.path.startswith("/v1/completions")
        if asked < self.error_until:
            self._answer(handler, 500, json.dumps({"error": "chaos: this server answers 500 for a while"}).encode())
            return
        if completion and asked < self.slow_until:
            time.sleep(self.slow_seconds)
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("content-type", "authorization")}
        connection = http.client.HTTPConnection(*self.upstream, timeout=600)
        try:
            connection.request(handler.command, handler.path, body=body, headers=headers)
            response = connection.getresponse()
            status, payload = response.status, response.read()
            content_type = response.getheader("Content-Type", "application/json")
        except OSError:  # refused (killed) or cut: the client sees a dropped connection, as from a dead server
            handler.close_connection = True
            return
        finally:
            connection.close()
        if completion and not handler.headers.get(PROBE_HEADER):
            with self._lock:
                self.completions.append((asked, time.time(), status))
        self._answer(handler, status, payload, content_type)

    @staticmethod
    def _answer(handler, status: int, payload: bytes, content_type: str = "application/json") -> None:
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(payload)))
            handler.end_headers()
            handler.wfile.write(payload)
        except OSError:  # the client gave up (its timeout) before the answer
            handler.close_connection = True

    def first_answer_after(self, when: float) -> float | None:
        """When the first completion asked at or after `when` was answered with 200 (None: none was)."""
        with self._lock:
            answered = [done for asked, done, status in self.completions if asked >= when and status == 200]
        return min(answered, default=None)

    def probe(self, after: float, limit: float = 120.0) -> float | None:
        """From `after` (time.time()), ask for one token every 0.25 s until the server answers; when it did (None:
        not within `limit` seconds)."""
        time.sleep(max(0.0, after - time.time()))
        headers, deadline = {PROBE_HEADER: "1"}, time.time() + limit
        while time.time() < deadline:
            try:
                model = requests.get(f"{self.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
                body = {"model": model, "prompt": [[1, 2, 3]], "max_tokens": 1}
                if requests.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=10).ok:
                    return time.time()
            except (requests.RequestException, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.25)
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
