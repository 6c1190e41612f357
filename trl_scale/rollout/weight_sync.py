"""Weight sync to the rollout servers, one strategy per mode, by vLLM's own routes (vLLM 0.22-0.33, dev mode):

- `GroupSync` ("nccl"): one weight-transfer group over every server (`/init_weight_transfer_engine`, then per sync
  `/pause`, `/start_weight_update`, `/update_weights` with JSON `update_info` while the trainer broadcasts,
  `/finish_weight_update`, `/reset_prefix_cache`, `/resume`);
- `SharedDirSync` ("shared_dir"): a directory the servers read (`/collective_rpc reload_weights`);
- `LoraSync` ("lora"): a LoRA adapter (`/v1/load_lora_adapter`, superseded ones unloaded).

Each pauses the servers around the change (`WeightSync`), gives the sync a version, and records which servers took
it on the `RolloutClient`, whose router then sends requests only to servers on the current version.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError, as_completed
from urllib.parse import urlparse

from ..logs import get_logger
from ..net import free_port, is_loopback
from .client import LORA_PREFIX, RolloutClient, RolloutError, ServerState

logger = get_logger(__name__)


class WeightSync:
    """What every mode shares: the servers alive now, pausing them around a change, recording the new version."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self._missed: set[str] = set()  # servers the last syncs did not reach (said once, not at every sync)

    def _each(self, servers: list[ServerState], call, timeout: float) -> dict[str, str]:
        """`call(server)` on every server concurrently, bounded by `timeout`: the errors, by URL."""
        futures = {self.client._pool.submit(call, server): server for server in servers}
        failed: dict[str, str] = {}
        try:
            for future in as_completed(futures, timeout=timeout + 5):
                try:
                    future.result()
                except Exception as error:
                    failed[futures[future].url] = repr(error)
        except TimeoutError:
            for future, server in futures.items():
                if not future.done():
                    failed[server.url] = f"no answer within weight_sync_timeout={timeout}s"
        return failed

    def _live(self, timeout: float) -> list[ServerState]:
        alive = []

        def health(server):
            self.client._get(server, "/health", timeout=min(5.0, timeout)).raise_for_status()
            alive.append(server)

        self._each(self.client.servers, health, timeout)
        return [s for s in self.client.servers if s in alive]

    def _finish(self, what: str, version: str, took: list[ServerState], failed: dict[str, str], timeout: float):
        """Record the new version; servers that did not take it stay out of the rotation until a sync does."""
        with self.client._lock:
            self.client.version = version
            for server in self.client.servers:
                if server in took:
                    server.version, server.unchecked = version, False
            self.client._lock.notify_all()
        if not took:
            raise RolloutError(
                f"{what} reached no server within weight_sync_timeout={timeout}s: {failed or 'all servers down'}"
            )
        missed = {s.url for s in self.client.servers if s not in took}
        if missed - self._missed:
            logger.warning(
                "%s did not reach %s (%s); they stay out of the rotation until a sync reaches them",
                what,
                sorted(missed - self._missed),
                failed,
            )
        if self._missed - missed:
            logger.info("%s reached %s again; back in the rotation", what, sorted(self._missed - missed))
        self._missed = missed

    def _paused(self, servers: list[ServerState], timeout: float, work: Callable[[list[ServerState]], list]) -> list:
        """`/pause?mode=wait`, `work(paused servers)`, then `/resume` on every paused server, also when the work
        failed. "wait" lets the generations a server has started finish with the weights they started with (vLLM's
        "keep" would freeze them and finish them with the new weights: completions sampled from two versions, and
        which tokens came from which depends on timing); requests not yet admitted wait for the resume."""
        refused = self._each(servers, self._pause, timeout)
        paused = [s for s in servers if s.url not in refused]
        try:
            return work(paused)
        finally:
            self._each(paused, lambda s: self.client._post(s, "/resume", timeout), timeout)

    def _pause(self, server: ServerState) -> None:
        # It returns once the server's running generations have finished: bounded as one generation is.
        timeout = None if self.client.generation_timeout is None else 30.0 + self.client.generation_timeout
        self.client._post(server, "/pause?mode=wait", timeout)

    def _reset_prefix_cache(self, server: ServerState, timeout: float) -> None:
        # vLLM V1 keeps prefix caching on: blocks computed with the old weights must not be reused.
        self.client._post(server, "/reset_prefix_cache", timeout)


def _rejoin(client: RolloutClient, server: ServerState, version: str) -> None:
    with client._lock:
        server.version, server.unchecked, server.down_until = version, False, 0.0
        client._lock.notify_all()


