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
import os
import threading
import time

import torch

from ..model_paths import check_model_path
from ..net import is_loopback
from .server_rl import add_rl_routes

MAX_REQUEST_BYTES = 16 * 2**20  # JSON requests; weight bodies are bounded by the model's own size


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

    context = dict(
        model=model,
        state=state,
        lock=lock,
        running=running,
        gate=gate,
        admitted=admitted,
        model_name=model_name,
        model_path=model_path,
        dtype=dtype,
        world_size=world_size,
        max_lora_rank=max_lora_rank,
        weight_transfer_timeout=weight_transfer_timeout,
        error_response=error_response,
        json_body=json_body,
    )
    add_rl_routes(app, **context)
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
