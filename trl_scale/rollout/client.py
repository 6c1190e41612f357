"""A rollout client over one or many OpenAI-compatible completion servers (vLLM's, or `trl-scale serve`).

- Routing: at most `max_inflight_per_server` requests in flight per server; a request goes to the fastest free
  server (observed latency), and to a slower one only if it finishes there before the faster servers could
  clear the queue: not an even split, so a slow server gets fewer requests and never the last one.
- Failover: a server that errors or times out leaves the rotation for `retry_after` seconds and its request is
  re-sent to another; with every server down the call fails with `RolloutError` within `request_timeout`.
- Weight sync: full weights as one safetensors body over HTTP, or through a shared directory, or a LoRA adapter,
  to every server in parallel, each bounded by `timeout`. A server that misses a sync is kept out of the rotation
  until a later sync reaches it, so no completion comes from stale weights.

Only `requests` is needed: no vLLM in the trainer.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import requests

logger = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """A rollout or weight sync that cannot complete; the message names the servers and the cause."""


@dataclass
class ServerState:
    url: str
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    down_until: float = 0.0
    stale: bool = False  # missed a weight sync: out of the rotation until one reaches it
    last_error: str = ""
    latency: float = 0.0  # moving average of seconds per request (0 until measured: tried first)


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
        max_workers: int = 32,
        max_inflight_per_server: int = 8,
    ):
        if not base_urls:
            raise ValueError("vllm_server_base_urls is empty: give at least one server URL")
        self.servers = [ServerState(url.rstrip("/")) for url in base_urls]
        self.request_timeout = request_timeout
        self.retry_after = retry_after
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Requests beyond this many per server wait in the client and go to whichever server frees up first: that
        # is what makes the routing load-aware (with no cap, least-outstanding degenerates into an even split).
        self.max_inflight_per_server = max_inflight_per_server
        self._lock = threading.Condition()
        self._backlog = 0  # requests submitted through generate() and not yet sent
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout")
        self._session = requests.Session()
        self._model_names: dict[str, str] = {}

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
                usable = [s for s in self.servers if s.url not in exclude and not s.stale and s.down_until <= now]
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
                server.down_until = time.monotonic() + self.retry_after
                logger.warning("rollout server %s left the rotation: %s", server.url, error)

    def _model_name(self, server: ServerState) -> str | None:
        if server.url not in self._model_names:
            response = self._session.get(f"{server.url}/v1/models", headers=self.headers, timeout=10)
            response.raise_for_status()
            self._model_names[server.url] = response.json()["data"][0]["id"]
        return self._model_names[server.url]

    # ---- generation ---------------------------------------------------------------------------------------

    def complete(self, prompt: list[int], n: int = 1, model: str | None = None, **sampling) -> list[dict]:
        """One `/v1/completions` request for one prompt, routed and retried; returns vLLM-shaped choices."""
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
                continue
            try:
                payload = {"prompt": [prompt], "n": n, "return_token_ids": True, **sampling}
                payload["model"] = model or self._model_name(server)
                timeout = max(0.1, deadline - time.monotonic())
                sent = time.monotonic()
                response = self._session.post(
                    f"{server.url}/v1/completions", json=payload, headers=self.headers, timeout=timeout
                )
                if 400 <= response.status_code < 500:
                    self._release(server, ok=True)
                    raise RolloutError(f"{server.url} rejected the request ({response.status_code}): {response.text}")
                response.raise_for_status()
                choices = response.json()["choices"]  # malformed JSON raises here: a server fault, fail over
                _check_choices(choices, n)
                self._release(server, ok=True, seconds=time.monotonic() - sent)
                return choices
            except RolloutError:
                raise
            except Exception as error:  # connection refused, timeout, 5xx: fail over
                self._release(server, ok=False, error=repr(error))
                tried.add(server.url)
                errors.append(f"{server.url}: {error!r}")
        raise RolloutError(
            f"no rollout server answered within request_timeout={self.request_timeout}s. "
            f"Servers: {[s.url for s in self.servers]}. Errors: {errors[-3:] or 'all servers down or stale'}"
        )

    def _any_may_return(self, deadline: float) -> bool:
        with self._lock:
            return any(not s.stale and s.down_until < deadline for s in self.servers)

    def generate(self, prompts: list[list[int]], n: int = 1, model: str | None = None, **sampling) -> list[list[dict]]:
        """Completions for many prompts: one request per prompt, spread over the servers by load."""
        with self._lock:
            self._backlog += len(prompts)
        futures = [self._pool.submit(self.complete, p, n, model, **sampling) for p in prompts]
        return [f.result() for f in futures]

    # ---- weight sync --------------------------------------------------------------------------------------

    def _broadcast(self, send, what: str, timeout: float) -> None:
        futures = {self._pool.submit(send, server, timeout): server for server in self.servers}
        failed = []
        try:
            for future in as_completed(futures, timeout=timeout + 5):
                server = futures[future]
                try:
                    future.result()
                    with self._lock:
                        server.stale = False
                except Exception as error:
                    failed.append(f"{server.url}: {error!r}")
                    with self._lock:
                        server.stale = True
                        server.last_error = repr(error)
        except TimeoutError:
            for future, server in futures.items():
                if not future.done():
                    failed.append(f"{server.url}: no answer within weight_sync_timeout={timeout}s")
                    with self._lock:
                        server.stale = True
        fresh = [s.url for s in self.servers if not s.stale]
        if failed and not fresh:
            raise RolloutError(f"{what} failed on every server within weight_sync_timeout={timeout}s: {failed}")
        if failed:
            logger.warning("%s failed on %s; they stay out of the rotation until a sync reaches them", what, failed)

    def update_weights(self, named_tensors: dict, timeout: float = 120.0) -> None:
        """Send full weights (name -> tensor, the server's parameter names) as one safetensors body."""
        from safetensors.torch import save

        body = save({name: t.detach().contiguous().cpu() for name, t in named_tensors.items()})

        def send(server: ServerState, timeout: float) -> None:
            response = self._session.post(
                f"{server.url}/update_weights",
                data=io.BytesIO(body),
                headers={**self.headers, "Content-Type": "application/octet-stream"},
                timeout=timeout,
            )
            response.raise_for_status()

        self._broadcast(send, "weight sync (http)", timeout)

    def update_weights_from_path(self, path: str, timeout: float = 120.0) -> None:
        def send(server: ServerState, timeout: float) -> None:
            response = self._session.post(
                f"{server.url}/update_weights_from_path", json={"path": path}, headers=self.headers, timeout=timeout
            )
            response.raise_for_status()

        self._broadcast(send, "weight sync (shared directory)", timeout)

    def load_lora_adapter(self, name: str, path: str, timeout: float = 120.0) -> None:
        def send(server: ServerState, timeout: float) -> None:
            response = self._session.post(
                f"{server.url}/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": path, "load_inplace": False},
                headers=self.headers,
                timeout=timeout,
            )
            response.raise_for_status()

        self._broadcast(send, "weight sync (LoRA adapter)", timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()
