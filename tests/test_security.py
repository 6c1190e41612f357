"""`trl-scale serve`'s security rules, one test each: loopback by default; no unauthenticated non-loopback bind;
constant-time token checks; request-size caps; safetensors only (weights and adapters); no remote code unless asked."""

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

from trl_scale.serve import app as app_module
from trl_scale.serve import check_bind, create_app

from .helpers import Server, free_port, subprocess_env

pytest.importorskip("uvicorn")


class ThreadedServer:
    """The app in this process (so tests can spy on it), served by uvicorn on 127.0.0.1 in a thread."""

    def __init__(self, app):
        import uvicorn

        self.url = None
        for _ in range(5):  # a port freed by free_port() can be taken before uvicorn binds it: retry another
            port = free_port()
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
            self.thread = threading.Thread(target=self.server.run, daemon=True)
            self.thread.start()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not self.server.started and self.thread.is_alive():
                time.sleep(0.05)
            if self.server.started:
                self.url = f"http://127.0.0.1:{port}"
                return
        raise RuntimeError("uvicorn did not start")

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def served(tiny_llama):
    started = []

    def serve(**kwargs):
        started.append(ThreadedServer(create_app(tiny_llama, **kwargs)))
        return started[-1].url

    yield serve
    for server in started:
        server.stop()


def _greedy(url, headers=None):
    body = {"prompt": [[10, 11, 12]], "max_tokens": 6, "temperature": 0.0}
    response = requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_serve_binds_loopback_by_default(tiny_llama):
    server = Server(tiny_llama).wait_ready()
    try:
        with open("/proc/net/tcp") as table:
            rows = [line.split() for line in table.readlines()[1:]]
        listening = [row[1] for row in rows if row[3] == "0A" and int(row[1].split(":")[1], 16) == server.port]
        assert listening == ["0100007F:" + f"{server.port:04X}"]  # 127.0.0.1, and nowhere else
    finally:
        server.stop()


def test_non_loopback_bind_without_a_key_is_refused_before_loading():
    # The model path does not exist: the refusal comes before any loading, at once.
    command = [sys.executable, "-m", "trl_scale.cli", "serve", "--model", "/nonexistent", "--host", "0.0.0.0"]
    start = time.monotonic()
    result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--api-key" in result.stderr and "--allow-unauthenticated" in result.stderr
    assert time.monotonic() - start < 30
    check_bind("0.0.0.0", "secret", allow_unauthenticated=False)  # a token makes it acceptable
    check_bind("10.1.2.3", None, allow_unauthenticated=True)  # so does the explicit opt-out
    for loopback in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check_bind(loopback, None, allow_unauthenticated=False)
    with pytest.raises(ValueError, match="--api-key"):
        check_bind("192.168.0.7", None, allow_unauthenticated=False)


def test_bearer_token_is_compared_in_constant_time(served, monkeypatch):
    calls = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    url = served(api_key="s3cret")
    assert requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert requests.get(f"{url}/v1/models", timeout=10).status_code == 401
    assert requests.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=10).status_code == 200
    expected = b"Bearer s3cret"
    assert calls == [(b"Bearer wrong", expected), (b"", expected), (expected, expected)]


def test_request_bodies_are_capped(served):
    url = served(max_request_bytes=4096)
    big = {"prompt": [[10] * 2000], "max_tokens": 1}  # about 8 KB of JSON
    response = requests.post(f"{url}/v1/completions", data=json.dumps(big), timeout=30)
    assert response.status_code == 413 and "limit of 4096 bytes" in response.text
    # Weights never travel in a body, so /update_weights (JSON metadata) has the same cap.
    response = requests.post(f"{url}/update_weights", data=b"\0" * (64 * 2**20), timeout=60)
    assert response.status_code == 413
    assert _greedy(url)  # the server still serves


def test_only_safetensors_are_loaded(served, tmp_path):
    url = served()
    before = _greedy(url)
    # A pickled state dict posted as weights: refused, never unpickled, the model unchanged.
    marker = tmp_path / "unpickled"
    buffer = io.BytesIO()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, buffer)
    response = requests.post(f"{url}/update_weights", data=buffer.getvalue(), timeout=30)
    assert response.status_code == 400 and "Invalid JSON format" in response.text
    assert not marker.exists() and _greedy(url) == before
    # A directory with a pickled checkpoint only.
    (tmp_path / "bin").mkdir()
    torch.save({}, tmp_path / "bin" / "pytorch_model.bin")
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "bin")}}
    response = requests.post(f"{url}/collective_rpc", json=body, timeout=30)
    assert response.status_code == 400 and "no .safetensors" in response.text
    # An adapter saved as a pickle (PEFT would fall back to adapter_model.bin).
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    torch.save({}, adapter / "adapter_model.bin")
    body = {"lora_name": "a", "lora_path": str(adapter)}
    response = requests.post(f"{url}/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == 400 and "adapter_model.safetensors" in response.text
    assert _greedy(url) == before


def test_remote_code_in_a_model_directory_never_runs_unless_asked(tiny_llama, tmp_path):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama, model_dir)
    marker = tmp_path / "remote-code-ran"
    (model_dir / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nfrom transformers import LlamaForCausalLM as EvilModel\n"
    )
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (model_dir / "config.json").write_text(json.dumps(config))
    env = subprocess_env()
    code = f"from trl_scale.serve import create_app; create_app({str(model_dir)!r})"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "the model directory's code ran"
    assert result.returncode == 0, result.stderr[-2000:]  # loaded with transformers' own class instead
    code = code.replace(")", ", trust_remote_code=True)")
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert marker.exists() and os.path.getsize(marker) > 0  # the opt-in works, so the first check could fail


def test_serve_without_its_extra_names_the_install_command(monkeypatch, capsys):
    import importlib.util

    from trl_scale.serve import serve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    with pytest.raises(SystemExit) as exited:
        serve(["--model", "/nonexistent"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "needs uvicorn" in error and "pip install 'trl-scale[serve]'" in error
