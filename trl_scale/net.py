"""Network facts every part needs, written once: a free TCP port, whether a host is this machine's loopback, the
bearer-token rule for a server bound beyond it, and whether a server answers its health route."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "") -> int:
    """A TCP port free on `host` ("" : on every interface) now; it can be taken again before the caller binds it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def is_loopback(host: str | None) -> bool:
    """`localhost`, or any address of the loopback range (127.0.0.0/8, ::1)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(host: str, api_key: str | None, allow_unauthenticated: bool, risk: str) -> None:
    """A server bound beyond loopback needs a bearer token, or an explicit opt-out: anyone who can reach it `risk`."""
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host!r} without a bearer token: anyone who can reach it {risk}. Fix: pass "
            "--api-key KEY (or set TRL_SCALE_API_KEY), bind --host 127.0.0.1, or pass --allow-unauthenticated on a "
            "trusted network."
        )


def answers_health(url: str, timeout: float = 2.0) -> bool:
    """`GET {url}/health` answers 200 now (a vLLM server, or `trl-scale serve`, ready for requests)."""
    import requests

    try:
        return requests.get(f"{url}/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False
