"""Images in rollout: a row's images as TRL reads them (its `image` or `images` column), the conversational prompt
TRL builds from them (so the stream tokenizes what TRL's step will), and the PNG data URLs a server renders."""

from __future__ import annotations

import base64
import hashlib
import io


def row_images(rows: list) -> list[list | None] | None:
    """Each row's images, as TRL 1.16's `_generate_and_score_completions` reads them (`images`, else `image`), or
    None where the batch has none."""
    if not rows or not isinstance(rows[0], dict):  # an environment's rows may be made by its reset
        return None
    if "images" in rows[0]:
        images = [row.get("images") for row in rows]
    elif "image" in rows[0]:
        images = [[row["image"]] if row.get("image") is not None else None for row in rows]
    else:
        return None
    return None if all(not row for row in images) else images


def multimodal_prompts(rows: list, images: list[list | None] | None) -> list:
    """The rows' prompts as TRL's step builds them: where the batch has images (`images`, per row: `row_images`),
    each turned into content lists holding its own."""
    prompts = [row.get("prompt") if isinstance(row, dict) else None for row in rows]
    if not images or not any(images):
        return prompts
    from trl.data_utils import prepare_multimodal_messages

    return [prepare_multimodal_messages(p, images=i) for p, i in zip(prompts, images, strict=True)]


def image_urls(images) -> tuple[str, ...]:
    """A row's images (PIL images, or None) as PNG data URLs, the form the render route takes."""
    urls = []
    for image in images or ():
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        urls.append(f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}")
    return tuple(urls)


def image_keys(images: list[list | None]) -> list[tuple]:
    """Per row (`images`: each row's images, or None), what tells its images apart (their pixels' digests): TRL's
    copies of one row hold equal images in separate objects, and two rows with one text and other images are two
    prompts."""

    def key(image) -> tuple:
        return image.size, image.mode, hashlib.blake2b(image.tobytes(), digest_size=16).digest()

    return [tuple(key(image) for image in row or ()) for row in images]
