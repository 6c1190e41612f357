"""Network facts every part needs, written once: a free TCP port, whether a host is this machine's loopback, and
whether a server answers its health route."""

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


def answers_health(url: str, timeout: float = 2.0) -> bool:
    """`GET {url}/health` answers 200 now (a vLLM server, or `trl-scale serve`, ready for requests)."""
    import requests

    try:
        return requests.get(f"{url}/health", timeout=timeout).status_code == 200
    except requests.RequestException:
        return False
