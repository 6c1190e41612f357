"""A processor for the tiny Qwen2-VL (`build_tiny_qwen2_vl`), built in code.

transformers' `Qwen2VLProcessor` takes a video processor, which needs torchvision, and this machine's torch has no
torchvision build: neither `AutoProcessor.from_pretrained` nor the class's constructor (it checks a `None` video
processor against a class it cannot import) gives one here. This one is the same class with images only: the PIL image
processor (no torchvision), the toy tokenizer and a chat template that puts an image's `<|vision_start|><|image_pad|>
<|vision_end|>`, which the processor expands to the image's grid of tokens. Hand it to a trainer as
`processing_class`; it is not saved (no loader could read it back here)."""

from __future__ import annotations

import os

from transformers import AutoTokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .tokenizer import vlm_chat_template

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor (videos are refused by the processor itself)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def qwen2_vl_processor(path: str | os.PathLike, max_patches: int = 64) -> ImagesOnlyQwen2VLProcessor:
    """The processor of the tiny Qwen2-VL saved at `path`: 7-pixel patches, two frames deep, 2x2 merged (the tiny
    vision tower's), an image resized to between 2x2 and `max_patches` patches (so 1 to `max_patches / 4` tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=7,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=14 * 14,
        max_pixels=7 * 7 * max_patches,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    template = vlm_chat_template(IMAGE_PLACEHOLDER)
    tokenizer.chat_template = template
    return ImagesOnlyQwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=template
    )
