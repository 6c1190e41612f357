"""`trl-scale serve`'s dev-mode RL routes, as vLLM 0.22-0.33 serves them (entrypoints/serve/dev/rlhf/api_router.py,
cache/, rpc/, server_info/): pause and resume, the weight-transfer engine and its updates, `reload_weights` from a
directory, weight versions, and LoRA adapters by vLLM's rules. JSON and safetensors only, never pickle."""

import os
import threading

import torch
from trl_scale_vllm_plugin.gloo import BACKEND as GLOO_BACKEND
from trl_scale_vllm_plugin.gloo import GlooInitInfo, GlooUpdateInfo, open_gloo_group, receive


def add_rl_routes(
    app,
    model,
    state: dict,
    lock: threading.Lock,
    running: threading.Event,
    gate: threading.Condition,
    admitted: list,
    model_name: str,
    model_path: str,
    dtype: str,
    world_size: int,
    max_lora_rank: int,
    weight_transfer_timeout: float,
    error_response,
    json_body,
) -> None:
    """Add the RL routes to `app`, over the model and the state `server.create_app` holds (the same lock and pause
    gate as its generations)."""
    from fastapi import HTTPException, Request
    from fastapi.responses import Response
    from pydantic import BaseModel

    from .server import weights_digest_of

    def _load_state_dict(tensors: dict[str, torch.Tensor]) -> None:
        expected = model.state_dict()
        # Once a LoRA adapter is loaded, the wrapped layers' weights are named `...base_layer.weight`. Full-weight
        # updates (the base model's names) go to those base weights, as vLLM updates its base under adapters.
        base_names = {k.replace(".base_layer", ""): k for k in expected if ".base_layer." in k}
        tensors = {base_names.get(name, name): tensor for name, tensor in tensors.items()}
        unknown = sorted(set(tensors) - set(expected))
        if unknown:
            raise HTTPException(400, f"unknown parameter names: {unknown[:5]}")
        for name, tensor in tensors.items():
            if tensor.shape != expected[name].shape:
                raise HTTPException(
                    400, f"{name}: shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
                )
        with lock, torch.no_grad():
            for name, tensor in tensors.items():
                expected[name].copy_(tensor)

    # ---- vLLM's dev-mode RL routes (entrypoints/serve/dev/rlhf/api_router.py, cache/, rpc/, server_info/) ----

    @app.post("/pause")
    def pause(mode: str = "abort"):
        if mode not in ("abort", "wait", "keep"):
            raise HTTPException(422, f"mode must be one of abort, wait, keep (got {mode!r})")
        # vLLM's modes, as far as whole-request generation allows: admitted generations always finish (a
        # generation is never split across weights); with "wait" the pause returns once they have, with "keep" and
        # "abort" at once. New generations wait for /resume (none is dropped).
        with gate:
            running.clear()
            if mode == "wait":
                gate.wait_for(lambda: admitted[0] == 0)
        return {"status": "paused"}

    @app.post("/resume")
    def resume():
        with gate:
            running.set()
            gate.notify_all()
        return {"status": "resumed"}

    @app.get("/is_paused")
    def is_paused():
        return {"is_paused": not running.is_set()}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache():
        state["prefix_cache_resets"] += 1  # no prefix cache here; counted so tests see the call
        return {"success": True}

    @app.get("/get_world_size")
    def get_world_size(include_dp: bool = True):
        return {"world_size": world_size}

    @app.get("/server_info")
    def server_info(config_format: str = "text"):
        config = {
            "weight_transfer_config": {"backend": GLOO_BACKEND},
            "model_config": {"model": model_path, "dtype": dtype, "logprobs_mode": "processed_logprobs"},
            "lora_config": {"max_lora_rank": max_lora_rank},
            "parallel_config": {"world_size": world_size},
            "trl_scale": {"prefix_cache_resets": state["prefix_cache_resets"], "engine": state["engine_layout"]},
        }
        return {"vllm_config": config if config_format == "json" else str(config), "vllm_env": {}, "system_env": {}}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        init_info = (await json_body(request)).get("init_info")
        if init_info is None:
            raise HTTPException(400, "Missing 'init_info' in request body")
        try:  # the same init_info as the vLLM plugin's engine takes
            info = GlooInitInfo(**init_info)
        except (TypeError, ValueError) as error:
            raise HTTPException(400, f"Invalid init_info for {GLOO_BACKEND}: {error}") from error
        address, port, offset, total = info.master_address, int(info.master_port), info.rank_offset, info.world_size
        if offset + world_size > total:
            raise HTTPException(400, f"ranks {offset}..{offset + world_size - 1} do not fit a group of {total}")
        import anyio

        return await anyio.to_thread.run_sync(_open_engine, address, port, offset, total)

    def _open_engine(address: str, port: int, offset: int, total: int):
        from concurrent.futures import ThreadPoolExecutor

        # One member per rank of this server (a TP x DP vLLM server has that many workers in the group).
        with ThreadPoolExecutor(world_size) as pool:
            opened = list(
                pool.map(
                    lambda r: open_gloo_group(address, port, offset + r, total, weight_transfer_timeout),
                    range(world_size),
                )
            )
        state["engine"] = [group for group, _ in opened]
        state["engine_layout"] = {"rank_offset": offset, "world_size": total}
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    def start_weight_update():
        state["updating"] = True
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        update_info = (await json_body(request)).get("update_info")
        if update_info is None:
            raise HTTPException(400, "Missing 'update_info' in request body")
        if state["engine"] is None:
            raise HTTPException(400, "no weight-transfer engine: call /init_weight_transfer_engine first")
        if not state["updating"]:
            raise HTTPException(400, "call /start_weight_update before /update_weights")
        try:
            update = GlooUpdateInfo(**update_info)
        except (TypeError, ValueError) as error:
            raise HTTPException(400, f"Invalid update_info for {GLOO_BACKEND}: {error}") from error
        import anyio

        received = await anyio.to_thread.run_sync(_receive, update)
        _load_state_dict(received)
        return {"message": "Weights updated"}

    def _receive(update: GlooUpdateInfo) -> dict[str, torch.Tensor]:
        from concurrent.futures import ThreadPoolExecutor

        def rank(group):
            return dict(receive(group, update, weight_transfer_timeout))

        engine = state["engine"]
        try:
            with ThreadPoolExecutor(len(engine)) as pool:
                per_rank = list(pool.map(rank, engine))
        except Exception as error:  # a member left mid-broadcast: this group is over
            # Only this group: the trainer may have abandoned it and opened a new one before this receive failed.
            if state["engine"] is engine:
                state["engine"] = None
            raise HTTPException(500, f"weight broadcast failed: {error}") from error
        return per_rank[0]  # every rank got the same tensors; rank 0's go into this (unsharded) model

    class FinishRequest(BaseModel):
        weight_version: str | None = None

    @app.post("/finish_weight_update")
    def finish_weight_update(request: FinishRequest | None = None):
        state["updating"] = False
        if request is not None and request.weight_version is not None:
            state["weight_version"] = request.weight_version
        return {"message": "Weight update finished"}

    class VersionRequest(BaseModel):
        new_version: str

    @app.post("/update_weight_version")
    def update_weight_version(request: VersionRequest):
        state["weight_version"] = request.new_version
        return {"success": True, "new_version": request.new_version}

    @app.get("/weight_info")
    def weight_info():
        return {"weight_version": state["weight_version"]}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        body = await json_body(request)
        method = body.get("method")
        if method is None:
            raise HTTPException(400, "Missing 'method' in request body")
        if method != "reload_weights":
            raise HTTPException(400, f"collective_rpc method {method!r}: this server implements reload_weights only")
        path = (body.get("kwargs") or {}).get("weights_path") or model_path
        _reload_weights(path)
        return {"results": [None] * world_size}

    def _reload_weights(path: str) -> None:
        from safetensors.torch import load_file

        files = [f for f in sorted(os.listdir(path)) if f.endswith(".safetensors")] if os.path.isdir(path) else []
        if not files:
            raise HTTPException(400, f"no .safetensors files in {path!r} (reload_weights reads safetensors only)")
        tensors = {}
        for name in files:
            tensors.update(load_file(os.path.join(path, name)))
        _load_state_dict(tensors)

    @app.get("/trl_scale/weights_digest")
    def weights_digest():
        """A hash per base parameter (vLLM has no such route; a name it does not use), so tests can check a sync
        gave this server exactly the trainer's weights."""
        with lock:
            return {"digest": weights_digest_of(model.state_dict())}

    # ---- LoRA (entrypoints/openai/models/serving.py:167-300, lora/peft_helper.py:41-56,128-134) ----

    class LoraRequest(BaseModel):
        lora_name: str
        lora_path: str
        load_inplace: bool = False
        is_3d_lora_weight: bool = False

    def _lora_problems(path: str) -> list[str]:
        import json

        with open(os.path.join(path, "adapter_config.json")) as handle:
            config = json.load(handle)
        problems = []
        unsupported = [m for m in (config.get("modules_to_save") or []) if m not in ("classifier", "score")]
        if unsupported:
            problems.append(
                'vLLM only supports modules_to_save being either None or ["classifier", "score"] for classification '
                f"models. Unsupported modules_to_save: {unsupported}"
            )
        # vLLM 0.32 lora/peft_helper.py `_validate_features` and `validate_legal`, in its order and words
        if config.get("use_dora"):
            problems.append("vLLM does not yet support DoRA.")
        if config.get("lora_bias"):
            problems.append("vLLM does not support LoRA bias (lora_bias).")
        init = config.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
            problems.append(f"vLLM does not support init_lora_weights={init!r}.")
        if config.get("alora_invocation_tokens"):
            problems.append("vLLM does not support Activated LoRA (aLoRA).")
        if config.get("layer_replication"):
            problems.append("vLLM does not support layer_replication.")
        if config.get("use_bdlora"):
            problems.append("vLLM does not support block-diagonal LoRA (BD-LoRA).")
        if config.get("use_qalora"):
            problems.append("vLLM does not support QALoRA.")
        rank = max([int(config.get("r", 0)), *[int(r) for r in (config.get("rank_pattern") or {}).values()]])
        if rank > max_lora_rank:
            problems.append(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}.")
        if config.get("bias", "none") != "none":
            problems.append("Adapter bias is not supported.")
        return problems

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(request: LoraRequest):
        if not request.lora_name or not request.lora_path:
            return error_response("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if request.lora_name == model_name:
            message = f"The lora adapter '{request.lora_name}' conflicts with a served base model."
            return error_response(message, "InvalidUserInput", 400)
        if not request.load_inplace and request.lora_name in state["lora"]:
            message = (
                f"The lora adapter '{request.lora_name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True."
            )
            return error_response(message, "InvalidUserInput", 400)
        if not os.path.isfile(os.path.join(request.lora_path, "adapter_config.json")):
            message = f"Loading lora {request.lora_name} failed: No adapter found for {request.lora_path}"
            return error_response(message, "NotFoundError", 404)
        if not os.path.isfile(os.path.join(request.lora_path, "adapter_model.safetensors")):
            # PEFT would fall back to a pickled adapter_model.bin; this server loads safetensors only.
            message = f"no adapter_model.safetensors in {request.lora_path!r} (safetensors only)"
            return error_response(message, "InvalidUserInput", 400)
        problems = _lora_problems(request.lora_path)
        if problems:  # vLLM raises these while adding the adapter: a 500 carrying the message
            return error_response(" ".join(problems), "InternalServerError", 500)
        with lock:
            if request.lora_name in state["lora"]:
                model.delete_adapter(request.lora_name)
            model.load_adapter(request.lora_path, adapter_name=request.lora_name)
            state["lora"][request.lora_name] = request.lora_path
        return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", status_code=200)

    class UnloadRequest(BaseModel):
        lora_name: str
        lora_int_id: int | None = None

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter(request: UnloadRequest):
        if not request.lora_name:
            return error_response(
                "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400
            )
        if request.lora_name not in state["lora"]:
            message = f"The lora adapter '{request.lora_name}' cannot be found."
            return error_response(message, "NotFoundError", 404)
        with lock:
            model.delete_adapter(request.lora_name)
            del state["lora"][request.lora_name]
        return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.", status_code=200)
