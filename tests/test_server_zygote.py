"""The tests' forked `trl-scale serve` processes (tests/server_zygote.py) behave as the command does as a program:
the same answers, and, as `Popen`, a pid of its own, an exit status, stderr, and a kill the tests can see."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import requests

from .helpers import Server
from .server_zygote import ForkedProcess, Zygote


def _completion(url: str) -> dict:
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "logprobs": 0}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def test_a_forked_server_answers_as_the_command_does_and_dies_as_a_process(tiny_llama, monkeypatch):
    forked = Server(tiny_llama, "--token-delay", "0").wait_ready()
    monkeypatch.setenv("TRL_SCALE_TEST_FORK_SERVERS", "0")
    started = Server(tiny_llama, "--token-delay", "0").wait_ready()
    try:
        assert isinstance(forked.process, ForkedProcess) and isinstance(started.process, subprocess.Popen)
        assert forked.process.pid not in (os.getpid(), Zygote.shared().process.pid)
        answers = [_completion(server.url) for server in (forked, started)]
        assert answers[0]["text"] == answers[1]["text"] and answers[0]["logprobs"] == answers[1]["logprobs"]
        assert forked.process.poll() is None
        os.kill(forked.process.pid, signal.SIGSTOP)  # the pid is the server's: a stopped server does not answer
        with pytest.raises(requests.RequestException):
            requests.get(f"{forked.url}/health", timeout=1)
        os.kill(forked.process.pid, signal.SIGCONT)
        assert requests.get(f"{forked.url}/health", timeout=30).status_code == 200
        forked.process.kill()
        assert forked.process.wait(timeout=30) == -signal.SIGKILL  # Popen's convention
        forked.process.kill()  # a reaped child is never signalled again (its pid may be another's by now)
    finally:
        forked.stop()
        started.stop()


def test_a_forked_server_that_fails_to_start_reports_its_status_and_stderr(tmp_path):
    server = Server(str(tmp_path / "missing-model"))
    with pytest.raises(RuntimeError, match=r"(?s)server exited: .*no such directory.*missing-model"):
        server.wait_ready(timeout=60)
    assert server.process.poll() == 2  # argparse's usage error, as the command exits
