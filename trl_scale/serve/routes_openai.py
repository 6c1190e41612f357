"""The OpenAI-compatible routes: `/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from .completions import complete, refusal
from .protocol import ChatRequest, CompletionRequest, error_response
from .served import ServedModel


def add_openai_routes(app: FastAPI, served: ServedModel) -> None:
    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    def models():
        data = [{"id": served.model_name, "object": "model", "max_model_len": served.max_model_len}]
        data += [{"id": name, "object": "model", "parent": served.model_name} for name in served.lora]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        return complete(served, request)

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest):
        return chat(served, request)


def chat(served: ServedModel, request: ChatRequest):
    """A chat request as one completion of the chat template's rendering of its messages."""
    refused = refusal(served, request)
    if refused is not None:
        return refused
    try:
        encoded = served.tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as error:  # no chat template, or messages it cannot render
        return error_response(f"cannot apply the chat template: {error}", "BadRequestError", 400)
    prompt = list(encoded["input_ids"])
    fields = request.model_dump(exclude={"messages", "max_tokens", "max_completion_tokens"})
    max_tokens = request.max_completion_tokens or request.max_tokens or max(1, served.max_model_len - len(prompt))
    answer = complete(served, CompletionRequest(**fields, prompt=[prompt], max_tokens=max_tokens))
    if isinstance(answer, JSONResponse):
        return answer
    choices = [
        {
            "index": c["index"],
            "message": {"role": "assistant", "content": c["text"]},
            "finish_reason": c["finish_reason"],
            "token_ids": c["token_ids"],
        }
        for c in answer["choices"]
    ]
    return {**answer, "id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "choices": choices}