class SharedDirSync(WeightSync):
    def sync(self, path: str, version: str, timeout: float = 120.0) -> None:
        """Shared-directory sync: every live server reloads the weights saved at `path` (safetensors, its own
        parameter names) with vLLM's `/collective_rpc reload_weights`, between a pause and a resume."""

        def reload(server):
            self._reload(server, path, version, timeout)

        def work(paused):
            failed = self._each(paused, reload, self.client.load_timeout + 2 * timeout)
            return [s for s in paused if s.url not in failed], failed

        took, failed = self._paused(self._live(timeout), timeout, work)
        self._finish("weight sync (shared directory)", version, took, failed, timeout)

    def _reload(self, server: ServerState, path: str, version: str, timeout: float) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        self.client._post(server, "/collective_rpc", self.client.load_timeout, json=body)
        self.client._post(server, "/update_weight_version", timeout, json={"new_version": version})
        self._reset_prefix_cache(server, timeout)

    def catch_up(self, server: ServerState, path: str, version: str, timeout: float = 120.0) -> None:
        """One server that restarted (so is out of the rotation, with nothing in flight) loads the current weights
        and rejoins without waiting for the next sync."""
        self._reload(server, path, version, timeout)
        _rejoin(self.client, server, version)


class LoraSync(WeightSync):
    def sync(self, name: str, path: str, version: str, timeout: float = 120.0) -> None:
        """LoRA sync by vLLM's rules: a new adapter name per sync (vLLM refuses a second load under a name unless in
        place, and keeps prefix blocks computed under the old one), then the superseded adapters unloaded: ours
        from earlier syncs and from the run this one resumed (every name with the `trl-scale-` prefix)."""

        def load(server):
            self._load(server, name, path, timeout)

        live = self._live(timeout)
        failed = self._each(live, load, self.client.load_timeout + 2 * timeout)
        self._finish("weight sync (LoRA adapter)", version, [s for s in live if s.url not in failed], failed, timeout)

    def _load(self, server: ServerState, name: str, path: str, timeout: float) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": False}
        self.client._post(server, "/v1/load_lora_adapter", self.client.load_timeout, json=body)
        listed = self.client._get(server, "/v1/models", timeout=timeout).json()["data"][1:]
        for old in [m["id"] for m in listed if m["id"].startswith(LORA_PREFIX) and m["id"] != name]:
            try:
                self.client._post(server, "/v1/unload_lora_adapter", timeout, json={"lora_name": old})
            except RolloutError as error:  # gone meanwhile: nothing to free
                logger.info("unloading adapter %s on %s: %s", old, server.url, error)

    def catch_up(self, server: ServerState, name: str, path: str, timeout: float = 120.0) -> None:
        """One restarted server loads the current adapter and rejoins without waiting for the next sync."""
        self._load(server, name, path, timeout)
        _rejoin(self.client, server, name)

    def server_version(self, server: ServerState) -> str | None:
        """For LoRA sync a server's version is the newest of our adapters it lists (none after a restart)."""
        response = self.client._get(server, "/v1/models", timeout=5)
        response.raise_for_status()
        ids = [m["id"] for m in response.json()["data"][1:]]
        return next((i for i in reversed(ids) if i == self.client.version), ids[-1] if ids else None)


