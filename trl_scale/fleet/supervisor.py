"""`ServerFleet`: start every server at once, wait for all with progress, supervise (restart an exited server at its
address with backoff), and stop every server on every exit path (close(), interpreter exit)."""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

from ..errors import RolloutError
from ..logs import get_logger
from .spec import USAGE_ERROR, FleetSpec, restart_delay, start_failure_fix

logger = get_logger(__name__)


class ServerFleet:
    """Start, watch and stop `spec.num_servers` servers through `launcher` (see the module docstring)."""

    def __init__(self, spec: FleetSpec, launcher, poll_interval: float = 1.0, progress_every: float = 15.0):
        self.spec, self.launcher = spec, launcher
        self.poll_interval, self.progress_every = poll_interval, progress_every
        self.handles: list = []
        self.deaths = 0
        self.restarts = 0
        self.attempts: list[int] = []  # restarts tried per server
        self.restarting: set[int] = set()
        self.failed: dict[int, str] = {}  # servers out of restarts: why
        self.start_seconds: float | None = None
        self.keep_logs = False  # set once a server fails or exits: its log outlives the run, named at close
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self.on_moved = None  # called (old URL, new URL) when a restarted server comes back at another address
        self.on_restarted = None  # called (URL) once a restarted server answers: bring it to the current weights
        # (both given by the rollout's generation interface, `listen`)
        # Each server outage seen: (URL it came back at, time.perf_counter() its exit was seen, time it answered
        # again or None if it never did): the rollout timeline's restarts.
        self.outages: list[tuple[str, float, float | None]] = []
        self._down_since: dict[int, float] = {}

    def listen(self, on_moved: Callable[[str, str], None], on_restarted: Callable[[str], None]) -> None:
        """What the rollout does when a restarted server comes back: at another address (`on_moved(old, new)`), and
        answering (`on_restarted(url)`: brought to the current weights)."""
        self.on_moved, self.on_restarted = on_moved, on_restarted

    # ---- start ------------------------------------------------------------------------------------------

    def start(self) -> list[str]:
        """Launch every server at once and wait until all answer `/health`; their URLs. On failure every server
        started so far is stopped and the error names each one that did not come up, with its log's tail."""
        began = time.monotonic()
        if hasattr(self.launcher, "check"):
            try:
                self.launcher.check()
            except BaseException:
                self.launcher.close()
                raise
        try:
            self.handles = [self.launcher.launch(index) for index in range(self.spec.num_servers)]
            self.attempts = [0] * len(self.handles)
            self._wait_all_ready(began)
        except BaseException:
            self.keep_logs = True  # the error names the logs
            self.close()
            raise
        self.start_seconds = time.monotonic() - began
        logger.info("rollout servers: %d ready in %.0f s: %s", len(self.handles), self.start_seconds, self.urls)
        _close_at_exit(self)
        self._watcher = threading.Thread(target=self._watch, name="rollout-fleet", daemon=True)
        self._watcher.start()
        return self.urls

    def _wait_all_ready(self, began: float) -> None:
        deadline = began + self.spec.ready_timeout
        ready: set[int] = set()
        last_report = began
        while len(ready) < len(self.handles):
            for index, handle in enumerate(self.handles):
                if index in ready:
                    continue
                code = handle.returncode()
                if code is not None:
                    log = handle.log_tail()
                    if self.attempts[index] >= self.spec.max_restarts or code == USAGE_ERROR:
                        raise RolloutError(
                            f"rollout server {index} exited with code {code} while starting "
                            f"({self.attempts[index]} restart(s)): {handle.describe()}\n{log}\n"
                            f"{start_failure_fix(code, log)}"
                        )
                    self.attempts[index] += 1
                    self.keep_logs = True
                    handle.stop(grace=1)  # what is left of its group, and off the reaper's list
                    self.handles[index] = self.launcher.launch(index)
                elif handle.ready():
                    ready.add(index)
            now = time.monotonic()
            if len(ready) < len(self.handles) and now >= deadline:
                waiting = [self.handles[i] for i in range(len(self.handles)) if i not in ready]
                tails = "\n".join(f"--- {h.describe()}\n{h.log_tail(1200)}" for h in waiting)
                raise RolloutError(
                    f"rollout servers not ready within managed_server_ready_timeout={self.spec.ready_timeout:g}s: "
                    f"{len(waiting)} of {len(self.handles)} still starting.\n{tails}\nFix: raise "
                    "managed_server_ready_timeout for large models, or check the logs above"
                )
            if now - last_report >= self.progress_every:
                logger.info("rollout servers: %d/%d ready after %.0f s", len(ready), len(self.handles), now - began)
                last_report = now
            if len(ready) < len(self.handles):
                time.sleep(0.5)

    @property
    def urls(self) -> list[str]:
        return [handle.url for handle in self.handles]

    # ---- supervision ------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_interval):
            for index, handle in enumerate(list(self.handles)):
                with self._lock:
                    if index in self.restarting or index in self.failed or self._closed.is_set():
                        continue
                    try:
                        code = handle.returncode()
                    except Exception as error:  # a remote host we cannot reach counts as dead
                        code = f"unreachable ({error!r})"
                    if code is None:
                        continue
                    self.deaths += 1
                    self.keep_logs = True
                    self.restarting.add(index)
                    self._down_since[index] = time.perf_counter()
                logger.warning(
                    "rollout server %s exited (%s); restarting it. Log tail:\n%s",
                    handle.url,
                    code,
                    handle.log_tail(800),
                )
                restart = threading.Thread(
                    target=self._restart, args=(index, handle.url), name=f"restart-{index}", daemon=True
                )
                restart.start()

    def _restart(self, index: int, url: str) -> None:
        """Relaunch server `index` (last at `url`) on its address, with backoff, until it answers `/health` or runs
        out of attempts. It rejoins the rotation once a weight sync brings it to the current version (the router
        checks). The URL comes from the watcher: close() may empty the handles before this thread runs."""
        try:
            while self.attempts[index] < self.spec.max_restarts and not self._closed.is_set():
                self.attempts[index] += 1
                self._closed.wait(restart_delay(self.attempts[index]))
                handle = self._relaunch(index)
                if handle is None:  # the fleet closed meanwhile
                    return
                if handle.url != url and self.on_moved is not None:
                    self.on_moved(url, handle.url)
                url = handle.url
                deadline = time.monotonic() + self.spec.ready_timeout
                while handle.returncode() is None and time.monotonic() < deadline and not self._closed.is_set():
                    if handle.ready():
                        logger.warning("rollout server %s restarted (attempt %d)", handle.url, self.attempts[index])
                        if self.on_restarted is not None:
                            self.on_restarted(handle.url)
                        with self._lock:
                            self.restarts += 1
                            self.outages.append((handle.url, self._down_since.pop(index, 0.0), time.perf_counter()))
                        return
                    time.sleep(1.0)
            if self._closed.is_set():  # stopped with the fleet, not out of restarts
                return
            with self._lock:
                self.failed[index] = f"out of restarts (managed_server_max_restarts={self.spec.max_restarts})"
            logger.error("rollout server %s: %s", url, self.failed[index])
        except Exception as error:
            with self._lock:
                self.failed[index] = f"restart failed: {error!r}"
            logger.error("rollout server %d: restart failed: %r", index, error)
        finally:
            with self._lock:
                self.restarting.discard(index)
                if index in self._down_since:  # it never answered again
                    self.outages.append((url, self._down_since.pop(index), None))

    def _relaunch(self, index: int):
        """Server `index` stopped and launched again: its new handle, or None once the fleet is closed. A launch that
        close() ran during is stopped here: close() stopped the handles it found, and this one was not yet among
        them (before, it was left running, its process outliving the fleet)."""
        with self._lock:
            if self._closed.is_set():
                return None
            old = self.handles[index]
        old.stop(grace=5)
        handle = self.launcher.launch(index)
        with self._lock:
            if not self._closed.is_set():
                self.handles[index] = handle
                return handle
        handle.stop(grace=5)
        return None

    def check(self) -> None:
        """Raise when no server can serve any more (every one dead and out of restarts)."""
        with self._lock:
            if self.handles and len(self.failed) == len(self.handles):
                details = "; ".join(f"{self.handles[i].url}: {why}" for i, why in self.failed.items())
                logs = "\n".join(f"--- {h.describe()}\n{h.log_tail(800)}" for h in self.handles)
                raise RolloutError(
                    f"no rollout server can serve: {details}.\n{logs}\nFix: check the logs above; raise "
                    "managed_server_max_restarts if the servers die of transient causes"
                )

    def wait_until_serving(self) -> None:
        """Return once a managed server answers `/health`; wait while every one is down but some restart (a fleet
        of one whose server died must not fail the step it restarts in). Raise when none can serve any more, or
        none came back within `managed_server_ready_timeout` (plus the backoff)."""
        deadline = time.monotonic() + self.spec.ready_timeout + 60
        warned = False
        while True:
            self.check()
            with self._lock:
                out = self.restarting | set(self.failed)
                candidates = [handle for index, handle in enumerate(self.handles) if index not in out]
            # alive (a killed Ray actor's server may still answer while it shuts down) and answering
            if any(handle.returncode() is None and handle.ready() for handle in candidates):
                return
            if time.monotonic() >= deadline:
                raise RolloutError(
                    f"no managed rollout server answered /health within managed_server_ready_timeout="
                    f"{self.spec.ready_timeout:g}s (+60 s): {[h.describe() for h in self.handles]}"
                )
            if not warned:
                logger.warning("no managed rollout server answers now; waiting for a restart (%s)", self.urls)
                warned = True
            time.sleep(1.0)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            up = len(self.handles) - len(self.restarting) - len(self.failed)
            return {
                "rollout/servers_up": float(up),
                "rollout/server_deaths": float(self.deaths),
                "rollout/server_restarts": float(self.restarts),
            }

    # ---- stop -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every server (in parallel) and the launcher; safe to call more than once, from any exit path. Their
        logs are removed unless a server failed or exited during the run; then they are kept and named."""
        if self._closed.is_set() and not self.handles:
            return
        with self._lock:  # a restart's launch either lands in the handles stopped here or sees the fleet closed
            self._closed.set()
            handles, self.handles = list(self.handles), []
        if self.keep_logs and handles:
            logger.info("rollout servers stopped; their logs are kept: %s", ", ".join(h.describe() for h in handles))
        threads = [threading.Thread(target=h.stop, kwargs={"remove_log": not self.keep_logs}) for h in handles]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        self.launcher.close()


_open_fleets: weakref.WeakSet = weakref.WeakSet()
_exit_hook_installed = False


def _close_all() -> None:
    for fleet in list(_open_fleets):
        fleet.close()


def _close_at_exit(fleet: ServerFleet) -> None:
    """At interpreter exit the servers are stopped in order. A trainer ended by a signal (SIGTERM from a scheduler,
    SIGKILL) runs no exit code: its reaper stops them (or, on Ray, the actors die with the driver)."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(_close_all)
    _open_fleets.add(fleet)
