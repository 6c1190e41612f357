"""Tools that answer with images (TRL 1.16's multimodal tool responses), for every vision-language processor: TRL's
step covers them only for Qwen- and Llama-style tokenizers and processors whose image processor returns model inputs
alone. Two mends, each where TRL would otherwise fail or train on a wrong mask:
- TRL finds the image token of the forward's token types by name (`<|image_pad|>`, `<|image|>`); another name (Gemma
  3's `<image_soft_token>`) left it unset, so every token of a tool's image was typed text (a causal mask over the
  image, where the model and the servers attend over it both ways). The policy's own image token is used.
- TRL forwards the image processor's whole output, and Gemma 3's holds `num_crops` (the count of pan-and-scan crops,
  which its processor otherwise drops), which TRL's scoring does not take (the step stopped with a TypeError) and
  TRL's local generation hands to `generate` (which refuses it). It is dropped."""

from __future__ import annotations

import torch

from .feature import Feature


def policy_image_token(trl) -> int | None:
    """The token a vision-language policy replaces with image features (its config's `image_token_id`), for a run
    with a processor; None otherwise. (Not the processor's `image_token_id`: Gemma 3's names its begin-image token.)"""
    from transformers import ProcessorMixin

    token = getattr(trl.model.config, "image_token_id", None)
    return token if isinstance(trl.processing_class, ProcessorMixin) else None


class ToolImages(Feature):
    """A run with tools (or environments, whose methods are tools) on a vision-language policy."""

    name = "tool_images"

    @classmethod
    def build(cls, plan) -> ToolImages | None:
        return cls() if plan.tools and plan.vision_language else None

    def setup(self, run) -> None:
        token = policy_image_token(run.trl)
        if run.trl.image_pad_token_id is None and token is not None:
            run.trl.set_image_pad_token_id(token)

    def scoring(self, run, proceed, *args, **kwargs):
        return proceed(*args, **_without_crops(kwargs))

    def single_turn(self, run, proceed, prompt_ids, images, multimodal_fields, *args, **kwargs):
        # TRL's local generation of a turn after a tool's image hands the same fields to `generate`
        return proceed(prompt_ids, images, _without_crops(multimodal_fields), *args, **kwargs)


class TextPolicyToolAnswers(Feature):
    """A run with tools (or environments) on a text-only policy: a tool answering with content blocks that hold an
    image (TRL 1.16's multimodal tool answers) is refused. TRL passes the blocks to the chat template, which a
    text-only template renders as the list's repr: the policy would read Python text where an image was meant."""

    name = "text_policy_tool_answers"

    @classmethod
    def build(cls, plan) -> TextPolicyToolAnswers | None:
        return cls() if plan.tools and plan.vision_language is False else None

    def tool_suffix(self, run, proceed, tool_messages):
        for message in tool_messages:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image" for p in content):
                raise ValueError(
                    f"tool {message.get('name', '?')!r} answered with an image, but the policy is text-only (its "
                    "processing class is a tokenizer, not a processor): its chat template would render the answer "
                    "as the list's text. Fix: have the tool answer with text, or train a vision-language policy "
                    "with its processor as processing_class"
                )
        return proceed(tool_messages)


def _without_crops(fields: dict) -> dict:
    """`fields` without the image processor's `num_crops`, refused where an image was cut into crops."""
    if "num_crops" not in fields:
        return fields
    fields = dict(fields)
    if torch.as_tensor(fields.pop("num_crops")).any():
        raise ValueError(
            "a tool answered with an image that the image processor cut into pan-and-scan crops (num_crops > 0): the "
            "tool's image tokens hold the whole image only. Fix: do_pan_and_scan=False on the processor's image "
            "processor"
        )
    return fields
