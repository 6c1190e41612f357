"""`trl-scale serve`: a transformers-backed server speaking vLLM's contract (the OpenAI-compatible routes and the
dev-mode RL routes of vLLM 0.22-0.33), for CPU machines and tests.

Routes, with vLLM's request and response models and status codes (vLLM 0.31 source, cited where each is built):
`GET /health`, `GET /v1/models`, `POST /v1/completions` (token-id or text prompts, `n`, sampling parameters,
`logprobs`, `return_token_ids`; choices prompt-major; `logprobs.tokens` decoded unless
`return_tokens_as_token_ids`), and the RL routes: `/pause` `/resume` `/is_paused`, `/reset_prefix_cache`,
`/get_world_size`, `/server_info`, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` (JSON
`update_info`; a non-JSON body is a 400), `/finish_weight_update`, `/update_weight_version`, `/weight_info`,
`/collective_rpc` (`reload_weights` from a directory), `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's
LoRA rules). Its weight-transfer engine is `trl_scale_gloo` (`--world-size` ranks, one thread each), the very code
real vLLM runs with trl-scale's plugin (`trl_scale_vllm_plugin.gloo`). JSON and safetensors only, never pickle.
"""

import argparse
import hmac
import ipaddress
import os
import threading
import time

import torch
from trl_scale_vllm_plugin.gloo import BACKEND as GLOO_BACKEND
from trl_scale_vllm_plugin.gloo import GlooInitInfo, GlooUpdateInfo, open_gloo_group, receive

from ..model_paths import check_model_path

MAX_REQUEST_BYTES = 16 * 2**20  # JSON requests; weight bodies are bounded by the model's own size


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """A server reachable beyond this machine takes weight updates and runs generation for whoever connects: it needs
    a bearer token, or an explicit opt-out."""
    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host!r} without a bearer token: anyone who can reach it could replace the model's "
            "weights. Fix: pass --api-key KEY (or set TRL_SCALE_API_KEY), bind --host 127.0.0.1, or pass "
            "--allow-unauthenticated on a trusted network."
        )


def check_language_model_head(model, loading: dict, model_path: str) -> None:
    """Refuse a checkpoint whose language-model head was not in it (a reward or value model's classifier
    checkpoint): transformers would initialise the head at random and the server would answer with noise."""
    architectures = list(getattr(model.config, "architectures", None) or [])
    head = model.get_output_embeddings()
    head_names = [name for name, module in model.named_modules() if module is head and name]
    missing = [key for key in loading.get("missing_keys", []) if any(key.startswith(n) for n in head_names)]
    heads = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "Model")
    if missing or any(a.endswith(heads) and not a.endswith("LMHeadModel") for a in architectures):
        raise ValueError(
            f"--model {model_path} is not a causal LM checkpoint (architectures: {architectures or 'unknown'}; "
            f"missing from it: {missing or 'none'}): its language-model head would be random and every completion "
            "noise. Fix: serve the policy (a checkpoint saved from an AutoModelForCausalLM), not a reward or value "
            "model"
        )


def weights_digest_of(named_tensors) -> dict[str, str]:
    """sha256 of each tensor's fp32 bytes, by name (LoRA wrappers' `base_layer` names mapped back)."""
    import hashlib

    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    digest = {}
    for name, tensor in items:
        if "lora_" in name:
            continue
        data = tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        digest[name.replace(".base_layer", "")] = hashlib.sha256(data).hexdigest()
    return digest


