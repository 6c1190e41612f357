"""LoRA adapters by vLLM's rules (entrypoints/openai/models/serving.py:167-300, lora/peft_helper.py:41-56,128-134):
`/v1/load_lora_adapter` (a new name per load unless in place, safetensors only, vLLM's refusals) and
`/v1/unload_lora_adapter`."""

from __future__ import annotations

import json
import os

from fastapi import FastAPI
from fastapi.responses import Response

from .protocol import LoraRequest, UnloadRequest, error_response
from .served import ServedModel


def add_lora_routes(app: FastAPI, served: ServedModel) -> None:
    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(request: LoraRequest):
        refused = load_refusal(served, request)
        if refused is not None:
            return refused
        with served.lock:
            if request.lora_name in served.lora:
                served.model.delete_adapter(request.lora_name)
            served.model.load_adapter(request.lora_path, adapter_name=request.lora_name)
            served.lora[request.lora_name] = request.lora_path
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(request: UnloadRequest):
        if not request.lora_name:
            return error_response(
                "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400
            )
        if request.lora_name not in served.lora:
            return error_response(f"The lora adapter '{request.lora_name}' cannot be found.", "NotFoundError", 404)
        with served.lock:
            served.model.delete_adapter(request.lora_name)
            del served.lora[request.lora_name]
        return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", status_code=200)


def load_refusal(served: ServedModel, request: LoraRequest):
    """vLLM's answer to a load it refuses, in its words and status codes; None when it loads."""
    name, path = request.lora_name, request.lora_path
    if not name or not path:
        return error_response("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
    if name == served.model_name:
        return error_response(
            f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400
        )
    if not request.load_inplace and name in served.lora:
        message = (
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, set "
            "'load_inplace' to True."
        )
        return error_response(message, "InvalidUserInput", 400)
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        return error_response(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        # PEFT would fall back to a pickled adapter_model.bin; this server loads safetensors only.
        message = f"no adapter_model.safetensors in {path!r} (safetensors only)"
        return error_response(message, "InvalidUserInput", 400)
    problems = adapter_problems(path, served.settings.max_lora_rank)
    if problems:  # vLLM raises these while adding the adapter: a 500 carrying the message
        return error_response(" ".join(problems), "InternalServerError", 500)
    return None


# vLLM 0.32 lora/peft_helper.py `_validate_features` and `validate_legal`, in its order and words
_REFUSED_FEATURES = (
    ("use_dora", "vLLM does not yet support DoRA."),
    ("lora_bias", "vLLM does not support LoRA bias (lora_bias)."),
    ("alora_invocation_tokens", "vLLM does not support Activated LoRA (aLoRA)."),
    ("layer_replication", "vLLM does not support layer_replication."),
    ("use_bdlora", "vLLM does not support block-diagonal LoRA (BD-LoRA)."),
    ("use_qalora", "vLLM does not support QALoRA."),
)


def adapter_problems(path: str, max_lora_rank: int) -> list[str]:
    with open(os.path.join(path, "adapter_config.json")) as handle:
        config = json.load(handle)
    problems = []
    unsupported = [m for m in (config.get("modules_to_save") or []) if m not in ("classifier", "score")]
    if unsupported:
        problems.append(
            'vLLM only supports modules_to_save being either None or ["classifier", "score"] for classification '
            f"models. Unsupported modules_to_save: {unsupported}"
        )
    problems += [message for key, message in _REFUSED_FEATURES[:2] if config.get(key)]
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        problems.append(f"vLLM does not support init_lora_weights={init!r}.")
    problems += [message for key, message in _REFUSED_FEATURES[2:] if config.get(key)]
    rank = max([int(config.get("r", 0)), *[int(r) for r in (config.get("rank_pattern") or {}).values()]])
    if rank > max_lora_rank:
        problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
    if config.get("bias", "none") != "none":
        problems.append("Adapter bias is not supported.")
    return problems
