"""vLLM's dev-mode RL routes but the weight transfer and LoRA (vLLM 0.22-0.33 entrypoints/serve/dev/rlhf/api_router.py,
cache/, rpc/, server_info/): pause and resume, the prefix cache, world size and server info, weight versions, and
`reload_weights` from a directory. JSON and safetensors only, never pickle."""

from __future__ import annotations

import os

from fastapi import FastAPI, HTTPException, Request
from trl_scale_vllm_plugin.gloo import BACKEND as GLOO_BACKEND

from .protocol import VersionRequest, json_body
from .served import RequestError, ServedModel, weights_digest_of


def add_rl_routes(app: FastAPI, served: ServedModel) -> None:
    _add_pause_routes(app, served)
    _add_weight_version_routes(app, served)


def _add_pause_routes(app: FastAPI, served: ServedModel) -> None:
    @app.post("/pause")
    def pause(mode: str = "abort"):
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(422, f"mode must be one of abort, wait, keep (got {mode!r})")
        # vLLM's modes, as far as whole-request generation allows: admitted generations always finish (a generation
        # is never split across weights); with "wait" the pause returns once they have, with "keep" and "abort" at
        # once. New generations wait for /resume (none is dropped).
        served.gate.pause(wait=mode == "wait")
        return {"status": "paused"}

    @app.post("/resume")
    def resume():
        served.gate.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    def is_paused():
        return {"is_paused": served.gate.paused}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        served.prefix_cache_resets += 1  # no prefix cache here; counted so tests see the call
        return {"success": True}


def _add_weight_version_routes(app: FastAPI, served: ServedModel) -> None:
    settings = served.settings

    @app.get("/get_world_size")
    def get_world_size(include_dp: bool = True):
        return {"world_size": settings.world_size}

    @app.get("/server_info")
    def server_info(config_format: str = "text"):
        config = server_config(served)
        return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}, "system_env": {}}

    @app.post("/update_weight_version")
    def update_weight_version(request: VersionRequest):
        served.weight_version = request.new_version
        return {"success": True, "new_version": request.new_version}

    @app.get("/weight_info")
    def weight_info():
        return {"weight_version": served.weight_version}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await json_body(request)
        method = body.get("method")
        if method is None:
            raise HTTPException(400, "Missing 'method' in request body")
        if method != "reload_weights":
            raise HTTPException(400, f"collective_rpc method {method!r}: this server implements reload_weights only")
        reload_weights(served, (body.get("kwargs") or {}).get("weights_path") or settings.model_path)
        return {"results": [None] * settings.world_size}

    @app.get("/trl_scale/weights_digest")
    def weights_digest():
        """A hash per base parameter (vLLM has no such route; a name it does not use), so tests can check a sync
        gave this server exactly the trainer's weights."""
        with served.lock:
            return {"digest": weights_digest_of(served.model.state_dict())}


def server_config(served: ServedModel) -> dict:
    """What vLLM's `/server_info` reports that a trainer reads (its `vllm_config`), plus trl-scale's counters."""
    settings = served.settings
    return {
        "weight_transfer_config": {"backend": GLOO_BACKEND},
        "model_config": {"model": settings.model_path, "dtype": settings.dtype, "logprobs_mode": "processed_logprobs"},
        "lora_config": {"max_lora_rank": settings.max_lora_rank},
        "parallel_config": {"world_size": settings.world_size},
        "aux_output_config": {"enable_return_routed_experts": settings.return_routed_experts},
        "trl_scale": {
            "prefix_cache_resets": served.prefix_cache_resets,
            "completions_generated": served.completions_generated,
            "engine": served.engine_layout,
        },
    }


def reload_weights(served: ServedModel, path: str) -> None:
    """vLLM's `reload_weights` from a directory: every safetensors file in it (never a pickle)."""
    from safetensors.torch import load_file

    files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")] if os.path.isdir(path) else []
    if not files:
        raise RequestError(400, f"no .safetensors files in {path!r} (reload_weights reads safetensors only)")
    tensors = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    served.load_state_dict(tensors)