def create_app(
    model_path: str,
    api_key: str | None = None,
    token_delay: float = 0.0,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    world_size: int = 1,
    max_lora_rank: int = 16,
    weight_transfer_timeout: float = 300.0,
):
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, Response
    from pydantic import BaseModel, Field
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_path(model_path, "--model")
    # Code shipped inside a model directory runs only when asked for (--trust-remote-code).
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model, loading = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, output_loading_info=True
    )
    check_language_model_head(model, loading, model_path)
    model.eval()
    max_model_len = model.config.max_position_embeddings
    model_name = os.path.basename(os.path.normpath(model_path))
    lock = threading.Lock()  # one generation or weight update at a time
    running = threading.Event()  # cleared by /pause: new generations wait for /resume
    running.set()
    gate = threading.Condition()  # guards `running` and the count of admitted generations
    admitted = [0]  # generations past the gate, not finished: what /pause?mode=wait drains
    state = {
        "weight_version": None,
        "lora": {},
        "engine": None,  # the weight-transfer engine: this server's gloo ranks
        "updating": False,  # between /start_weight_update and /finish_weight_update
        "prefix_cache_resets": 0,
        "engine_layout": None,  # {"rank_offset", "world_size"} of the group it joined
    }
    app = FastAPI(title="trl-scale serve")

    def error_response(message: str, kind: str, status: int) -> JSONResponse:
        # vLLM's ErrorResponse (entrypoints/serve/engine/protocol.py) for the OpenAI-compatible routes.
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return JSONResponse(body, status_code=status)

    async def json_body(request: Request) -> dict:
        # vLLM's RL routes parse the body themselves and answer 400 to anything that is not JSON
        # (entrypoints/serve/dev/rlhf/api_router.py:186-201).
        import json

        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise HTTPException(400, "Invalid JSON format") from error
        if not isinstance(body, dict):
            raise HTTPException(400, "Invalid JSON format")
        return body

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

    expected_authorization = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def check_token_and_size(request: Request, call_next):
        if expected_authorization is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected_authorization):  # constant time: no timing oracle on the key
                return JSONResponse({"error": {"message": "missing or wrong bearer token"}}, status_code=401)
        if request.method == "POST":
            limit = max_request_bytes  # weights never travel in a body: they are broadcast or read from disk
            length = request.headers.get("content-length")
            if length is None:
                return JSONResponse({"error": {"message": "send a Content-Length header"}}, status_code=411)
            if int(length or 0) > limit:
                message = f"request body of {int(length)} bytes is over this endpoint's limit of {limit} bytes"
                return JSONResponse({"error": {"message": message}}, status_code=413)
        return await call_next(request)

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    def models():
        data = [{"id": model_name, "object": "model", "max_model_len": max_model_len}]
        data += [{"id": name, "object": "model", "parent": model_name} for name in state["lora"]]
        return {"object": "list", "data": data}

    def _prompts(request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise HTTPException(400, "prompt is empty: send token-id lists or strings")
        ids = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
        vocab = model.config.vocab_size
        for i, seq in enumerate(ids):
            if not seq:
                raise HTTPException(400, f"prompt {i} has no tokens")
            if min(seq) < 0 or max(seq) >= vocab:
                raise HTTPException(400, f"prompt {i} has token ids outside [0, {vocab})")
        return ids

    def _refusal(request) -> JSONResponse | None:
        """vLLM's answers to a request this server cannot serve: another model (404), streaming (400: this
        server answers whole responses only)."""
        if request.model not in (None, model_name, *state["lora"]):
            message = f"The model `{request.model}` does not exist (not served here: serving {model_name!r})."
            return error_response(message, "NotFoundError", 404)
        if request.stream:
            message = "trl-scale serve does not stream: send stream=false (the whole response comes at once)"
            return error_response(message, "BadRequestError", 400)
        return None

    def _beyond_context(prompts: list[list[int]], max_tokens: int) -> JSONResponse | None:
        """vLLM answers 400 when a prompt and its max_tokens do not fit the model's context."""
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). Please "
                "reduce the length of the prompt or of max_tokens."
            )
            return error_response(message, "BadRequestError", 400)
        return None

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest):
        refusal = _refusal(request)
        if refusal is not None:
            return refusal
        try:
            encoded = tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as error:  # no chat template, or messages it cannot render
            return error_response(f"cannot apply the chat template: {error}", "BadRequestError", 400)
        prompt = list(encoded["input_ids"])
        fields = request.model_dump(exclude={"messages", "max_tokens", "max_completion_tokens"})
        max_tokens = request.max_completion_tokens or request.max_tokens or max(1, max_model_len - len(prompt))
        answer = completions(CompletionRequest(**fields, prompt=[prompt], max_tokens=max_tokens))
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

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        refusal = _refusal(request)
        if refusal is not None:
            return refusal
        prompts = _prompts(request)
        too_long = _beyond_context(prompts, request.max_tokens)
        if too_long is not None:
            return too_long
        with gate:
            gate.wait_for(running.is_set)
            admitted[0] += 1
        try:
            return _generate(request, prompts)
        finally:
            with gate:
                admitted[0] -= 1
                gate.notify_all()

    def _generate(request: CompletionRequest, prompts: list[list[int]]) -> dict:
        expanded = [p for p in prompts for _ in range(request.n)]  # prompt-major, as vLLM orders choices
        width = max(len(p) for p in expanded)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in expanded])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in expanded])
        greedy = request.temperature == 0.0
        generation = dict(
            max_new_tokens=request.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else request.temperature,
            top_p=None if greedy else request.top_p,
            top_k=None if greedy or request.top_k <= 0 else request.top_k,
            min_p=None if greedy or request.min_p <= 0 else request.min_p,
            repetition_penalty=request.repetition_penalty if request.repetition_penalty != 1.0 else None,
            pad_token_id=pad,
            output_scores=True,
            return_dict_in_generate=True,
        )
        with lock:
            if request.seed is not None:
                torch.manual_seed(request.seed)
            use_lora = request.model in state["lora"]
            if state["lora"]:
                if use_lora:
                    model.set_adapter(request.model)
                    model.enable_adapters()
                else:
                    model.disable_adapters()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **generation)
            if token_delay:  # a slower server: fewer tokens per second, with the model held (benchmarks)
                time.sleep(token_delay * (out.sequences.shape[1] - width) * len(expanded))
        sequences = out.sequences[:, width:]
        # Processed log-probs (after temperature/top-k/top-p), as vLLM's `processed_logprobs` mode gives them.
        step_logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
        eos = set(
            model.generation_config.eos_token_id
            if isinstance(model.generation_config.eos_token_id, list)
            else [model.generation_config.eos_token_id]
        )
        choices = []
        for i, seq in enumerate(sequences.tolist()):
            tokens = []
            for t in seq:
                tokens.append(t)
                if t in eos:
                    break
            choice = {
                "index": i,
                "text": tokenizer.decode(tokens, skip_special_tokens=True),
                "token_ids": tokens,
                "prompt_token_ids": expanded[i],
                "finish_reason": "stop" if tokens and tokens[-1] in eos else "length",
                "logprobs": None,
            }
            if request.logprobs is not None:
                lps = step_logprobs[i, : len(tokens)]
                chosen = lps.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()

                def label(token: int) -> str:
                    if request.return_tokens_as_token_ids:
                        return f"token_id:{token}"
                    return tokenizer.decode([token])

                top = []
                for pos, token in enumerate(tokens):
                    entry = {label(token): chosen[pos]}
                    if request.logprobs > 0:
                        values, ids = lps[pos].topk(request.logprobs)
                        entry.update({label(j): v for j, v in zip(ids.tolist(), values.tolist())})
                    top.append(entry)
                choice["logprobs"] = {
                    "tokens": [label(t) for t in tokens],
                    "token_logprobs": chosen,
                    "top_logprobs": top,
                }
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return {
            "id": f"cmpl-{time.time_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model or model_name,
            "choices": choices,
            "usage": usage,
        }

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

        try:
            with ThreadPoolExecutor(len(state["engine"])) as pool:
                per_rank = list(pool.map(rank, state["engine"]))
        except Exception as error:  # a member left mid-broadcast: this group is over
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

    return app


def serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-scale serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="path of a causal LM saved with save_pretrained")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
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
        "--max-request-mb", type=float, default=MAX_REQUEST_BYTES / 2**20, help="largest JSON request body, in MiB"
    )
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds per generated token (benchmarks)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--world-size", type=int, default=1, help="ranks this server brings to the weight-transfer group (as TP x DP)"
    )
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted (vLLM's default)")
    parser.add_argument(
        "--weight-transfer-timeout", type=float, default=300.0, help="seconds a weight broadcast may take"
    )
    args = parser.parse_args(argv)
    try:
        check_bind(args.host, args.api_key, args.allow_unauthenticated)  # before minutes of model loading
    except ValueError as error:
        parser.error(str(error))
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:  # before minutes of model loading, and with the fix
        parser.error(f"needs {' and '.join(missing)}, not installed here. Fix: pip install 'trl-scale[serve]'")
    import uvicorn

    app = create_app(
        args.model,
        api_key=args.api_key,
        token_delay=args.token_delay,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        max_request_bytes=int(args.max_request_mb * 2**20),
        world_size=args.world_size,
        max_lora_rank=args.max_lora_rank,
        weight_transfer_timeout=args.weight_transfer_timeout,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
