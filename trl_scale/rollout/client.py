"""A rollout client over one or many OpenAI-compatible completion servers (vLLM's, or `trl-scale serve`).

- Readiness: `wait_until_ready` polls `/health` (a real model loads for minutes) before the first request.
- Routing: at most `max_inflight_per_server` requests in flight per server; a request (one prompt, its `n`
  completions) goes to the fastest free server (observed latency), and to a slower one only if it finishes there
  before the faster servers could clear the queue: not an even split.
- Failover: a server that errors or times out leaves the rotation for `retry_after` seconds and its request is
  re-sent to another; with every server down the call fails with `RolloutError` within `request_timeout`.
- Timeouts, apart because they bound different waits: `request_timeout` bounds waiting for a server to take a
  request (a free slot, a failover); `generation_timeout` bounds one server generating it (None: no limit, as
  TRL's client); `load_timeout` bounds a server receiving or loading weights (`/update_weights`,
  `/collective_rpc reload_weights`, `/v1/load_lora_adapter`); the short weight-sync calls take their own timeout.
- Weight sync, by vLLM's own routes (vLLM 0.22-0.33, dev mode): one weight-transfer group over every server
  (`/init_weight_transfer_engine`, then per sync `/pause`, `/start_weight_update`, `/update_weights` with JSON
  `update_info` while the trainer broadcasts, `/finish_weight_update`, `/reset_prefix_cache`, `/resume`); or a
  directory the servers read (`/collective_rpc reload_weights`); or a LoRA adapter (`/v1/load_lora_adapter`).
- Weight versions: every sync has a version; each server's is read back (`/weight_info`, or the adapter list
  for LoRA), and only servers on the current version get requests. A server that restarted (and so serves its
  original weights) or missed a sync is out of the rotation until a sync reaches it.

Only `requests` is needed, except for vLLM's NCCL engine, whose trainer side is vLLM's (as in TRL).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from urllib.parse import urlparse

import requests

logger = logging.getLogger(__name__)


LORA_PREFIX = "trl-scale-"  # the adapters a LoRA sync loads; older ones with it are unloaded
SERVER_KEY = "_trl_scale_server"  # set on each returned choice: the server that generated it


class RolloutError(RuntimeError):
    """A rollout or weight sync that cannot complete; the message names the servers and the cause."""


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
    world_size: int = 0  # ranks it brings to the weight-transfer group (0: not read yet)


def _check_choices(choices, n: int) -> None:
    """A completions response must hold `n` choices with token ids; anything else is a server fault."""
    if not isinstance(choices, list) or len(choices) != n:
        count = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise ValueError(f"malformed response: {count} choices for n={n}")
    if not all(isinstance(c, dict) and isinstance(c.get("token_ids"), list) for c in choices):
        raise ValueError("malformed response: a choice without a token_ids list")


class RolloutClient:
    def __init__(
        self,
        base_urls: list[str],
        request_timeout: float = 120.0,
        retry_after: float = 5.0,
        api_key: str | None = None,
        max_workers: int | None = None,
        max_inflight_per_server: int = 8,
        generation_timeout: float | None = None,
        load_timeout: float = 900.0,
    ):
        if not base_urls:
            raise ValueError("vllm_server_base_urls is empty: give at least one server URL")
        self.servers = [ServerState(url.rstrip("/")) for url in base_urls]
        self.request_timeout = request_timeout
        self.generation_timeout = generation_timeout
        self.load_timeout = load_timeout
        self.retry_after = retry_after
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Requests beyond this many per server wait in the client and go to whichever server frees up first: that
        # is what makes the routing load-aware (with no cap, least-outstanding degenerates into an even split).
        self.max_inflight_per_server = max_inflight_per_server
        self._lock = threading.Condition()
        self._backlog = 0  # requests submitted through generate() and not yet sent
        # Enough threads that the in-flight cap, not the pool, bounds the requests on the wire (+ weight-sync calls).
        workers = max_workers or max(32, len(self.servers) * (max_inflight_per_server + 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=workers)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._model_names: dict[str, str] = {}
        self.version: str | None = None  # the weights every server should serve; None until the first sync
        self.version_reader: Callable[[ServerState], str | None] = self._weight_info
        self._group: dict | None = None  # the weight-transfer group: sender, member URLs

    # ---- server selection -----------------------------------------------------------------------------------

    def _acquire(self, exclude: set[str], deadline: float) -> ServerState | None:
        """A server for one request, or None when none is usable (all down, stale or excluded).

        Free servers (below their in-flight cap) are tried fastest first. A slower one takes the request only if
        it would finish it before the faster servers could clear the backlog of requests not yet dispatched;
        otherwise the request waits for a faster server. With a long queue every server works; at the tail a
        slow server is not handed the request that would finish last.
        """
        with self._lock:
            while True:
                now = time.monotonic()
                usable = [s for s in self.servers if s.url not in exclude and self._current(s) and s.down_until <= now]
                if not usable:
                    return None
                free = sorted(
                    (s for s in usable if s.outstanding < self.max_inflight_per_server),
                    key=lambda s: (s.latency, s.outstanding, s.served),
                )
                for server in free:
                    faster = [t for t in usable if 0.0 < t.latency < server.latency]
                    rate = sum(self.max_inflight_per_server / t.latency for t in faster)
                    if server.latency == 0.0 or not faster or server.latency <= max(1, self._backlog) / rate:
                        server.outstanding += 1
                        self._backlog = max(0, self._backlog - 1)
                        return server
                if now >= deadline:
                    return None
                self._lock.wait(timeout=min(0.5, deadline - now))

    def _release(self, server: ServerState, ok: bool, error: str = "", seconds: float | None = None) -> None:
        with self._lock:
            self._lock.notify_all()
            server.outstanding -= 1
            if seconds is not None:
                server.latency = seconds if server.latency == 0.0 else 0.7 * server.latency + 0.3 * seconds
            if ok:
                server.served += 1
                server.failures = 0
                server.down_until = 0.0
            else:
                server.failures += 1
                server.last_error = error
                server.unchecked = True  # it may come back restarted, on its original weights
                server.down_until = time.monotonic() + self.retry_after
                logger.warning("rollout server %s left the rotation: %s", server.url, error)

    def _model_name(self, server: ServerState) -> str | None:
        if server.url not in self._model_names:
            timeout = min(10.0, self.request_timeout)
            response = self._session.get(f"{server.url}/v1/models", headers=self.headers, timeout=timeout)
            response.raise_for_status()
            self._model_names[server.url] = response.json()["data"][0]["id"]
        return self._model_names[server.url]

    # ---- generation ---------------------------------------------------------------------------------------

    def complete(self, prompt: list[int], n: int = 1, model: str | None = None, **sampling) -> list[dict]:
        """One `/v1/completions` request for one prompt, routed and retried; returns vLLM-shaped choices. Waiting
        for a server to take it is bounded by `request_timeout` (again after each failover), its generation by
        `generation_timeout`; each server is tried at most once per round."""
        deadline = time.monotonic() + self.request_timeout
        tried: set[str] = set()
        errors = []
        while time.monotonic() < deadline:
            server = self._acquire(tried, deadline)
            if server is None:
                if len(tried) >= len(self.servers) or not self._any_may_return(deadline):
                    break
                tried.clear()  # every server was tried once; wait for one to come back
                time.sleep(min(0.2, self.retry_after))
                self.refresh_versions(only_unchecked=True)
                continue
            try:
                payload = {"prompt": [prompt], "n": n, "return_token_ids": True, **sampling}
                payload["model"] = model or self._model_name(server)
                sent = time.monotonic()
                response = self._session.post(
                    f"{server.url}/v1/completions",
                    json=payload,
                    headers=self.headers,
                    timeout=(min(10.0, self.request_timeout), self.generation_timeout),
                )
                if 400 <= response.status_code < 500:
                    self._release(server, ok=True)
                    raise RolloutError(f"{server.url} rejected the request ({response.status_code}): {response.text}")
                response.raise_for_status()
                choices = response.json()["choices"]  # malformed JSON raises here: a server fault, fail over
                _check_choices(choices, n)
                self._release(server, ok=True, seconds=time.monotonic() - sent)
                for choice in choices:
                    choice[SERVER_KEY] = server.url
                return choices
            except RolloutError:
                raise
            except Exception as error:  # connection refused, timeout, 5xx: fail over
                self._release(server, ok=False, error=repr(error))
                tried.add(server.url)
                errors.append(f"{server.url}: {error!r}")
                deadline = time.monotonic() + self.request_timeout  # the failover waits afresh
        limit = "no limit" if self.generation_timeout is None else f"{self.generation_timeout:g}s"
        raise RolloutError(
            f"no rollout server answered: none took the request within rollout_request_timeout="
            f"{self.request_timeout:g}s (each generation may take rollout_generation_timeout: {limit}). Servers: "
            f"{[s.url for s in self.servers]}. Errors: {errors[-3:] or 'all servers down or stale'}"
        )

    # ---- plain calls by URL (preflight, `trl-scale check-servers`) --------------------------------------------

    def get_url(self, url: str, path: str) -> requests.Response:
        return self._session.get(f"{url}{path}", headers=self.headers, timeout=min(30.0, self.request_timeout))

    def post_url(self, url: str, path: str, json=None) -> requests.Response:
        return self._session.post(
            f"{url}{path}", json=json, headers=self.headers, timeout=min(30.0, self.request_timeout)
        )

    def complete_url(self, url: str, model: str, prompt: list[int]) -> dict:
        """One greedy token for `prompt` from this server alone (no routing); raises for an HTTP error."""
        body = {
            "model": model,
            "prompt": [prompt],
            "n": 1,
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        response = self.post_url(url, "/v1/completions", body)
        response.raise_for_status()
        return response.json()

    def _any_may_return(self, deadline: float) -> bool:
        with self._lock:
            return any((self._current(s) or s.unchecked) and s.down_until < deadline for s in self.servers)

    def _current(self, server: ServerState) -> bool:
        """Serves the current weights (as far as we know): before the first sync every server does."""
        return not server.unchecked and (self.version is None or server.version == self.version)

    def generate(
        self, prompts: list[list[int]], n: int | list[int] = 1, model: str | None = None, **sampling
    ) -> list[list[dict]]:
        """Completions for many prompts: one request per prompt with its `n` completions (an int, or one per
        prompt), so the server batches them; requests spread over the servers by load. Choices per prompt."""
        counts = n if isinstance(n, list) else [n] * len(prompts)
        if len(counts) != len(prompts):
            raise ValueError(f"n has {len(counts)} entries for {len(prompts)} prompts")
        self.refresh_versions()
        with self._lock:
            self._backlog += len(prompts)
        futures = [self._pool.submit(self.complete, p, k, model, **sampling) for p, k in zip(prompts, counts)]
        return [f.result() for f in futures]

    # ---- readiness and versions ------------------------------------------------------------------------

    def _get(self, server: ServerState, path: str, timeout: float = 10.0) -> requests.Response:
        return self._session.get(f"{server.url}{path}", headers=self.headers, timeout=timeout)

    def _post(self, server: ServerState, path: str, timeout: float, json=None) -> requests.Response:
        # JSON or nothing: no weight-sync route of vLLM's takes a binary body.
        response = self._session.post(f"{server.url}{path}", json=json, headers=self.headers, timeout=timeout)
        if response.status_code >= 400:
            raise RolloutError(f"{server.url}{path} answered {response.status_code}: {response.text[:500]}")
        return response

    def wait_until_ready(self, timeout: float) -> None:
        """Poll every server's `/health` until all answer 200, or raise naming those that did not within `timeout`.
        Servers that answered keep their place; one that never did fails the wait (it was configured, and a run
        that silently drops it would be slower than asked)."""
        deadline = time.monotonic() + timeout
        waiting = list(self.servers)
        errors: dict[str, str] = {}
        while waiting:
            for server in list(waiting):
                try:
                    response = self._get(server, "/health", timeout=max(0.5, min(5.0, deadline - time.monotonic())))
                    if response.status_code == 200:
                        waiting.remove(server)
                        continue
                    errors[server.url] = f"/health answered {response.status_code}"
                except requests.RequestException as error:
                    errors[server.url] = repr(error)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise RolloutError(
                    f"rollout servers not ready within vllm_server_timeout={timeout}s: "
                    f"{ {s.url: errors.get(s.url, '') for s in waiting} }. Fix: start them (`vllm serve` or "
                    "`trl-scale serve`), check the URLs, or raise vllm_server_timeout for large models"
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _weight_info(self, server: ServerState) -> str | None:
        """vLLM's `/weight_info` (dev mode): the version set by the last `/finish_weight_update`."""
        response = self._get(server, "/weight_info", timeout=5)
        response.raise_for_status()
        version = response.json().get("weight_version")
        return None if version is None else str(version)

    def refresh_versions(self, only_unchecked: bool = False) -> None:
        """Read back each server's weight version (concurrently, bounded): a server that restarted reports its
        original version and leaves the rotation until a sync reaches it. Unreachable servers keep what we knew
        and stay unchecked. Only after a first sync: before it, every server serves the initial weights."""
        if self.version is None:
            with self._lock:
                for server in self.servers:
                    server.unchecked = False
            return
        targets = [s for s in self.servers if s.unchecked or not only_unchecked]
        futures = {self._pool.submit(self.version_reader, s): s for s in targets}
        for future, server in futures.items():
            try:
                version = future.result(timeout=10)
            except Exception:  # unreachable or not ready: stays as it was, failover handles it
                continue
            with self._lock:
                server.version, server.unchecked = version, False
                self._lock.notify_all()

    # ---- weight sync ----------------------------------------------------------------------------------

    def _each(self, servers: list[ServerState], call, timeout: float) -> dict[str, str]:
        """`call(server)` on every server concurrently, bounded by `timeout`: the errors, by URL."""
        futures = {self._pool.submit(call, server): server for server in servers}
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
            self._get(server, "/health", timeout=min(5.0, timeout)).raise_for_status()
            alive.append(server)

        self._each(self.servers, health, timeout)
        return [s for s in self.servers if s in alive]

    def _finish(self, what: str, version: str, took: list[ServerState], failed: dict[str, str], timeout: float):
        """Record the new version; servers that did not take it stay out of the rotation until a sync does."""
        with self._lock:
            self.version = version
            for server in self.servers:
                if server in took:
                    server.version, server.unchecked = version, False
            self._lock.notify_all()
        if not took:
            raise RolloutError(
                f"{what} reached no server within weight_sync_timeout={timeout}s: {failed or 'all servers down'}"
            )
        missed = [s.url for s in self.servers if s not in took]
        if missed:
            logger.warning(
                "%s did not reach %s (%s); they stay out of the rotation until a sync reaches them",
                what,
                missed,
                failed,
            )

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
            self._each(paused, lambda s: self._post(s, "/resume", timeout), timeout)

    def _pause(self, server: ServerState) -> None:
        # It returns once the server's running generations have finished: bounded as one generation is.
        timeout = None if self.generation_timeout is None else 30.0 + self.generation_timeout
        self._post(server, "/pause?mode=wait", timeout)

    def _reset_prefix_cache(self, server: ServerState, timeout: float) -> None:
        # vLLM V1 keeps prefix caching on: blocks computed with the old weights must not be reused.
        self._post(server, "/reset_prefix_cache", timeout)

    def reload_weights(self, path: str, version: str, timeout: float = 120.0) -> None:
        """Shared-directory sync: every live server reloads the weights saved at `path` (safetensors, its own
        parameter names) with vLLM's `/collective_rpc reload_weights`, between a pause and a resume."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}

        def reload(server):
            self._post(server, "/collective_rpc", self.load_timeout, json=body)
            self._post(server, "/update_weight_version", timeout, json={"new_version": version})
            self._reset_prefix_cache(server, timeout)

        def work(paused):
            failed = self._each(paused, reload, self.load_timeout + 2 * timeout)
            return [s for s in paused if s.url not in failed], failed

        took, failed = self._paused(self._live(timeout), timeout, work)
        self._finish("weight sync (shared directory)", version, took, failed, timeout)

    def load_lora_adapter(self, name: str, path: str, version: str, timeout: float = 120.0) -> None:
        """LoRA sync by vLLM's rules: a new adapter name per sync (vLLM refuses a second load under a name unless in
        place, and keeps prefix blocks computed under the old one), then the superseded adapters unloaded: ours
        from earlier syncs and from the run this one resumed (every name with the `trl-scale-` prefix)."""

        def load(server):
            body = {"lora_name": name, "lora_path": path, "load_inplace": False}
            self._post(server, "/v1/load_lora_adapter", self.load_timeout, json=body)
            listed = self._get(server, "/v1/models", timeout=timeout).json()["data"][1:]
            for old in [m["id"] for m in listed if m["id"].startswith(LORA_PREFIX) and m["id"] != name]:
                try:
                    self._post(server, "/v1/unload_lora_adapter", timeout, json={"lora_name": old})
                except RolloutError as error:  # gone meanwhile: nothing to free
                    logger.info("unloading adapter %s on %s: %s", old, server.url, error)

        live = self._live(timeout)
        failed = self._each(live, load, self.load_timeout + 2 * timeout)
        self._finish("weight sync (LoRA adapter)", version, [s for s in live if s.url not in failed], failed, timeout)

    def lora_version(self, server: ServerState) -> str | None:
        """For LoRA sync a server's version is the newest of our adapters it lists (none after a restart)."""
        response = self._get(server, "/v1/models", timeout=5)
        response.raise_for_status()
        ids = [m["id"] for m in response.json()["data"][1:]]
        return next((i for i in reversed(ids) if i == self.version), ids[-1] if ids else None)

    # -- one weight-transfer group over every server

    def weight_transfer_backend(self, timeout: float = 30.0) -> str | None:
        """The weight-transfer backend every reachable server offers (`/server_info`'s `weight_transfer_config`), or
        None if one has none (vLLM started without `--weight-transfer-config` or without dev mode)."""
        backends = set()
        for server in self.servers:
            try:
                response = self._get(server, "/server_info?config_format=json", timeout=timeout)
            except requests.RequestException:
                continue  # down now: it joins the group when it comes back
            try:
                response.raise_for_status()
                config = (response.json().get("vllm_config") or {}).get("weight_transfer_config")
            except (requests.RequestException, ValueError, AttributeError):
                return None  # no dev-mode routes
            if not config:
                return None
            backends.add(config.get("backend", "nccl"))
        if not backends:
            return None
        if len(backends) != 1:
            raise RolloutError(f"the servers offer different weight-transfer backends: {sorted(backends)}")
        return backends.pop()

    def _build_group(self, members: list[ServerState], make_sender: Callable, timeout: float) -> None:
        for server in members:
            response = self._get(server, "/get_world_size", timeout=timeout)
            response.raise_for_status()
            server.world_size = int(response.json()["world_size"])
        from .weight_transfer import group_layout

        world_size, offsets = group_layout([s.world_size for s in members])
        sender = make_sender()
        address, port = _trainer_address([s.url for s in members]), _free_port()
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
            requests_out[server.url] = self._pool.submit(
                self._post, server, "/init_weight_transfer_engine", timeout, {"init_info": init_info}
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
        self._group = {"sender": sender, "members": [s.url for s in members]}
        logger.info("weight-transfer group: world size %d, offsets %s", world_size, dict(zip(requests_out, offsets)))

    def update_weights(
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
            raise RolloutError(f"weight sync: no server answers /health ({[s.url for s in self.servers]})")
        self.refresh_versions()
        members = self._group["members"] if self._group else []
        restarted = [s for s in live if s.url in members and self.version is not None and s.version != self.version]
        if [s.url for s in live] != members or restarted:
            self._close_group()
            self._build_group(live, make_sender, timeout)
        update_info = {
            "names": [name for name, _, _ in metadata],
            "dtype_names": [dtype for _, dtype, _ in metadata],
            "shapes": [list(shape) for _, _, shape in metadata],
        }
        sender = self._group["sender"]

        def work(paused):
            if len(paused) != len(live):
                raise RolloutError(f"weight sync: {len(live) - len(paused)} group member(s) did not pause")
            refused = self._each(paused, lambda s: self._post(s, "/start_weight_update", timeout, json={}), timeout)
            if refused:
                raise RolloutError(f"weight sync: /start_weight_update failed on {refused}; nothing was sent")
            receiving = {
                s.url: self._pool.submit(
                    self._post, s, "/update_weights", self.load_timeout, {"update_info": update_info}
                )
                for s in paused
            }
            failure = _broadcast(sender, named_tensors, receiving, self._pool, time.monotonic() + self.load_timeout)
            if failure:
                self._close_group()
                raise RolloutError(
                    f"weight broadcast abandoned: {failure}. Every rank finished its parameter walk; the next sync "
                    "rebuilds the group without the servers that left"
                )

            def finish(server):
                self._post(server, "/finish_weight_update", timeout, json={"weight_version": version})
                self._reset_prefix_cache(server, timeout)

            failed = self._each(paused, finish, timeout)
            return [s for s in paused if s.url not in failed], failed

        took, failed = self._paused(live, timeout, work)
        self._finish("weight sync", version, took, failed, timeout)

    def _close_group(self) -> None:
        if self._group:
            self._group["sender"].close()
        self._group = None

    def push_weights(self, state_dict: dict, timeout: float = 120.0, version: str | None = None) -> str:
        """Send a full state dict over the servers' weight-transfer engine (tools and tests); returns the version."""
        from .weight_transfer import make_sender

        backend = self.weight_transfer_backend()
        if backend is None:
            raise RolloutError("the servers offer no weight-transfer engine (/server_info weight_transfer_config)")
        metadata = [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state_dict.items()]
        version = version or f"push-{uuid.uuid4().hex[:8]}"
        self.update_weights(
            metadata, iter(state_dict.items()), version, lambda: make_sender(backend, timeout), timeout=timeout
        )
        return version

    def close(self) -> None:
        self._close_group()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()


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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _trainer_address(urls: list[str]) -> str:
    """The address the servers reach the trainer at: loopback when they all run here, else the local address of
    the route to the first server."""
    hosts = [urlparse(url).hostname or "" for url in urls]

    def loopback(host: str) -> bool:
        try:
            return host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    if all(loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], 80))  # no packet is sent: this only picks the outgoing interface
        return probe.getsockname()[0]
