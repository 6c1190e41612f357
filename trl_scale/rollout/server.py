"""`trl-scale serve`: a transformers-backed server speaking the part of vLLM's OpenAI-compatible API that the
rollout client uses, for CPU machines and tests.

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions` (token-id or text prompts, `n`, sampling
parameters, `logprobs`, `return_token_ids`; choices prompt-major with `token_ids`, `prompt_token_ids` and
`logprobs.{tokens,token_logprobs,top_logprobs}` as vLLM returns them), and weight updates:
`POST /update_weights` (a safetensors body), `POST /update_weights_from_path` (`{"path": dir}`) and
`POST /v1/load_lora_adapter` (`{"lora_name", "lora_path"}`). JSON and safetensors only, never pickle.
"""

import argparse
import hmac
import ipaddress
import os
import threading
import time

import torch

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


def create_app(
    model_path: str,
    api_key: str | None = None,
    token_delay: float = 0.0,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    max_request_bytes: int = MAX_REQUEST_BYTES,
):
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, Field
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Code shipped inside a model directory runs only when asked for (--trust-remote-code).
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    model.eval()
    # A full-weight body carries at most the model's parameters (in any dtype up to fp32) plus a header.
    max_weights_bytes = 4 * sum(p.numel() for p in model.parameters()) + 2**20
    model_name = os.path.basename(os.path.normpath(model_path))
    lock = threading.Lock()  # one generation or weight update at a time
    state = {"weight_version": 0, "lora": {}}
    app = FastAPI(title="trl-scale serve")

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
        return_tokens_as_token_ids: bool = True
        seed: int | None = None

    expected_authorization = f"Bearer {api_key}".encode() if api_key else None

    @app.middleware("http")
    async def check_token_and_size(request: Request, call_next):
        if expected_authorization is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected_authorization):  # constant time: no timing oracle on the key
                return JSONResponse({"error": {"message": "missing or wrong bearer token"}}, status_code=401)
        if request.method == "POST":
            limit = max_weights_bytes if request.url.path == "/update_weights" else max_request_bytes
            length = request.headers.get("content-length")
            if length is None:
                return JSONResponse({"error": {"message": "send a Content-Length header"}}, status_code=411)
            if int(length) > limit:
                message = f"request body of {int(length)} bytes is over this endpoint's limit of {limit} bytes"
                return JSONResponse({"error": {"message": message}}, status_code=413)
        return await call_next(request)

    @app.get("/health")
    def health():
        return {"status": "ok", "weight_version": state["weight_version"]}

    @app.get("/v1/models")
    def models():
        data = [{"id": model_name, "object": "model", "max_model_len": model.config.max_position_embeddings}]
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

    @app.post("/v1/completions")
    def completions(request: CompletionRequest):
        if request.model not in (None, model_name, *state["lora"]):
            raise HTTPException(404, f"model {request.model!r} is not served here (serving {model_name!r})")
        prompts = _prompts(request)
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
                top = []
                for pos, token in enumerate(tokens):
                    entry = {f"token_id:{token}": chosen[pos]}
                    if request.logprobs > 0:
                        values, ids = lps[pos].topk(request.logprobs)
                        entry.update({f"token_id:{j}": v for j, v in zip(ids.tolist(), values.tolist())})
                    top.append(entry)
                choice["logprobs"] = {
                    "tokens": [f"token_id:{t}" for t in tokens],
                    "token_logprobs": chosen,
                    "top_logprobs": top,
                }
            choices.append(choice)
        return {"id": f"cmpl-{time.time_ns()}", "object": "text_completion", "model": model_name, "choices": choices}

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
            state["weight_version"] += 1

    @app.post("/update_weights")
    async def update_weights(request: Request):
        from safetensors.torch import load

        body = await request.body()
        try:
            tensors = load(body)
        except Exception as error:  # a malformed body is the client's error
            raise HTTPException(400, f"body is not a safetensors payload: {error}") from error
        _load_state_dict(tensors)
        return {"success": True, "weight_version": state["weight_version"], "updated": len(tensors)}

    class PathRequest(BaseModel):
        path: str

    @app.post("/update_weights_from_path")
    def update_weights_from_path(request: PathRequest):
        from safetensors.torch import load_file

        files = (
            [f for f in sorted(os.listdir(request.path)) if f.endswith(".safetensors")]
            if os.path.isdir(request.path)
            else []
        )
        if not files:
            raise HTTPException(400, f"no .safetensors files in {request.path!r}")
        tensors = {}
        for name in files:
            tensors.update(load_file(os.path.join(request.path, name)))
        _load_state_dict(tensors)
        return {"success": True, "weight_version": state["weight_version"], "updated": len(tensors)}

    class LoraRequest(BaseModel):
        lora_name: str
        lora_path: str
        load_inplace: bool = False

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter(request: LoraRequest):
        if not os.path.isfile(os.path.join(request.lora_path, "adapter_config.json")):
            raise HTTPException(400, f"no adapter_config.json in {request.lora_path!r}")
        if not os.path.isfile(os.path.join(request.lora_path, "adapter_model.safetensors")):
            # PEFT would fall back to a pickled adapter_model.bin; this server loads safetensors only.
            raise HTTPException(400, f"no adapter_model.safetensors in {request.lora_path!r} (safetensors only)")
        with lock:
            if request.lora_name in state["lora"]:
                model.delete_adapter(request.lora_name)
            model.load_adapter(request.lora_path, adapter_name=request.lora_name)
            state["lora"][request.lora_name] = request.lora_path
            state["weight_version"] += 1
        return {"success": True, "lora_name": request.lora_name}

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
    args = parser.parse_args(argv)
    try:
        check_bind(args.host, args.api_key, args.allow_unauthenticated)  # before minutes of model loading
    except ValueError as error:
        parser.error(str(error))
    import uvicorn

    app = create_app(
        args.model,
        api_key=args.api_key,
        token_delay=args.token_delay,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        max_request_bytes=int(args.max_request_mb * 2**20),
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
