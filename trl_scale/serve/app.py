"""`create_app`: the served model, the security middleware (bearer token in constant time, request-size caps), and
every route: the OpenAI-compatible ones, vLLM's dev-mode RL routes, the weight transfer and LoRA."""

from __future__ import annotations

import hmac
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .multimodal import add_multimodal_routes
from .routed_experts import check_routes_servable
from .routes_lora import add_lora_routes
from .routes_openai import add_openai_routes
from .routes_rl import add_rl_routes
from .routes_weights import add_weight_routes
from .served import RequestError, ServedModel, ServeSettings


def create_app(model_path: str, **options) -> FastAPI:
    """The app serving `model_path`; `options` are `ServeSettings`' other fields (api_key, token_delay, dtype, ...)."""
    unknown = set(options) - {f.name for f in fields(ServeSettings)}
    if unknown:
        raise TypeError(f"create_app got unknown options {sorted(unknown)}")
    served = ServedModel.load(ServeSettings(model_path=model_path, **options))
    if served.settings.return_routed_experts:
        check_routes_servable(served.model)
    app = FastAPI(title="trl-scale serve")
    app.state.served = served
    _add_security(app, served.settings)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        return JSONResponse({"detail": error.message}, status_code=error.status)  # as FastAPI's HTTPException

    for add_routes in (add_openai_routes, add_multimodal_routes, add_rl_routes, add_weight_routes, add_lora_routes):
        add_routes(app, served)
    return app


def _add_security(app: FastAPI, settings: ServeSettings) -> None:
    expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None

    @app.middleware("http")
    async def check_token_and_size(request: Request, call_next):
        if expected is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):  # constant time: no timing oracle on the key
                return JSONResponse({"error": {"message": "missing or wrong bearer token"}}, status_code=401)
        if request.method == "POST":
            limit = settings.max_request_bytes  # weights never travel in a body: they are broadcast or read from disk
            length = request.headers.get("content-length")
            if length is None:
                return JSONResponse({"error": {"message": "send a Content-Length header"}}, status_code=411)
            if int(length or 0) > limit:
                message = f"request body of {int(length)} bytes is over this endpoint's limit of {limit} bytes"
                return JSONResponse({"error": {"message": message}}, status_code=413)
        return await call_next(request)
