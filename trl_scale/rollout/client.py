"""A rollout client over one or many OpenAI-compatible completion servers (vLLM's, or `trl-scale serve`).

- Readiness: `wait_until_ready` polls `/health` (a real model loads for minutes) before the first request.
- Routing: at most `max_inflight_per_server` requests in flight per server; a request (one prompt, its `n`
  completions) goes where the routing policy (`routing.py`, chosen by name) picks: by default the fastest free
  server (observed latency), and a slower one only if it finishes there before the faster servers could clear the
  queue: not an even split.
- Failover: a server that errors or times out leaves the rotation for `retry_after` seconds and its request is
  re-sent to another; with every server down the call fails with `RolloutError` within `request_timeout`.
- Timeouts, apart because they bound different waits: `request_timeout` bounds waiting for a server to take a
  request (a free slot, a failover); `generation_timeout` bounds one server generating it (None: no limit, as
  TRL's client); `load_timeout` bounds a server receiving or loading weights (read by the weight-sync modes).
- Weight versions (`versions.py`, the client's `versions`): every sync (`weight_sync/`, one strategy per mode) has
  a version; each server's is read back (`/weight_info`, or the adapter list for LoRA), and only servers on the
  current version get requests. A server that restarted (and so serves its original weights) or missed a sync is
  out of the rotation until a sync reaches it.
- HTTP (`transport.py`, the client's `transport`): one pooled session, the API key, plain calls by server or URL.

Only `requests` is needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeoutError

import numpy as np
import requests

from ..errors import RolloutError
from ..logs import get_logger
from ..routing import Rotation, RoutingPolicy, ServerState, routing_policy
from .seeds import continued_seed
from .transport import Transport
from .urls import definite_failure
from .versions import VersionBook

logger = get_logger(__name__)


VERSION_PREFIX = "trl-scale-"  # every weight version this run names (and, under LoRA, the adapters it loads)
SERVER_KEY = "_trl_scale_server"  # set on each returned choice: the server that generated it


REDRAWS = 8  # draws of one answer that may hold a token of `redraw_tokens` before the run stops

# 4xx answers that mean "not now" rather than "not this request": failed over like a 5xx (every other 4xx is final:
# another server would refuse the same request).
RETRYABLE = (408, 429)


def _check_choices(choices, n: int, cut_allowed: bool = False) -> None:
    """A completions response must hold `n` choices with token ids; anything else is a server fault. An aborted
    choice is one too, unless the caller continues cut answers (`cut_allowed`)."""
    if not isinstance(choices, list) or len(choices) != n:
        count = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise ValueError(f"malformed response: {count} choices for n={n}")
    if not all(isinstance(c, dict) and isinstance(c.get("token_ids"), list) for c in choices):
        raise ValueError("malformed response: a choice without a token_ids list")
    aborted = sum(c.get("finish_reason") == "abort" for c in choices)
    if aborted and not cut_allowed:
        # vLLM answers 200 with the tokens so far when a generation is aborted (`/pause?mode=abort`, vLLM's default
        # mode, `/abort_requests`, sleep): a cut-off answer, never a completion to train on. Sent again.
        raise ValueError(f"the server aborted {aborted} of {len(choices)} generations (finish_reason 'abort')")


def joined(cut: dict, rest: dict) -> dict:
    """A cut choice and its continuation as one choice: token ids, text and per-token log-prob fields concatenated;
    the continuation's finish reason; the cut part's index and prompt; the routes of the weights that drew each
    token, where the server returns routes."""
    whole = dict(rest)
    whole["token_ids"] = list(cut["token_ids"]) + list(rest["token_ids"])
    whole["text"] = (cut.get("text") or "") + (rest.get("text") or "")
    for key in ("index", "prompt_token_ids"):
        if key in cut:
            whole[key] = cut[key]
    first, second = cut.get("logprobs"), rest.get("logprobs")
    if isinstance(first, dict) and isinstance(second, dict):
        merged = {key: list(first.get(key) or []) + list(second.get(key) or []) for key in second}
        if "text_offset" in merged and first.get("text_offset") is not None:  # offsets into the joined text
            shift = len(cut.get("text") or "")
            merged["text_offset"] = list(first["text_offset"]) + [o + shift for o in second.get("text_offset") or []]
        whole["logprobs"] = merged
    if cut.get("routed_experts") and rest.get("routed_experts"):
        whole["routed_experts"] = joined_routes(cut["routed_experts"], rest["routed_experts"])
    return whole


def joined_routes(cut: str, rest: str) -> str:
    """The routes of a cut choice and its continuation (vLLM's `routed_experts`, from prompt token 0): the cut
    request's for every token it forwarded (the weights that drew them), the continuation's after (its prefill read
    the cut part's last token first)."""
    from ..scoring.routing_replay import decode_routes, encode_routes

    first, second = decode_routes(cut), decode_routes(rest)
    return encode_routes(np.concatenate([first, second[len(first) :]]))


class FleetMembership:
    """Which servers a client routes over, changed while it runs: a managed server that moved, one the mismatch gate
    drops. (`servers` is the list the rotation and the version book share; `_lock` guards it.)"""

    servers: list[ServerState]

    def replace_url(self, old: str, new: str) -> None:
        """A server that moved (a managed server restarted on another node): the new address, on no version (out of
        the rotation until a weight sync reaches it)."""
        with self._lock:
            for server in self.servers:
                if server.url == old.rstrip("/"):
                    server.url, server.version, server.unchecked = new.rstrip("/"), None, True
                    server.world_size = 0
            self.transport.forget(old.rstrip("/"))

    def retire(self, url: str) -> None:
        """Take the server at `url` out of the fleet for the rest of the run (the mismatch gate's "drop"): nothing is
        routed to it, and weight syncs leave it out. The last server is never retired."""
        with self._lock:
            kept = [server for server in self.servers if server.url != url.rstrip("/")]
            if not kept:
                raise RolloutError(f"{url} is the last rollout server: retiring it would leave none")
            self.servers[:] = kept  # the rotation and the version book share this list
            self._busy_read = ([server.busy_until(time.monotonic()) for server in kept], time.monotonic())
            self._lock.notify_all()


class RolloutClient(FleetMembership):
    """Routes completion requests over the servers and fails them over; holds the servers' routing state, the
    request threads, the version book (`versions`) and the HTTP transport (`transport`)."""

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
        routing: RoutingPolicy | str = "latency",
        redraw_tokens: frozenset[int] = frozenset(),
        timeline=None,
    ):
        """`redraw_tokens`: token ids a completion must not hold; an answer that samples one is drawn again (a
        vision-language policy's image token: TRL's step cannot pair it with an image, and TRL's local generation
        suppresses it)."""
        if not base_urls:
            raise ValueError("vllm_server_base_urls is empty: give at least one server URL")
        self.servers = [ServerState(url.rstrip("/")) for url in base_urls]
        self.request_timeout = request_timeout
        self.generation_timeout = generation_timeout
        self.load_timeout = load_timeout
        self._lock = threading.Condition()
        # Requests beyond `max_inflight_per_server` wait in the client and go to whichever server frees up first:
        # that is what makes the routing load-aware (with no cap, least-outstanding degenerates into an even split).
        policy = routing_policy(routing) if isinstance(routing, str) else routing
        self.rotation = Rotation(
            self.servers, policy, max_inflight_per_server, retry_after, self._lock, "rollout server"
        )
        # Enough threads that the in-flight cap, not the pool, bounds the requests on the wire (+ weight-sync calls).
        workers = max_workers or max(32, len(self.servers) * (max_inflight_per_server + 2))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        self.transport = Transport(api_key, workers, request_timeout, timeline)
        self.versions = VersionBook(self.servers, self._lock, self.weight_version)
        # A trainer waits through refused connections (a starting vLLM refuses them while its model loads); commands
        # that talk to running servers (`trl-scale rollout`) set this to fail at once.
        self.refused_is_definite = False
        self.answers_continued = 0  # cut answers continued (partial rollout): `complete(continue_cut=True)`
        self.redraw_tokens = frozenset(redraw_tokens)
        self.answers_redrawn = 0  # answers that sampled one of `redraw_tokens`, drawn again
        self._busy_read = ([0.0] * len(self.servers), time.monotonic())  # `busy_fractions`' last reading

    @property
    def routing(self) -> RoutingPolicy:
        return self.rotation.policy

    def busy_fractions(self) -> list[float]:
        """Each server's share of the time since the last call (or since the client was made) in which at least one
        of this process's requests was in flight on it, in server order."""
        with self._lock:
            now = time.monotonic()
            totals = [server.busy_until(now) for server in self.servers]
        before, read_at = self._busy_read
        self._busy_read = (totals, now)
        wall = now - read_at
        return [min(1.0, (total - old) / wall) if wall > 0 else 0.0 for total, old in zip(totals, before)]

    # ---- server selection -----------------------------------------------------------------------------------

    def _acquire(self, exclude: set[str], deadline: float) -> ServerState | None:
        """A server for one request on the current weights (the routing policy's pick), or None (`Rotation`)."""
        return self.rotation.acquire(exclude, deadline, self.versions.is_current)

    def _release(self, server: ServerState, ok: bool, error: str = "", seconds: float | None = None) -> None:
        self.rotation.release(server, ok, error, seconds)

    # ---- generation ---------------------------------------------------------------------------------------

    def complete(
        self,
        prompt: list[int],
        n: int = 1,
        model: str | None = None,
        on_dispatch=None,
        continue_cut: bool = False,
        _draws: int = 0,
        **sampling,
    ) -> list[dict]:
        """One `/v1/completions` request for one prompt, routed and retried; returns vLLM-shaped choices. Waiting
        for a server to take it is bounded by `request_timeout` (again after each failover), its generation by
        `generation_timeout`; each server is tried at most once per round. `on_dispatch()` is called right before
        each send (a failover sends again). An answer the server cut (finish_reason "abort") is sent again whole,
        or, with `continue_cut` (partial rollout), continued from where it stopped (`_continued`). An answer
        holding a token of `redraw_tokens` is drawn again (`_redrawn`; `_draws`: the draws so far)."""
        deadline = time.monotonic() + self.request_timeout
        tried: set[str] = set()
        errors = []
        payload = {"prompt": [prompt], "n": n, "return_token_ids": True, **sampling}
        while time.monotonic() < deadline:
            server = self._acquire(tried, deadline)
            if server is None:
                if len(tried) >= len(self.servers) or not self._any_may_return(deadline):
                    break
                tried.clear()  # every server was tried once; wait for one to come back
                time.sleep(min(0.2, self.rotation.retry_after))
                self.versions.refresh(self.submit, only_unchecked=True)
                continue
            try:
                choices = self._send(server, {**payload, "model": model}, continue_cut, on_dispatch)
            except RolloutError:
                raise
            except Exception as error:  # connection refused, timeout, 5xx: fail over
                self._release(server, ok=False, error=repr(error))
                tried.add(server.url)
                errors.append(f"{server.url}: {error!r}")
                deadline = time.monotonic() + self.request_timeout  # the failover waits afresh
                continue
            if continue_cut and any(c.get("finish_reason") == "abort" for c in choices):
                choices = self._all_continued(prompt, choices, model, sampling)  # this server's part is done
            if self.redraw_tokens:
                choices = self._redrawn(prompt, choices, model, sampling, continue_cut, _draws)
            return choices
        limit = "no limit" if self.generation_timeout is None else f"{self.generation_timeout:g}s"
        raise RolloutError(
            f"no rollout server answered: none took the request within rollout_request_timeout="
            f"{self.request_timeout:g}s (each generation may take rollout_generation_timeout: {limit}). Servers: "
            f"{[s.url for s in self.servers]}. Errors: {errors[-3:] or 'all servers down or stale'}"
        )

    def _send(self, server: ServerState, payload: dict, continue_cut: bool, on_dispatch) -> list[dict]:
        """One request to the server `_acquire` gave; released here when it answered (a failure is the caller's)."""
        payload["model"] = payload["model"] or self.transport.model_name(server)
        if on_dispatch is not None:
            on_dispatch()
        sent = time.monotonic()
        response = self.transport.completions(server, payload, self.generation_timeout, on_dispatch)
        if 400 <= response.status_code < 500 and response.status_code not in RETRYABLE:
            self._release(server, ok=True)
            raise RolloutError(f"{server.url} rejected the request ({response.status_code}): {response.text}")
        response.raise_for_status()  # 5xx, 408, 429: fail over
        choices = response.json()["choices"]  # malformed JSON raises here: a server fault, fail over
        _check_choices(choices, payload["n"], cut_allowed=continue_cut)
        self._release(server, ok=True, seconds=time.monotonic() - sent)
        for choice in choices:
            choice[SERVER_KEY] = server.url
        return choices

    def _redrawn(self, prompt, choices: list[dict], model, sampling: dict, continue_cut: bool, draws: int) -> list:
        """`choices`, each holding a token of `redraw_tokens` drawn again (its own seed), up to `REDRAWS` times in
        all: the answers kept are the sampler's, conditioned on holding none (every token keeps its log-prob)."""
        kept = []
        for place, choice in enumerate(choices):
            if not self.redraw_tokens.intersection(choice["token_ids"]):
                kept.append(choice)
                continue
            with self._lock:
                first = self.answers_redrawn == 0
                self.answers_redrawn += 1
            if first:
                logger.warning(
                    f"{choice.get(SERVER_KEY)} sampled a token of {sorted(self.redraw_tokens)} (a vision-language "
                    "policy's image token, which TRL's step cannot pair with an image); the answer is drawn again. "
                    "Said once; RolloutClient.answers_redrawn counts them."
                )
            if draws >= REDRAWS:
                raise RolloutError(
                    f"the policy sampled a token of {sorted(self.redraw_tokens)} in {REDRAWS} draws of one answer "
                    "in a row (its image token: TRL's step cannot pair it with an image). Fix: lower the "
                    "temperature, or train the policy on answers without it first"
                )
            redraw = dict(sampling)
            if sampling.get("seed") is not None:  # its own draws: not the first answer's, nor another choice's
                redraw["seed"] = continued_seed(sampling["seed"], -(1 + draws + (REDRAWS + 1) * place))
            (again,) = self.complete(prompt, 1, model, continue_cut=continue_cut, _draws=draws + 1, **redraw)
            kept.append({**again, "index": choice.get("index", again.get("index"))})
        return kept

    def _all_continued(self, prompt: list[int], choices: list[dict], model: str | None, sampling: dict) -> list:
        """Each cut choice continued (`_continued`), at the same time: one thread each (not the request pool, which
        the calling thread may be one of)."""
        results: list = [None] * len(choices)

        def run(index: int) -> None:
            try:
                results[index] = self._continued(prompt, choices[index], model, sampling)
            except BaseException as error:  # raised in the caller's thread below
                results[index] = error

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(choices))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def _continued(self, prompt: list[int], choice: dict, model: str | None, sampling: dict) -> dict:
        """A choice the server cut (a sync's `/pause?mode=abort`) continued to its end: the prompt and its tokens so
        far are the next request's prompt (sent like any, so it waits out the pause and runs on the new weights),
        within what is left of `max_tokens`; the two parts joined, each token keeping the log-prob of the weights
        that drew it. A whole choice is returned as it is."""
        if choice.get("finish_reason") != "abort":
            return choice
        done = list(choice["token_ids"])
        left = sampling.get("max_tokens")
        if left is not None and left - len(done) <= 0:
            return {**choice, "finish_reason": "length"}
        rest_sampling = dict(sampling) if left is None else {**sampling, "max_tokens": left - len(done)}
        if sampling.get("seed") is not None:  # its own draws, not the first part's again
            rest_sampling["seed"] = continued_seed(sampling["seed"], len(done))
        with self._lock:
            self.answers_continued += 1
        (rest,) = self.complete(prompt + done, 1, model, continue_cut=True, **rest_sampling)
        return joined(choice, rest)

    def render(self, images: list[str], row: int) -> dict:
        """The features of one prompt's images (data URLs), rendered once by any server that answers
        (`/v1/chat/completions/render`) and paired with each of the prompt's requests. A server that refuses the
        images (4xx) fails the run naming the row and the server; one that is down is failed over."""
        content = [{"type": "image_url", "image_url": {"url": url}} for url in images]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        errors = []
        for server in list(self.servers):
            try:
                response = self.transport.post_url(server.url, "/v1/chat/completions/render", body)
            except requests.RequestException as error:
                errors.append(f"{server.url}: {error!r}")
                continue
            if response.status_code == 404:
                errors.append(f"{server.url} serves no /v1/chat/completions/render (vLLM: --enable-scale-out)")
                continue
            if 400 <= response.status_code < 500:
                raise RolloutError(
                    f"{server.url} refused the images of row {row} ({response.status_code}): {response.text[:500]}"
                )
            if response.ok:
                return response.json()["features"]
            errors.append(f"{server.url}: {response.status_code}")
        raise RolloutError(f"no rollout server rendered the images of row {row}: {errors[-3:]}")

    def _any_may_return(self, deadline: float) -> bool:
        with self._lock:
            return any((self.versions.is_current(s) or s.unchecked) and s.down_until < deadline for s in self.servers)

    def generate(
        self,
        prompts: list[list[int]],
        n: int | list[int] = 1,
        model: str | None = None,
        per_request: list[dict] | None = None,
        **sampling,
    ) -> list[list[dict]]:
        """Completions for many prompts: one request per prompt with its `n` completions (an int, or one per
        prompt), so the server batches them; requests spread over the servers by load. Choices per prompt. Each
        request's sampling is `sampling` updated with its entry of `per_request` (each its own seed, say)."""
        counts = n if isinstance(n, list) else [n] * len(prompts)
        if len(counts) != len(prompts):
            raise ValueError(f"n has {len(counts)} entries for {len(prompts)} prompts")
        self.versions.refresh(self.submit)
        with self._lock:
            self.rotation.backlog += len(prompts)
        own = per_request or [{}] * len(prompts)
        futures = [
            self._pool.submit(self.complete, p, k, model, **{**sampling, **extra})
            for p, k, extra in zip(prompts, counts, own, strict=True)
        ]
        return [f.result() for f in futures]

    # ---- readiness and versions ------------------------------------------------------------------------

    def wait_until_ready(self, timeout: float) -> None:
        """Poll every server's `/health` until all answer 200, or raise naming those that did not within `timeout`.
        Servers that answered keep their place; one that never did fails the wait (it was configured, and a run
        that silently drops it would be slower than asked)."""
        deadline = time.monotonic() + timeout
        waiting = list(self.servers)
        errors: dict[str, str] = {}
        while waiting:
            for server in list(waiting):
                status, failure = None, None
                try:
                    wait = max(0.5, min(5.0, deadline - time.monotonic()))
                    response = self.transport.get(server, "/health", timeout=wait)
                    if response.status_code == 200:
                        waiting.remove(server)
                        continue
                    status = response.status_code
                    errors[server.url] = f"/health answered {status}"
                except requests.RequestException as error:
                    failure = error
                    errors[server.url] = repr(error)
                definite = definite_failure(server.url, status, failure, refused_is_definite=self.refused_is_definite)
                if definite:  # no wait heals it: say so now, not after vllm_server_timeout
                    raise RolloutError(f"rollout server not usable: {definite}")
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise RolloutError(
                    f"rollout servers not ready within vllm_server_timeout={timeout}s: "
                    f"{ {s.url: errors.get(s.url, '') for s in waiting} }. Fix: start them (`vllm serve` or "
                    "`trl-scale serve`), check the URLs, or raise vllm_server_timeout for large models"
                )
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def weight_version(self, server: ServerState) -> str | None:
        """vLLM's `/weight_info` (dev mode): the version set by the last `/finish_weight_update`."""
        response = self.transport.get(server, "/weight_info", timeout=5)
        response.raise_for_status()
        version = response.json().get("weight_version")
        return None if version is None else str(version)

    # ---- what the weight-sync modes use: the one place they touch the router's state --------------------------

    def submit(self, fn, *args, **kwargs) -> Future:
        """`fn(*args, **kwargs)` on the client's threads (a call that blocks, e.g. a weight-transfer rendezvous)."""
        return self._pool.submit(fn, *args, **kwargs)

    def each(
        self, servers: list[ServerState], call: Callable[[ServerState], object], timeout: float
    ) -> dict[str, str]:
        """`call(server)` on every server concurrently, bounded by `timeout`: the errors, by URL."""
        futures = {self._pool.submit(call, server): server for server in servers}
        failed: dict[str, str] = {}
        try:
            for future in as_completed(futures, timeout=timeout + 5):
                try:
                    future.result()
                except Exception as error:
                    failed[futures[future].url] = f"{type(error).__name__}: {error}"
        except FutureTimeoutError:
            for future, server in futures.items():
                if not future.done():
                    failed[server.url] = f"no answer within weight_sync_timeout={timeout}s"
        return failed

    def live(self, timeout: float) -> list[ServerState]:
        """The servers answering `/health` now, in server order."""
        alive = []

        def health(server: ServerState) -> None:
            self.transport.get(server, "/health", timeout=min(5.0, timeout)).raise_for_status()
            alive.append(server)

        self.each(self.servers, health, timeout)
        return [s for s in self.servers if s in alive]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
