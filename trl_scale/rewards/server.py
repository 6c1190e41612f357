"""`trl-scale reward-server`: a reference reward server speaking OpenRLHF's remote reward contract (`contract.py`),
so verifiers can live on other machines and `RemoteReward` (or OpenRLHF's `--reward.remote_url`) reaches them.

It serves `POST /get_reward` (OpenRLHF's reference route) and `GET /health`, on 127.0.0.1 by default; bound beyond
loopback it needs a bearer token (`--api-key`), as `trl-scale serve` does, and should serve HTTPS (`--tls-cert`,
`--tls-key`) so the token does not cross the network in clear. What scores:
- `--reward code` (default): the sandboxed code verifier (`CodeExecutionReward`); each row's `labels` entry holds its
  tests (JSON), the response is the query after its prompt, its code the last fenced block (or `--extract`'s);
- `--reward module:function` (or `module.function`): a function with OpenRLHF's signature,
  `reward_func(queries, prompts, labels)` returning a list of numbers (or a dict with `rewards`).

Standard library only (no torch, no web framework): a server process starts in well under a second.
"""

from __future__ import annotations

import argparse
import hmac
import importlib
import json
import os
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..net import require_token_off_loopback
from .contract import read_request

MAX_REQUEST_BYTES = 64 << 20


class BadRows(ValueError):
    """The request's rows cannot be scored as sent (labels that are not tests): a 400 naming the row, which the
    client does not retry elsewhere (any server would refuse it the same)."""


def load_function(spec: str, option: str) -> Callable:
    """`module:function` (or `module.function`), imported; a module in the current directory is found, as TRL's CLI
    finds a reward function's."""
    module, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module or not name:
        raise ValueError(f"{option} {spec!r}: use module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    function = getattr(importlib.import_module(module), name, None)
    if not callable(function):
        raise ValueError(f"{option} {spec!r}: {module} has no function {name!r}")
    return function


def load_reward(spec: str, sandbox_fields: dict, extract: str | None = None) -> Callable[[list, list, list], list]:
    """The scoring function of `--reward`: `fn(queries, prompts, labels) -> rewards`."""
    if spec == "code":
        from .code import CodeExecutionReward, extract_code, parse_tests
        from .sandbox import SandboxSettings

        extractor = load_function(extract, "--extract") if extract else extract_code
        verifier = CodeExecutionReward(sandbox=SandboxSettings(**sandbox_fields), extract=extractor)

        def code(queries: list, prompts: list, labels: list) -> list[float]:
            responses = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
            if any(label in ("", None) for label in labels):
                raise BadRows(
                    "--reward code reads each row's tests from its label, and this request's labels are empty. Fix: "
                    "send the tests column as labels (RemoteReward(..., label_column='tests'))"
                )
            try:
                tests = [parse_tests(label, i, "labels") for i, label in enumerate(labels)]
            except ValueError as error:
                raise BadRows(str(error)) from None
            outcomes = verifier.verify([verifier.extract(r) for r in responses], tests)
            return [sum(o.passed for o in row) / len(row) for row in outcomes]

        return code
    if extract:
        raise ValueError(f"--extract {extract!r} is read by --reward code only (the verifier), not by {spec!r}")
    return load_function(spec, "--reward")


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer  # type: ignore[assignment]

    def log_message(self, format, *args):  # one line per request is noise at thousands per step
        pass

    def do_GET(self):
        if self.path == "/health":
            with self.server.lock:
                return self._send(200, {"status": "ok", "requests": self.server.requests})
        self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        if self.path != self.server.route:
            return self._send(404, {"error": f"no route {self.path}; rewards are at {self.server.route}"})
        expected = self.server.expected_authorization
        if expected is not None and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
            return self._send(401, {"error": "missing or wrong bearer token"})
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit() or int(length) > MAX_REQUEST_BYTES:
            return self._send(413, {"error": f"send a Content-Length up to {MAX_REQUEST_BYTES} bytes"})
        try:
            queries, prompts, labels = read_request(json.loads(self.rfile.read(int(length))))
        except ValueError as error:
            return self._send(400, {"error": str(error)})
        try:
            rewards = self.server.reward(queries, prompts, labels)
            if isinstance(rewards, dict):
                rewards = rewards.get("rewards")
            rewards = [None if r is None else float(r) for r in rewards]  # its length is the client's to check
        except BadRows as error:  # the request's fault: any server would refuse it
            return self._send(400, {"error": str(error)})
        except Exception as error:  # the scoring function's fault: a 500 the client fails over
            return self._send(500, {"error": f"{type(error).__name__}: {error}"})
        with self.server.lock:
            self.server.requests += 1
        self._send(200, {"rewards": rewards, "scores": rewards, "extra_logs": {}})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# Seconds a client has to finish its TLS handshake; one that sends nothing is dropped after it.
HANDSHAKE_TIMEOUT = 10.0


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, reward, route: str = "/get_reward", api_key: str | None = None):
        super().__init__(address, RewardHandler)
        self.reward, self.route, self.lock, self.requests = reward, route, threading.Lock(), 0
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None
        self.tls = None  # an ssl.SSLContext: each connection's handshake runs in its own thread (`finish_request`)

    def finish_request(self, request, client_address) -> None:
        """In the connection's own thread: the TLS handshake first, bounded (a listening socket wrapped whole would
        run every handshake inside `accept()`, so one client that connects and sends nothing stalled all others),
        then the request."""
        if self.tls is None:
            return super().finish_request(request, client_address)
        import ssl

        request.settimeout(HANDSHAKE_TIMEOUT)
        try:
            secured = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):  # a client that is not speaking TLS, or never finished its handshake
            return None
        try:
            secured.settimeout(None)
            super().finish_request(secured, client_address)
        finally:
            secured.close()


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port: use 1-65535 (0: any free one)")
    return port


