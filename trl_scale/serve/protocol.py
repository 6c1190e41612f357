"""The request models of the routes `trl-scale serve` answers, as vLLM's protocol models define them (vLLM 0.31
`entrypoints/openai/protocol.py`, `entrypoints/serve/lora/protocol.py`, `entrypoints/serve/dev/rlhf/api_router.py`),
and vLLM's error body and JSON-body parsing."""

from __future__ import annotations

import json

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


class CompletionRequest(BaseModel):
    model: str | None = None
    prompt: list[list[int]] | list[str] | str | list[int]
    n: int = Field(1, ge=1, le=256)
    max_tokens: int = Field(16, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool = True
    return_tokens_as_token_ids: bool = False  # vLLM's default: logprobs.tokens are decoded text
    seed: int | None = None
    stream: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)  # vLLM's: the first prompt tokens' routes left out


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[dict]
    n: int = Field(1, ge=1, le=256)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    seed: int | None = None
    stream: bool = False


class FinishRequest(BaseModel):
    weight_version: str | None = None


class VersionRequest(BaseModel):
    new_version: str


class LoraRequest(BaseModel):
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def error_response(message: str, kind: str, status: int) -> JSONResponse:
    """vLLM's ErrorResponse (entrypoints/serve/engine/protocol.py) for the OpenAI-compatible routes."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


async def json_body(request: Request) -> dict:
    """vLLM's RL routes parse the body themselves and answer 400 to anything that is not a JSON object
    (entrypoints/serve/dev/rlhf/api_router.py:186-201)."""
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HTTPException(400, "Invalid JSON format") from error
    if not isinstance(body, dict):
        raise HTTPException(400, "Invalid JSON format")
    return body
