"""`RemoteReward`: a reward function that scores completions on reward servers over HTTP, in OpenRLHF's contract
(`contract.py`) or a user's adapter.

- One request per prompt group (consecutive rows with the same prompt, as TRL's sampler lays them out), or per
  `rows_per_request` rows; the requests of a batch go out at once, at most `max_concurrency`.
- Several URLs routed by the rollout router's policies and rotation (`trl_scale/routing.py`): at most
  `max_inflight_per_server` each, the fastest free server first; a server that fails (refused, timed out, 5xx, 408,
  429) leaves the rotation for `retry_after` seconds and the request goes to another, up to `retries` re-sends.
- Never a silent 0 or NaN: when every attempt failed, `RewardServiceError` names every URL and its last error; an
  answer of the wrong length or with a non-number names the server and the field; another 4xx names the server and
  its message (another server would refuse the same request).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import requests

from ..logs import get_logger
from ..net import is_loopback
from ..numbers import check_positive, check_whole
from ..routing import ROUTING_POLICIES, Rotation, ServerState, routing_policy
from .contract import OpenRLHFContract, RewardContract, RewardServiceError

RETRYABLE = (408, 429)  # "not now": failed over like a 5xx
logger = get_logger(__name__)


def _in_clear(urls: list[str]) -> list[str]:
    """The plain-HTTP URLs off this machine: a bearer token sent there crosses the network readable."""
    return [url for url in urls if urlparse(url).scheme == "http" and not is_loopback(urlparse(url).hostname)]


def _error_text(error: requests.RequestException) -> str:
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, requests.exceptions.SSLError) and "WRONG_VERSION_NUMBER" in str(error):
        text += " (an https:// URL to a plain-HTTP server: use http://, or serve with --tls-cert/--tls-key)"
    elif isinstance(error, requests.exceptions.ConnectionError) and (
        "RemoteDisconnected" in str(error) or "ConnectionResetError" in str(error)
    ):  # what a server speaking TLS does with a plain-HTTP request: it closes the connection without an answer
        text += " (the server closed the connection without answering: if it serves HTTPS (--tls-cert), use https://)"
    return text


@dataclass
class RemoteRewardSettings:
    """How `RemoteReward` talks to its servers.

    Args:
        timeout: seconds one request may take on one server (connect and answer).
        retries: re-sends of a request after a failure, each to another server when one is up.
        retry_after: seconds a failing server stays out of the rotation.
        max_concurrency: requests in flight at once, over all servers.
        max_inflight_per_server: requests in flight on one server.
        rows_per_request: rows per request; None: one request per prompt group.
        api_key: bearer token sent to the servers (`trl-scale reward-server --api-key`).
        routing: the rollout router's policy by name ("latency", "least_outstanding").
        label_column: the dataset column sent as OpenRLHF's `labels` (a list or dict is sent as JSON); None: "".
    """

    timeout: float = 60.0
    retries: int = 3
    retry_after: float = 5.0
    max_concurrency: int = 16
    max_inflight_per_server: int = 8
    rows_per_request: int | None = None
    api_key: str | None = None
    routing: str = "latency"
    label_column: str | None = None

    def __post_init__(self):
        check_positive("timeout", self.timeout)
        check_whole("retries", self.retries, minimum=0)
        check_positive("retry_after", self.retry_after)
        check_whole("max_concurrency", self.max_concurrency, minimum=1)
        check_whole("max_inflight_per_server", self.max_inflight_per_server, minimum=1)
        check_whole("rows_per_request", self.rows_per_request, minimum=1, optional=True)
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing={self.routing!r}: use one of {sorted(ROUTING_POLICIES)}")


class RemoteReward:
    """A reward function (for `reward_funcs` of every trainer) scored by reward servers.

    Args:
        urls: the servers' URLs, each as requests are posted to it (OpenRLHF's: `http://host:port/get_reward`).
        tokenizer: renders conversational prompts and completions as text with its chat template (OpenRLHF sends
            the decoded sequence); not needed for text prompts.
        adapter: another JSON shape (`RewardContract`); default OpenRLHF's.
        **settings: `RemoteRewardSettings`' fields.
    """

    def __init__(self, urls: list[str] | str, tokenizer=None, adapter: RewardContract | None = None, **settings):
        self.settings = RemoteRewardSettings(**settings)
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"urls={urls!r}: give one or more http(s):// URLs of reward servers")
        self.servers = [ServerState(url.rstrip("/")) for url in urls]
        s = self.settings
        self.rotation = Rotation(
            self.servers, routing_policy(s.routing), s.max_inflight_per_server, s.retry_after, what="reward server"
        )
        self.tokenizer, self.contract = tokenizer, adapter or OpenRLHFContract()
        self._pool = ThreadPoolExecutor(s.max_concurrency, thread_name_prefix="remote-reward")
        self._session = requests.Session()
        adapter_ = requests.adapters.HTTPAdapter(pool_maxsize=s.max_concurrency)
        self._session.mount("http://", adapter_)
        self._session.mount("https://", adapter_)
        self._headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        if s.api_key and _in_clear(urls):
            logger.warning(
                "RemoteReward sends its api_key in clear over plain HTTP to %s (off this machine): anyone on the path "
                "can read it. Use https:// (trl-scale reward-server --tls-cert/--tls-key, or a TLS proxy)",
                ", ".join(_in_clear(urls)),
            )
        self.failovers = 0  # requests re-sent after a failure, since the reward was made
        self._warned_nan = threading.Event()
        self.__name__ = "remote_reward"  # TRL names the reward's metrics after it

    def __call__(self, prompts: list, completions: list, log_metric=None, **kwargs) -> list[float | None]:
        queries, prompt_texts = self._texts(prompts, completions)
        labels = self._labels(kwargs, len(completions))
        started, failovers = time.monotonic(), self.failovers
        futures = [
            self._pool.submit(self._score, queries[a:b], prompt_texts[a:b], labels[a:b])
            for a, b in self._requests(prompt_texts)
        ]
        rewards, logs = [], {}
        for future in futures:
            values, extra = future.result()
            rewards.extend(values)
            for name, value in extra.items():
                logs.setdefault(name, []).append(value)
        self._warn_nan_once(rewards)
        if log_metric is not None:
            log_metric("remote_reward/seconds", time.monotonic() - started)
            log_metric("remote_reward/failovers", float(self.failovers - failovers))
            for name, values in logs.items():
                log_metric(f"remote_reward/{name}", sum(values) / len(values))
        return rewards

    def _warn_nan_once(self, rewards: list) -> None:
        nans = sum(1 for r in rewards if r is not None and math.isnan(r))
        if nans and not self._warned_nan.is_set():
            self._warned_nan.set()
            logger.warning(
                "a reward server answered NaN for %d of %d rows: taken as 'this reward does not apply' (None), as TRL "
                "reads NaN. If the server meant a failure, have it answer an error (once; later NaNs are not warned)",
                nans,
                len(rewards),
            )

    # ---- the rows' texts and the requests --------------------------------------------------------------------

    def _texts(self, prompts: list, completions: list) -> tuple[list[str], list[str]]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        if all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions):
            return [p + c for p, c in zip(prompts, completions)], list(prompts)
        if self.tokenizer is None:
            raise ValueError(
                "RemoteReward got conversational rows (lists of messages): pass tokenizer= (the trainer's processing "
                "class) so the query is rendered with its chat template, as OpenRLHF sends it"
            )
        render = self.tokenizer.apply_chat_template
        prompt_texts = [render(p, tokenize=False, add_generation_prompt=True) for p in prompts]
        queries = [render(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return queries, prompt_texts

    def _labels(self, kwargs: dict, count: int) -> list:
        column = self.settings.label_column
        if column is None:
            return [""] * count
        if column not in kwargs:
            raise KeyError(
                f"label_column={column!r} is not a column of this batch (columns: {sorted(kwargs)}). Fix: add it to "
                "the dataset, or set label_column"
            )
        return [value if isinstance(value, str) else json.dumps(value) for value in kwargs[column]]

    def _requests(self, prompt_texts: list[str]) -> list[tuple[int, int]]:
        """Row ranges, one per request: runs of equal prompts, cut at `rows_per_request`."""
        size, ranges, start = self.settings.rows_per_request, [], 0
        for end in range(1, len(prompt_texts) + 1):
            if end == len(prompt_texts) or prompt_texts[end] != prompt_texts[start] or end - start == size:
                ranges.append((start, end))
                start = end
        return ranges

    # ---- one request, routed and failed over -----------------------------------------------------------------

    def _score(self, queries: list[str], prompts: list[str], labels: list) -> tuple[list, dict]:
        body = self.contract.request(queries, prompts, labels)
        tried: set[str] = set()
        errors: dict[str, str] = {}
        for attempt in range(self.settings.retries + 1):
            server = self._next_server(tried)
            if server is None:
                break
            if attempt:
                with self.rotation.lock:
                    self.failovers += 1
            tried.add(server.url)
            sent = time.monotonic()
            try:
                response = self._session.post(
                    server.url, json=body, headers=self._headers, timeout=self.settings.timeout
                )
            except requests.RequestException as error:
                self.rotation.release(server, ok=False, error=repr(error))
                errors[server.url] = _error_text(error)
                continue
            if response.status_code >= 500 or response.status_code in RETRYABLE:
                self.rotation.release(server, ok=False, error=f"HTTP {response.status_code}")
                errors[server.url] = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            self.rotation.release(server, ok=True, seconds=time.monotonic() - sent)
            return self._read(server.url, response, len(queries))
        raise RewardServiceError(
            f"no reward server scored a request of {len(queries)} rows after {self.settings.retries} retries "
            f"(timeout={self.settings.timeout:g}s each). Servers: "
            + "; ".join(f"{s.url}: {errors.get(s.url, 'not tried (out of the rotation)')}" for s in self.servers)
        )

    def _next_server(self, tried: set[str]) -> ServerState | None:
        """The best usable server not tried in this round; when all were, a new round once one is back in the
        rotation (waiting at most `retry_after`)."""
        deadline = time.monotonic() + self.settings.timeout
        server = self.rotation.acquire(tried, deadline)
        if server is None and tried:
            tried.clear()
            with self.rotation.lock:
                back = min(s.down_until for s in self.servers)
            time.sleep(max(0.0, min(self.settings.retry_after, back - time.monotonic())))
            server = self.rotation.acquire(tried, deadline)
        return server

    def _read(self, url: str, response: requests.Response, count: int) -> tuple[list, dict]:
        if response.status_code >= 400:
            raise RewardServiceError(
                f"reward server {url} refused the request ({response.status_code}): {response.text[:500]}"
            )
        try:
            return self.contract.rewards(response.json(), count)
        except ValueError as error:  # a malformed answer: the same request elsewhere would get the same
            raise RewardServiceError(f"reward server {url} answered outside the contract: {error}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()


class AsyncRemoteReward(RemoteReward):
    """`RemoteReward` as a coroutine, for TRL's event loop (its async reward functions are gathered together): the
    blocking HTTP runs in a thread, so the loop serves other rewards and tools meanwhile."""

    async def __call__(self, prompts: list, completions: list, log_metric=None, **kwargs) -> list[float | None]:
        score = super().__call__
        return await asyncio.to_thread(score, prompts, completions, log_metric=log_metric, **kwargs)
