"""Rollout server URLs: one check of what a server URL may be (the configs, `check-servers` and `trl-scale rollout`
accept and refuse exactly the same URLs), and which answers to a `/health` probe are definite (no wait heals them).

Definite: a 404 (not a vLLM server at this address: a path such as `/v1` in the URL, or another HTTP service), a TLS
failure (`https://` to a plain-HTTP server), an answer that is not HTTP (another protocol on the port). A refused
connection is definite only for commands that talk to running servers: a starting vLLM server binds its port at
once but listens only when its engine is up (vLLM 0.32 `entrypoints/launchers/api_server/entry.py` `run_server`:
`setup_server` binds; uvicorn listens in `build_and_serve`), so for the minutes a model loads its port refuses
connections, and a trainer started beside its servers must wait through that.
"""

from __future__ import annotations

from urllib.parse import urlparse

from ..net import is_loopback

URL_FIX = "use http://HOST:PORT (e.g. http://10.0.0.5:8000), one entry per server"


def check_server_urls(urls: list[str], field: str = "vllm_server_base_urls") -> list[str]:
    """The URLs with trailing slashes removed, or a ValueError naming `field`, the entry and the fix: not a URL,
    an OpenAI path (`/v1`: the client adds `/v1/completions` itself), or the same server twice."""
    seen: dict[tuple, str] = {}
    for url in urls:
        parsed = urlparse(str(url))
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{field} entry {url!r} is not a server URL. Fix: {URL_FIX}")
        try:
            port = parsed.port or {"http": 80, "https": 443}[parsed.scheme]
        except ValueError as error:  # a port that is not a number, or out of range
            raise ValueError(f"{field} entry {url!r} has no valid port ({error}). Fix: {URL_FIX}") from error
        path = parsed.path.rstrip("/")
        if path.endswith("/v1") or "/v1/" in f"{path}/":
            raise ValueError(
                f"{field} entry {url!r} ends in an OpenAI API path ({parsed.path}): the client adds /v1/completions "
                f"itself, so every request would miss. Fix: drop the path, e.g. "
                f"{parsed.scheme}://{parsed.netloc}"
            )
        # one loopback host however it is spelled, and the scheme's default port made explicit
        host = "loopback" if is_loopback(parsed.hostname) else parsed.hostname
        key = (parsed.scheme, host, port, path)
        if key in seen:
            raise ValueError(
                f"{field} lists the same server twice ({seen[key]!r} and {url!r}): it would get double the work and "
                "every weight sync twice. Fix: list each server once"
            )
        seen[key] = url
    return [str(url).rstrip("/") for url in urls]


def definite_failure(
    url: str,
    status: int | None = None,
    error: BaseException | None = None,
    refused_is_definite: bool = False,
    path: str = "/health",
) -> str | None:
    """Why the server at `url` will never answer (`path` probed), from one probe's status code or exception; None
    when waiting may help (not up yet, busy, 5xx)."""
    if status == 404:
        return (
            f"{url}{path} answered 404: no vLLM server at this URL (a path in it, such as /v1, or another HTTP "
            f"service on that port). Fix: {URL_FIX}"
        )
    if error is None:
        return None
    text = repr(error)
    import requests

    if isinstance(error, requests.exceptions.SSLError):
        return (
            f"{url}: the TLS handshake failed ({_short(text)}): the server speaks plain HTTP, as vLLM does by "
            "default. Fix: use http:// (or start the server with --ssl-keyfile/--ssl-certfile)"
        )
    if any(sign in text for sign in ("BadStatusLine", "LineTooLong", "InvalidHeader", "InvalidChunkLength")):
        return f"{url}: the port answers, but not in HTTP ({_short(text)}): another service runs there. Fix: {URL_FIX}"
    if refused_is_definite and "Connection refused" in text:
        return f"{url}: connection refused: nothing listens there. Fix: start the server, or check the host and port"
    return None


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
