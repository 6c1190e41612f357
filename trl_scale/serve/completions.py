"""`/v1/completions` on a transformers model, answered as vLLM answers it: prompts as token ids or text, `n` choices
per prompt (prompt-major), sampling parameters, the sampled tokens' processed log-probs, vLLM's refusals (another
model, streaming, beyond the context)."""

from __future__ import annotations

import time

import torch

from ..generation import shared_prefill_generate
from .protocol import CompletionRequest, error_response
from .routed_experts import routed_experts
from .served import RequestError, ServedModel


def prompt_ids(served: ServedModel, request: CompletionRequest) -> list[list[int]]:
    """The request's prompts as token ids (text tokenized without special tokens), each checked against the vocab."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise RequestError(400, "prompt is empty: send token-id lists or strings")
    tokenizer = served.tokenizer
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
    vocab = served.model.config.get_text_config().vocab_size
    for i, seq in enumerate(ids):
        if not seq:
            raise RequestError(400, f"prompt {i} has no tokens")
        if min(seq) < 0 or max(seq) >= vocab:
            raise RequestError(400, f"prompt {i} has token ids outside [0, {vocab})")
    return ids


def refusal(served: ServedModel, request):
    """vLLM's answers to a request this server cannot serve: another model (404), streaming (400: this server
    answers whole responses only). None when it can."""
    if request.model not in (None, served.model_name, *served.lora):
        message = f"The model `{request.model}` does not exist (not served here: serving {served.model_name!r})."
        return error_response(message, "NotFoundError", 404)
    if request.stream:
        message = "trl-scale serve does not stream: send stream=false (the whole response comes at once)"
        return error_response(message, "BadRequestError", 400)
    return None


def beyond_context(served: ServedModel, prompts: list[list[int]], max_tokens: int):
    """vLLM answers 400 when a prompt and its max_tokens do not fit the model's context. None when they fit."""
    longest, context = max(len(p) for p in prompts), served.max_model_len
    if longest + max_tokens > context:
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). Please "
            "reduce the length of the prompt or of max_tokens."
        )
        return error_response(message, "BadRequestError", 400)
    return None


def complete(served: ServedModel, request: CompletionRequest):
    """The whole route: refusals, then a generation admitted through the pause gate."""
    refused = refusal(served, request)
    if refused is not None:
        return refused
    prompts = prompt_ids(served, request)
    too_long = beyond_context(served, prompts, request.max_tokens)
    if too_long is not None:
        return too_long
    start = request.routed_experts_prompt_start
    if served.settings.return_routed_experts and any(start > len(p) for p in prompts):  # vLLM's input check
        shortest = min(len(p) for p in prompts)
        message = f"routed_experts_prompt_start must be between 0 and {shortest} (the prompt's length), got {start}"
        return error_response(message, "BadRequestError", 400)
    with served.gate.generation():
        answer = generate(served, request, prompts)
    served.completions_generated += len(prompts) * request.n
    return answer


def _sampling(request: CompletionRequest, pad: int) -> dict:
    greedy = request.temperature == 0.0
    return dict(
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


def _run(served: ServedModel, request: CompletionRequest, expanded: list[list[int]], vision: dict | None = None):
    """model.generate on the left-padded prompts (with `vision`: the rows' image inputs, for one prompt's rows),
    under the model's lock and with the request's adapter; returns (each row's completion cut at its end of
    sequence, and whether it stopped there; the processed log-probs per step; each row's routes where the server
    returns them, else None)."""
    width = max(len(p) for p in expanded)
    tokenizer, model = served.tokenizer, served.model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in expanded])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in expanded])
    with served.lock:
        if request.seed is not None:
            torch.manual_seed(request.seed)
        if served.lora:
            if request.model in served.lora:
                model.set_adapter(request.model)
                model.enable_adapters()
            else:
                model.disable_adapters()
        with torch.no_grad():
            # a prompt's n rows prefilled once (the same tokens as n prefills: generation/prefill.py)
            sampling = _sampling(request, pad) | (vision or {})
            out = shared_prefill_generate(model.generate, model, input_ids, attention_mask, **sampling)
        completions = _cut_at_eos(served, out.sequences[:, width:].tolist())
        routes = None
        if served.settings.return_routed_experts:  # with the weights and adapter that generated them
            sequences = [prompt + tokens for prompt, (tokens, _) in zip(expanded, completions)]
            routes = routed_experts(model, sequences, request.routed_experts_prompt_start)
        if served.settings.token_delay:  # a slower server: fewer tokens per second, with the model held
            time.sleep(served.settings.token_delay * (out.sequences.shape[1] - width) * len(expanded))
    if served.settings.step_delay:  # decoding steps (the longest answer), overlapping other requests' steps
        time.sleep(served.settings.step_delay * (out.sequences.shape[1] - width))
    # Processed log-probs (after temperature/top-k/top-p), as vLLM's `processed_logprobs` mode gives them.
    step_logprobs = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)
    return completions, step_logprobs, routes


def _cut_at_eos(served: ServedModel, sequences: list[list[int]]) -> list[tuple[list[int], bool]]:
    """Each row's tokens up to its first end-of-sequence token (kept), as a choice returns them, and whether it
    stopped there."""
    eos_id = served.model.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id])
    cut = []
    for sequence in sequences:
        stop = next((pos for pos, t in enumerate(sequence) if t in eos), None)
        cut.append((sequence, False) if stop is None else (sequence[: stop + 1], True))
    return cut


def _logprobs(served: ServedModel, request: CompletionRequest, tokens: list[int], step_logprobs) -> dict:
    """vLLM's `logprobs` of one choice: the sampled tokens' and, with `logprobs > 0`, the top ones per step."""
    chosen = step_logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()

    def label(token: int) -> str:
        return f"token_id:{token}" if request.return_tokens_as_token_ids else served.tokenizer.decode([token])

    top = []
    for pos, token in enumerate(tokens):
        entry = {label(token): chosen[pos]}
        if request.logprobs > 0:
            values, ids = step_logprobs[pos].topk(request.logprobs)
            entry.update({label(j): v for j, v in zip(ids.tolist(), values.tolist())})
        top.append(entry)
    return {"tokens": [label(t) for t in tokens], "token_logprobs": chosen, "top_logprobs": top}


def generate(
    served: ServedModel, request: CompletionRequest, prompts: list[list[int]], vision: dict | None = None
) -> dict:
    """The choices of `prompts` (`vision`: the image inputs of a single prompt's n rows, `multimodal.py`)."""
    expanded = [p for p in prompts for _ in range(request.n)]  # prompt-major, as vLLM orders choices
    completions, step_logprobs, routes = _run(served, request, expanded, vision)
    choices = []
    for i, (tokens, stopped) in enumerate(completions):
        choice = {
            "index": i,
            "text": served.tokenizer.decode(tokens, skip_special_tokens=True),
            "token_ids": tokens,
            "prompt_token_ids": expanded[i],
            "finish_reason": "stop" if stopped else "length",
            "logprobs": None,
        }
        if request.logprobs is not None:
            choice["logprobs"] = _logprobs(served, request, tokens, step_logprobs[i, : len(tokens)])
        if routes is not None:
            choice["routed_experts"] = routes[i]
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c["token_ids"]) for c in choices)
    return {
        "id": f"cmpl-{time.time_ns()}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model or served.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
