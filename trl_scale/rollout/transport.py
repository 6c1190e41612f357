"""HTTP to the rollout servers: one pooled session, the API key, and the plain calls (by server or by URL)."""

from __future__ import annotations

import http.client
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import requests

from ..errors import RolloutError
from ..routing import ServerState


class Transport:
    def __init__(self, api_key: str | None, pool_size: int, request_timeout: float, timeline=None):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.request_timeout = request_timeout
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=pool_size)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._model_names: dict[str, str] = {}
        # The rollout timeline (`trl_scale.timeline.Timeline`), when one is recorded: each completion request and
        # each control call (a sync's pause, weight load, resume) as a span on its server's lane.
        self.timeline = timeline
        # Completion requests out now, by the model they name: a LoRA adapter's directory stays while one names it
        # (vLLM reads an adapter it evicted again from its directory, and a missing one kills its engine).
        self._out_by_model: Counter[str] = Counter()
        self._out_changed = threading.Condition()

    def models_in_use(self) -> set[str]:
        """The models (adapters) completion requests out now name."""
        with self._out_changed:
            return set(self._out_by_model)

    def wait_unused(self, models: set[str], timeout: float) -> set[str]:
        """Wait until no completion request out names any of `models`, at most `timeout` seconds; returns those
        still named."""
        with self._out_changed:
            self._out_changed.wait_for(lambda: not models & set(self._out_by_model), timeout)
            return models & set(self._out_by_model)

    def _request(self, method: str, url: str, before_resend: Callable[[], None] | None = None, **kwargs):
        """Every call to a server goes through here. One whose connection closed before any answer is sent once
        more, on a fresh connection: it went out on a pooled keep-alive connection the server was closing (vLLM's
        uvicorn closes idle ones after 5 s), so the server never read it. A server that is gone refuses the fresh
        connection, and that error is the caller's as before. `before_resend` runs first (a completion re-reads
        the weight version it is tagged with)."""
        try:
            return self.session.request(method, url, headers=self.headers, **kwargs)
        except requests.ConnectionError as error:
            if not dropped_unanswered(error):
                raise
            if before_resend is not None:
                before_resend()
            return self.session.request(method, url, headers=self.headers, **kwargs)

    def get(self, server: ServerState, path: str, timeout: float = 10.0) -> requests.Response:
        return self._request("GET", f"{server.url}{path}", timeout=timeout)

    def post(self, server: ServerState, path: str, timeout: float, json=None) -> requests.Response:
        """A control call (weight sync): JSON or nothing (no weight-sync route of vLLM's takes a binary body); an
        HTTP error raises `RolloutError` naming the route."""
        start = time.perf_counter()
        try:
            response = self._request("POST", f"{server.url}{path}", json=json, timeout=timeout)
        finally:
            if self.timeline is not None:
                self.timeline.overlapping(
                    server.url, path.split("?")[0].strip("/"), start, time.perf_counter(), path=path
                )
        if response.status_code >= 400:
            raise RolloutError(f"{server.url}{path} answered {response.status_code}: {response.text[:500]}")
        return response

    def completions(
        self,
        server: ServerState,
        payload: dict,
        generation_timeout: float | None,
        before_resend: Callable[[], None] | None = None,
    ) -> requests.Response:
        start, status, model = time.perf_counter(), "failed", payload.get("model")
        with self._out_changed:
            self._out_by_model[model] += 1
        route, body = completion_route(payload)
        try:
            response = self._request(
                "POST",
                f"{server.url}{route}",
                before_resend,
                json=body,
                timeout=(min(10.0, self.request_timeout), generation_timeout),
            )
            status = response.status_code
            return response
        finally:
            with self._out_changed:
                self._out_by_model[model] -= 1
                if self._out_by_model[model] <= 0:
                    del self._out_by_model[model]
                self._out_changed.notify_all()
            if self.timeline is not None:
                self.timeline.overlapping(server.url, "request", start, time.perf_counter(), status=status)

    def model_name(self, server: ServerState) -> str:
        """The model a server serves (`/v1/models`), read once per URL."""
        if server.url not in self._model_names:
            timeout = min(10.0, self.request_timeout)
            response = self._request("GET", f"{server.url}/v1/models", timeout=timeout)
            response.raise_for_status()
            self._model_names[server.url] = response.json()["data"][0]["id"]
        return self._model_names[server.url]

    def forget(self, url: str) -> None:
        self._model_names.pop(url, None)

    # ---- plain calls by URL (preflight, `trl-scale check-servers`) --------------------------------------------

    def get_url(self, url: str, path: str) -> requests.Response:
        return self._request("GET", f"{url}{path}", timeout=min(30.0, self.request_timeout))

    def post_url(self, url: str, path: str, json=None) -> requests.Response:
        timeout = min(30.0, self.request_timeout)
        return self._request("POST", f"{url}{path}", json=json, timeout=timeout)

    def complete_url(self, url: str, model: str, prompt: list[int]) -> dict:
        """One greedy token for `prompt` from this server alone (no routing); raises for an HTTP error."""
        body = {"model": model, "prompt": [prompt], "n": 1, "max_tokens": 1, "temperature": 0.0}
        response = self.post_url(url, "/v1/completions", {**body, "return_token_ids": True})
        response.raise_for_status()
        return response.json()

    def prompt_ids_url(self, url: str, model: str, text: str) -> list[int] | None:
        """How this server's tokenizer encodes `text` (no special tokens), read from a 1-token completion of it;
        None where the server does not say."""
        body = {"model": model, "prompt": [text], "n": 1, "max_tokens": 1, "temperature": 0.0}
        body["return_token_ids"] = True
        response = self.post_url(url, "/v1/completions", {**body, "add_special_tokens": False})
        response.raise_for_status()
        ids = (response.json().get("choices") or [{}])[0].get("prompt_token_ids")
        return list(ids) if isinstance(ids, list) else None

    def close(self) -> None:
        self.session.close()


def completion_route(payload: dict) -> tuple[str, dict]:
    """Where a completion request goes, and its body: `/v1/completions`, or, for a prompt paired with image features
    (`features` in the payload: what `/v1/chat/completions/render` returned for its images), vLLM's
    `/inference/v1/generate`, one prompt per request, its sampling parameters apart (`output_kind` 2: every choice
    at the end, as TRL's client asks)."""
    if payload.get("features") is None:
        return "/v1/completions", {k: v for k, v in payload.items() if k != "features"}
    (prompt,) = payload["prompt"]
    apart = ("prompt", "features", "model", "return_token_ids", "return_tokens_as_token_ids")
    sampling = {k: v for k, v in payload.items() if k not in apart} | {"output_kind": 2}
    body = {"request_id": f"trl-scale-{uuid.uuid4().hex}", "model": payload.get("model"), "token_ids": prompt}
    return "/inference/v1/generate", body | {"features": payload["features"], "sampling_params": sampling}


def dropped_unanswered(error: BaseException) -> bool:
    """Whether a request failed because its connection closed before any answer (`RemoteDisconnected`, wrapped by
    urllib3 and requests), not because the server refused it or timed out."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, http.client.RemoteDisconnected):
            return True
        pending += [arg for arg in getattr(current, "args", ()) if isinstance(arg, BaseException)]
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return False
