"""The routes TRL's vLLM client uses for prompts with images (vLLM 0.30+ with `--enable-scale-out`), on a served
vision-language model: `/v1/chat/completions/render` turns a message's images into features once per prompt, and
`/inference/v1/generate` generates from token ids paired with those features.

The features are this server's own (TRL reads only `mm_placeholders`, which it points at the image tokens of its
own ids): the images as the data URLs they came in, and where the rendered conversation put them. An image this
server cannot read, a model without a vision tower, or ids whose image-token runs do not match the images are
refused with 400 naming what is wrong; nothing is generated from the text alone.
"""

from __future__ import annotations

import base64
import binascii
import io

import torch
from fastapi import FastAPI, Request

from .completions import beyond_context, generate, refusal
from .protocol import CompletionRequest, json_body
from .served import RequestError, ServedModel

# The sampling parameters the generate route takes (vLLM's SamplingParams fields TRL sends); `output_kind` is
# accepted and moot: this server answers every request whole.
SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logprobs")
SAMPLING_FIELDS += ("seed",)
MOOT_FIELDS = ("output_kind",)


def add_multimodal_routes(app: FastAPI, served: ServedModel) -> None:
    @app.post("/v1/chat/completions/render")
    async def render(raw: Request):
        body = await json_body(raw)
        return {"features": rendered_features(served, body.get("messages") or [])}

    @app.post("/inference/v1/generate")
    async def generate_from_features(raw: Request):
        body = await json_body(raw)
        return generated_from_features(served, body)


def _processor(served: ServedModel):
    if served.processor is None:
        raise RequestError(
            400,
            f"{served.model_name} is a text model: it takes no images. Serve a vision-language checkpoint (one with "
            "a processor and a vision tower) for prompts with images",
        )
    return served.processor


def decoded_image(url: str, where: str):
    """A `data:image/...;base64,...` URL as a PIL image (this server fetches nothing)."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:image/") or ";base64," not in url:
        raise RequestError(400, f"{where}: send images inline as data:image/...;base64 URLs (nothing is fetched)")
    try:
        return Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True))).convert("RGB")
    except (binascii.Error, UnidentifiedImageError, OSError) as error:
        raise RequestError(400, f"{where}: the image cannot be read ({error})") from error


def _image_urls(messages: list[dict]) -> list[str]:
    urls = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image_url":
                urls.append((part.get("image_url") or {}).get("url"))
    return urls


def image_runs(ids: list[int], image_token_id: int) -> list[dict]:
    """The runs of image tokens in `ids`, as vLLM's placeholders (`offset`, `length`)."""
    runs, position = [], 0
    while position < len(ids):
        if ids[position] != image_token_id:
            position += 1
            continue
        length = 0
        while position + length < len(ids) and ids[position + length] == image_token_id:
            length += 1
        runs.append({"offset": position, "length": length})
        position += length
    return runs


def rendered_features(served: ServedModel, messages: list[dict]) -> dict:
    """A conversation's images as features: each decoded (so a bad one is refused here, once per prompt) and placed
    where the processor's chat template puts its image tokens."""
    processor = _processor(served)
    urls = _image_urls(messages)
    if not urls:
        raise RequestError(400, "render takes a conversation with images (image_url parts): none was sent")
    images = [decoded_image(url, f"image {i}") for i, url in enumerate(urls)]
    conversation = [{"role": "user", "content": [{"type": "image", "image": image} for image in images]}]
    encoded = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = list(encoded["input_ids"][0])
    return {"mm_placeholders": {"image": image_runs(ids, served.tokenizer.image_token_id)}, "images": urls}


def vision_inputs(served: ServedModel, token_ids: list[int], features: dict, rows: int) -> dict:
    """`generate`'s image inputs for `rows` copies of one prompt: the features' images, processed, each row's in
    turn, and the token types of models that mark image tokens (Gemma 3)."""
    processor = _processor(served)
    urls = list((features or {}).get("images") or [])
    runs = image_runs(token_ids, served.tokenizer.image_token_id)
    if len(runs) != len(urls):
        raise RequestError(
            400,
            f"the token ids hold {len(runs)} runs of image tokens but the features carry {len(urls)} images: "
            "pair each prompt with the features rendered for its own images",
        )
    placed = ((features or {}).get("mm_placeholders") or {}).get("image") or []
    lengths = [run["length"] for run in runs]
    if len(placed) == len(runs) and [p.get("length") for p in placed] != lengths:
        raise RequestError(
            400,
            f"the token ids' runs of image tokens are {lengths} long, but the images take "
            f"{[p.get('length') for p in placed]} tokens: render the prompt with the model's processor",
        )
    if not urls:
        return {}
    images = [decoded_image(url, f"image {i}") for i, url in enumerate(urls)]
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    inputs = {"pixel_values": pixel_values.repeat(rows, *([1] * (pixel_values.dim() - 1)))}
    ids = torch.tensor([token_ids] * rows)
    inputs["token_type_ids"] = (ids == served.tokenizer.image_token_id).long()
    return inputs


def generated_from_features(served: ServedModel, body: dict):
    """One prompt's token ids with its features: its n choices, as `/v1/completions` answers them."""
    sampling = dict(body.get("sampling_params") or {})
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS) - set(MOOT_FIELDS))
    if unknown:
        raise RequestError(400, f"sampling_params {unknown} are not supported by trl-scale serve")
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
        raise RequestError(400, "token_ids: send the prompt as a non-empty list of token ids")
    fields = {key: sampling[key] for key in SAMPLING_FIELDS if key in sampling}
    request = CompletionRequest(model=body.get("model"), prompt=[token_ids], return_tokens_as_token_ids=True, **fields)
    refused = refusal(served, request) or beyond_context(served, [token_ids], request.max_tokens)
    if refused is not None:
        return refused
    vision = vision_inputs(served, token_ids, body.get("features"), request.n)
    with served.gate.generation():
        answer = generate(served, request, [token_ids], vision)
    served.completions_generated += request.n
    choices = [{k: c[k] for k in ("index", "token_ids", "logprobs", "finish_reason")} for c in answer["choices"]]
    return {"request_id": body.get("request_id"), "choices": choices}
