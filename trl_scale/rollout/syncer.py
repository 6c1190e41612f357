"""`WeightSyncer`: the weights the rollout servers serve, held by TRL's generation interface (`generation.py`).

Each sync pushes the policy's weights to every server through the mode the preflight chose (`weight_sync/`), names
them (a version of this run) and counts them. The count and the syncing flag change together under the syncer's own
lock: an answer finishing during a streaming sync may hold the sync's weights (`newest_reachable`). A restarted
managed server catches up to the weights served now (`catch_up`), never during a sync (the sync lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..logs import get_logger
from ..ranks import agree, broadcast_from_main
from .client import VERSION_PREFIX, RolloutClient, RolloutError
from .weight_dir import WeightDirectory
from .weight_sync import PolicyWeights, WeightSyncMode

logger = get_logger(__name__)


class WeightSyncer:
    """The servers' weights: which sync mode moves them, their version and count, and the adapter served."""

    def __init__(self, client: RolloutClient, run_id: str, weight_dir: WeightDirectory | None, managed: bool):
        self.client = client
        self.run_id = run_id  # versions and adapter names never collide across runs or resumes
        self.weight_dir = weight_dir  # where shared_dir / lora syncs write (the main process's; None elsewhere)
        self.managed = managed  # managed servers: a failed sync is tried once more after a restart
        self.mode: WeightSyncMode | None = None  # chosen by the preflight, from what the servers offer (`choose`)
        self.count = 0  # syncs done
        self.version: str | None = None  # the weights the servers serve, as the last sync named them
        self.syncing = False  # a sync is under way (streaming: running generations may reach its weights)
        self.lora_served: tuple[str | None, int] = (None, 0)  # (adapter name, its sync count), swapped as one
        self._version_lock = threading.Lock()  # the count and the flag, changed together
        self._sync_lock = threading.Lock()  # a sync and a restarted server's catch-up, one at a time

    @property
    def name(self) -> str:
        """The mode's name ("nccl", "shared_dir", "lora"), once chosen; "" before."""
        return self.mode.name if self.mode is not None else ""

    def choose(self, mode: WeightSyncMode) -> None:
        """The sync mode the preflight chose, once: the client's version book then reads each server's version as
        that mode reports it."""
        if self.mode is not None:
            raise RuntimeError(f"the weight sync mode is chosen once ({self.mode.name}, then {mode.name})")
        self.mode = mode
        self.client.versions.read_with(mode.server_version)

    @property
    def lora_name(self) -> str | None:
        """The adapter the servers serve now (`weight_sync="lora"`; None before its first sync, and otherwise)."""
        return self.lora_served[0]

    def newest_reachable(self) -> int:
        """The newest weights a token finishing now can come from: the sync count, one more while a sync is under
        way (a streaming sync lets running generations reach its weights). One snapshot of the two, which `sync`
        changes together: never the old count once the new weights may be served."""
        with self._version_lock:
            return self.count + (1 if self.syncing else 0)

    def sync(self, weights: PolicyWeights, check_fleet: Callable[[], None]) -> None:
        """Push `weights` to every server. Every rank walks the parameters (gathering shards is a collective); the
        main process sends. A failure on any rank fails the sync on every rank, naming that rank. With managed
        servers a failed sync is tried once more, by every rank, after the fleet has a server serving again
        (`check_fleet`): one can pass the fleet's check and die before the weights reach it."""
        version = f"{VERSION_PREFIX}{self.run_id}-{self.count + 1}"
        with self._version_lock:
            self.syncing = True
        try:
            self._sync_with_retry(weights, check_fleet, version)
        except BaseException:
            with self._version_lock:
                self.syncing = False
            raise
        # one step: an answer finishing now reads the new count, not the old without the flag
        with self._version_lock:
            self.count += 1
            self.syncing = False
        self.version = version
        if self.name == "lora":
            self.lora_served = (version, self.count)
        self.client.versions.version = version  # every rank routes only to servers on this version

    def _sync_with_retry(self, weights: PolicyWeights, check_fleet: Callable[[], None], version: str) -> None:
        try:
            self._sync_on_every_rank(weights, check_fleet, version)
        except Exception as error:
            if not self.managed:
                raise RolloutError(f"weight sync failed: {type(error).__name__}: {error}") from error
            logger.warning("weight sync failed (%s); waiting for a managed server, then trying once more", error)
            try:
                self._sync_on_every_rank(weights, check_fleet, version)
            except Exception as again:
                raise RolloutError(f"weight sync failed: {type(again).__name__}: {again}") from again

    def _sync_on_every_rank(self, weights: PolicyWeights, check_fleet: Callable[[], None], version: str) -> None:
        """One sync: every rank does its part, and a failure on any rank fails it on all of them, naming that rank
        (`agree`). Then every rank takes the main process's server list: a managed server restarted elsewhere has
        a new URL."""

        def this_rank() -> None:
            check_fleet()  # outside the lock: it may wait for a restart, whose catch-up takes the lock
            with self._sync_lock:
                self.mode.sync(weights, version)

        agree(this_rank)
        current = [s.url for s in self.client.servers]
        for old, new in zip(current, broadcast_from_main(current)):
            if old != new:
                self.client.replace_url(old, new)

    def catch_up(self, url: str) -> None:
        """A managed server that restarted serves its original weights: load the current ones into it now
        (`shared_dir`, `lora`), so it rejoins before the next sync. With a weight-transfer group (`nccl`) the next
        sync rebuilds the group with it; until then the router leaves it out. Never raises (a restart thread)."""
        with self._sync_lock:
            server = next((s for s in self.client.servers if s.url == url.rstrip("/")), None)
            if self.version is None or server is None or self.mode is None:
                return  # before the first sync every server serves the initial weights
            try:
                if self.mode.catch_up(server, self.version):
                    logger.warning("rollout server %s restarted and caught up to weights %s", url, self.version)
            except Exception as error:
                logger.warning("rollout server %s could not catch up (%r); the next sync brings it back", url, error)

    def release_weight_dir(self) -> None:
        """Release what the sync mode holds (the weights it wrote, the directory's lock): the end of `train()`. The
        next sync takes it again."""
        with self._sync_lock:
            if self.mode is not None:
                self.mode.close()
            elif self.weight_dir is not None:
                self.weight_dir.release()