class GroupSync(WeightSync):
    """One weight-transfer group over every server, kept between syncs and rebuilt when its membership changes."""

    def __init__(self, client: RolloutClient):
        super().__init__(client)
        self.group: dict | None = None  # the weight-transfer group: sender, member URLs

    def _build_group(self, members: list[ServerState], make_sender: Callable, timeout: float) -> None:
        for server in members:
            response = self.client._get(server, "/get_world_size", timeout=timeout)
            response.raise_for_status()
            server.world_size = int(response.json()["world_size"])
        from .weight_transfer import group_layout

        world_size, offsets = group_layout([s.world_size for s in members])
        sender = make_sender()
        address, port = _trainer_address([s.url for s in members]), free_port()
        requests_out = {}
        for server, offset in zip(members, offsets):
            init_info = {
                "master_address": address,
                "master_port": port,
                "rank_offset": offset,
                "world_size": world_size,
                "packed": sender.packed,
            }
            # It blocks in the rendezvous until the trainer joins: sent from a thread.
            requests_out[server.url] = self.client._pool.submit(
                self.client._post, server, "/init_weight_transfer_engine", timeout, {"init_info": init_info}
            )
        try:
            sender.join(address, port, world_size)
        except Exception as error:
            raise RolloutError(
                f"weight-transfer group of {world_size} ranks did not form within weight_sync_timeout={timeout}s "
                f"({error}); servers: {[s.url for s in members]}"
            ) from error
        for future in requests_out.values():
            future.result(timeout=timeout)
        self.group = {"sender": sender, "members": [s.url for s in members]}
        logger.info("weight-transfer group: world size %d, offsets %s", world_size, dict(zip(requests_out, offsets)))

    def sync(
        self,
        metadata: list[tuple[str, str, list[int]]],
        named_tensors: Iterable,
        version: str,
        make_sender: Callable,
        timeout: float = 120.0,
    ) -> None:
        """One sync over the weight-transfer group: every member gets `/update_weights` with the announced
        `update_info` while the trainer broadcasts `named_tensors` (in `metadata` order) once. The group is
        (re)built first when its membership changed: a server that came back, restarted, or joined."""
        live = self._live(timeout)
        if not live:
            raise RolloutError(f"weight sync: no server answers /health ({[s.url for s in self.client.servers]})")
        self.client.refresh_versions()
        members = self.group["members"] if self.group else []
        restarted = [
            s
            for s in live
            if s.url in members and self.client.version is not None and s.version != self.client.version
        ]
        if [s.url for s in live] != members or restarted:
            self.close()
            self._build_group(live, make_sender, timeout)
        update_info = {
            "names": [name for name, _, _ in metadata],
            "dtype_names": [dtype for _, dtype, _ in metadata],
            "shapes": [list(shape) for _, _, shape in metadata],
        }
        sender = self.group["sender"]

        def work(paused):
            if len(paused) != len(live):
                raise RolloutError(f"weight sync: {len(live) - len(paused)} group member(s) did not pause")
            refused = self._each(
                paused, lambda s: self.client._post(s, "/start_weight_update", timeout, json={}), timeout
            )
            if refused:
                raise RolloutError(f"weight sync: /start_weight_update failed on {refused}; nothing was sent")
            receiving = {
                s.url: self.client._pool.submit(
                    self.client._post, s, "/update_weights", self.client.load_timeout, {"update_info": update_info}
                )
                for s in paused
            }
            failure = _broadcast(
                sender, named_tensors, receiving, self.client._pool, time.monotonic() + self.client.load_timeout
            )
            if failure:
                self.close()
                raise RolloutError(
                    f"weight broadcast abandoned: {failure}. Every rank finished its parameter walk; the next sync "
                    "rebuilds the group without the servers that left"
                )

            def finish(server):
                self.client._post(server, "/finish_weight_update", timeout, json={"weight_version": version})
                self._reset_prefix_cache(server, timeout)

            failed = self._each(paused, finish, timeout)
            return [s for s in paused if s.url not in failed], failed

        took, failed = self._paused(live, timeout, work)
        self._finish("weight sync", version, took, failed, timeout)

    def close(self) -> None:
        if self.group:
            self.group["sender"].close()
        self.group = None

    def push(self, state_dict: dict, timeout: float = 120.0, version: str | None = None) -> str:
        """Send a full state dict over the servers' weight-transfer engine (tools and tests); returns the version."""
        from .preflight import inspect_all
        from .weight_transfer import make_sender

        # What the servers offer, read as the trainer's preflight reads it (servers down now join a later sync).
        reports = [
            r
            for r in inspect_all(self.client.get_url, self.client.post_url, [s.url for s in self.client.servers])
            if r.reachable
        ]
        backends = {r.weight_transfer for r in reports}
        if not reports or None in backends:
            raise RolloutError("the servers offer no weight-transfer engine (/server_info weight_transfer_config)")
        if len(backends) != 1:
            raise RolloutError(f"the servers offer different weight-transfer backends: {sorted(backends)}")
        (backend,) = backends
        metadata = [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state_dict.items()]
        version = version or f"push-{uuid.uuid4().hex[:8]}"
        self.sync(metadata, iter(state_dict.items()), version, lambda: make_sender(backend, timeout), timeout=timeout)
        return version


def _broadcast(sender, named_tensors: Iterable, receiving: dict, pool, deadline: float) -> str | None:
    """Broadcast `named_tensors` while the servers' `/update_weights` calls (`receiving`, futures by URL) receive.

    The parameter walk (`named_tensors`: ZeRO-3/FSDP gathers, collectives the other trainer ranks are in) runs here
    and always to its end; the sender runs on its own thread and is handed one tensor at a time, each still inside
    its gather until sent. So a receiver that fails, a broadcast that stalls (NCCL's has no timeout) or `deadline`
    passing abandons the sender without leaving any rank waiting. Returns what went wrong, or None."""
    import queue

    handoff: queue.Queue = queue.Queue(maxsize=1)
    sent: queue.Queue = queue.Queue()

    def feed():
        while (item := handoff.get()) is not None:
            yield item
            sent.put(True)  # the sender asked for the next tensor: this one is out

    sending = pool.submit(sender.send, feed())

    def trouble() -> str | None:
        failed = {url: f.exception() for url, f in receiving.items() if f.done() and f.exception() is not None}
        if failed:
            return f"/update_weights failed on {failed}"
        if sending.done() and sending.exception() is not None:
            return f"the trainer's broadcast failed ({sending.exception()!r})"
        if time.monotonic() > deadline:
            return "the broadcast did not finish within weight_load_timeout"
        return None

    failure = None
    for item in named_tensors:
        if failure is not None:
            continue  # keep walking: the other ranks' gathers need this one
        handoff.put(item)
        while failure is None:
            try:
                sent.get(timeout=0.05)
                break
            except queue.Empty:
                failure = trouble()
    try:
        handoff.put_nowait(None)
    except queue.Full:
        pass  # the sender is stuck with a tensor: it is abandoned
    while failure is None and not (sending.done() and all(f.done() for f in receiving.values())):
        failure = trouble()
        time.sleep(0.02)
    return failure or trouble()


def _trainer_address(urls: list[str]) -> str:
    """The address the servers reach the trainer at: loopback when they all run here, else the local address of
    the route to the first server."""
    hosts = [urlparse(url).hostname or "" for url in urls]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], 80))  # no packet is sent: this only picks the outgoing interface
        return probe.getsockname()[0]
