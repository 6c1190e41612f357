"""Real reward-server processes for the tests (`trl-scale reward-server`, on 127.0.0.1, a free port, killed in
teardown), and scoring functions with OpenRLHF's signature for them to serve."""

from __future__ import annotations

import subprocess
import sys
import time

import requests

from trl_scale.net import answers_health

from .helpers import ROOT, free_port, subprocess_env


def response_length(queries: list[str], prompts: list[str], labels: list) -> list[float]:
    """OpenRLHF's signature: the length of each response (the query after its prompt), plus its label's number."""
    return [float(len(q) - len(p)) + (float(label) if label else 0.0) for q, p, label in zip(queries, prompts, labels)]


def one_too_many(queries: list[str], prompts: list[str], labels: list) -> list[float]:
    return [1.0] * (len(queries) + 1)


class RewardServerProcess:
    """`python -m trl_scale.cli reward-server ...` as a real process; ready when `/health` answers."""

    def __init__(self, *args: str, api_key: str | None = None, tls: bool = False):
        self.port = free_port()
        self.scheme = "https" if tls else "http"
        self.url = f"{self.scheme}://127.0.0.1:{self.port}/get_reward"
        command = [sys.executable, "-m", "trl_scale.cli", "reward-server", "--port", str(self.port), *args]
        if api_key:
            command += ["--api-key", api_key]
        self.process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(self.process.stderr.read().decode()[-2000:])
            if self._healthy():
                return
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"reward server {self.url} not ready in 60 s")

    def _healthy(self) -> bool:
        if self.scheme == "http":
            return answers_health(f"http://127.0.0.1:{self.port}")
        try:  # the certificate is the test's own: reachability is the question here
            return requests.get(f"{self.health_url}", timeout=2, verify=False).status_code == 200
        except requests.RequestException:
            return False

    @property
    def health_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/health"

    def requests_served(self) -> int:
        return requests.get(self.health_url, timeout=5).json()["requests"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def not_numbers(queries: list[str], prompts: list[str], labels: list) -> list:
    return ["high"] * len(queries)