def _route(text: str) -> str:
    if not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a path: routes start with '/' (e.g. /{text})")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-scale reward-server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=_port, default=8100)
    parser.add_argument("--api-key", default=os.environ.get("TRL_SCALE_API_KEY"), help="require this bearer token")
    parser.add_argument("--allow-unauthenticated", action="store_true", help="no token beyond loopback")
    parser.add_argument("--route", type=_route, default="/get_reward", help="the path rewards are posted to")
    parser.add_argument("--tls-cert", default=None, help="serve HTTPS with this certificate (PEM); needs --tls-key")
    parser.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    parser.add_argument("--reward", default="code", help="'code' (the sandboxed verifier) or module:function")
    parser.add_argument(
        "--extract",
        default=None,
        help="module:function: the code of a response (default: its last fenced block, else all of it)",
    )
    sandbox = parser.add_argument_group("sandbox (--reward code)")
    sandbox.add_argument("--wall-seconds", type=float, default=10.0)
    sandbox.add_argument("--cpu-seconds", type=int, default=5)
    sandbox.add_argument("--memory-mb", type=int, default=512)
    sandbox.add_argument("--max-processes", type=int, default=32)
    sandbox.add_argument("--slots", type=int, default=None, help="runs at once (default: the CPU count)")
    sandbox.add_argument("--isolation", default="bubblewrap", choices=["bubblewrap", "unsandboxed"])
    return parser


def reward_server(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        require_token_off_loopback(
            args.host, args.api_key, args.allow_unauthenticated, "could run code in its sandbox and spend its CPUs"
        )
        fields = {"wall_seconds": args.wall_seconds, "cpu_seconds": args.cpu_seconds, "memory_mb": args.memory_mb}
        fields.update(max_processes=args.max_processes, slots=args.slots, isolation=args.isolation)
        reward = load_reward(args.reward, fields, args.extract)
        server = RewardServer((args.host, args.port), reward, args.route, args.api_key)
        scheme = _serve_tls(server, args.tls_cert, args.tls_key)
    except (ValueError, RuntimeError, OSError, ImportError) as error:
        print(f"trl-scale reward-server: {error}", file=sys.stderr)
        return 2
    print(f"trl-scale reward-server: {args.reward} on {scheme}://{args.host}:{args.port}{args.route}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _serve_tls(server: RewardServer, cert: str | None, key: str | None) -> str:
    """HTTPS on `server` with `cert` and `key` (both or neither); the scheme served."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both (or neither, for plain HTTP)")
    if cert is None:
        return "http"
    import ssl

    for option, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not os.path.isfile(path):
            raise ValueError(f"{option} {path}: no such file (give the PEM file's path)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as error:
        raise ValueError(
            f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private key ({error.reason or error})"
        ) from error
    server.tls = context
    return "https"


if __name__ == "__main__":
    sys.exit(reward_server(sys.argv[1:]))
