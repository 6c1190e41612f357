"""`trl-scale serve`'s command line: checks what it can before minutes of model loading (the bind address without a
token, the `serve` extra), then serves with uvicorn."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from collections.abc import Callable

from ..model_paths import check_model_path
from ..net import require_token_off_loopback
from .served import MAX_REQUEST_BYTES


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """A server reachable beyond this machine takes weight updates and runs generation for whoever connects: it needs
    a bearer token, or an explicit opt-out."""
    require_token_off_loopback(host, api_key, allow_unauthenticated, "could replace the model's weights")


DESCRIPTION = (
    "`trl-scale serve`: a transformers-backed server speaking vLLM's contract (the OpenAI-compatible routes and the "
    "dev-mode RL routes of vLLM 0.22-0.33), for CPU machines and tests."
)


def _number(minimum: float, above: bool = False, whole: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number at least `minimum` (above it with `above`; a whole one with `whole`),
    refused at start rather than in every request (a negative delay failed each completion with a 500)."""
    what = f"a {'whole ' if whole else 'finite '}number {'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: use {what}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{text!r}: use {what}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-scale serve", description=DESCRIPTION)
    parser.add_argument("--model", required=True, help="path of a causal LM saved with save_pretrained")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=_number(0, whole=True), default=8000)
    parser.add_argument("--api-key", default=os.environ.get("TRL_SCALE_API_KEY"), help="require this bearer token")
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve on a non-loopback address without --api-key (trusted networks only)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run code shipped in the model directory (off by default)"
    )
    parser.add_argument(
        "--max-request-mb",
        type=_number(0, above=True),
        default=MAX_REQUEST_BYTES / 2**20,
        help="largest JSON request body, in MiB",
    )
    parser.add_argument("--token-delay", type=_number(0), default=0.0, help="seconds per generated token (benchmarks)")
    parser.add_argument(
        "--step-delay",
        type=_number(0),
        default=0.0,
        help="seconds per decoding step of a request, overlapping other requests (benchmarks: continuous batching, "
        "a request lasts as long as its longest answer)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--world-size",
        type=_number(1, whole=True),
        default=1,
        help="ranks this server brings to the weight-transfer group (as TP x DP)",
    )
    parser.add_argument(
        "--max-lora-rank", type=_number(1, whole=True), default=16, help="largest LoRA rank accepted (vLLM's default)"
    )
    parser.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="an MoE model's routes on each choice (routed_experts), as vLLM's flag of the same name",
    )
    parser.add_argument(
        "--weight-transfer-timeout",
        type=_number(0, above=True),
        default=300.0,
        help="seconds a weight broadcast may take",
    )
    return parser


def serve(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_bind(args.host, args.api_key, args.allow_unauthenticated)  # before minutes of model loading
    except ValueError as error:
        parser.error(str(error))
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:  # before minutes of model loading, and with the fix
        parser.error(f"needs {' and '.join(missing)}, not installed here. Fix: pip install 'trl-scale[serve]'")
    try:
        check_model_path(args.model, "--model")
    except ValueError as error:
        parser.error(str(error))
    import uvicorn

    from .app import create_app

    app = create_app(
        args.model,
        api_key=args.api_key,
        token_delay=args.token_delay,
        step_delay=args.step_delay,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        max_request_bytes=int(args.max_request_mb * 2**20),
        world_size=args.world_size,
        max_lora_rank=args.max_lora_rank,
        weight_transfer_timeout=args.weight_transfer_timeout,
        return_routed_experts=args.enable_return_routed_experts,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
