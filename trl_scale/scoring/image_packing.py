"""Packed scoring of calls with images: the call's sequences packed into rows as wide as the longest, in batch order,
so the forward's images (TRL's `pixel_values`, in row order) meet their own tokens; `position_ids` restart per
sequence; the per-token image fields (`token_type_ids`, `mm_token_type_ids`) are packed as the ids; the attention
masks are built here (:func:`packed_masks`). The padding goes, the images stay with their rows. One forward per
call, as TRL's. Two layouts:

- one tensor per image, its tokens a run in the ids (Gemma 3): an image's tokens attend to each other both ways;
- a patch grid per image (`image_grid_thw`, Qwen2-VL and its kin): image tokens take 3-D "mrope" positions (time,
  height, width), computed here on the padded call as the model computes them (`get_rope_index`), packed with the
  ids, behind one row of plain positions that keeps each token to its sequence (transformers' `[4, rows, width]`).

Probed once per model, as text packing is (:mod:`.support`): three sequences with an image each, packed against each
alone. A model it finds inexact, or whose images come in another layout (tiles), is scored padded, through the
chunked head, as before.
"""

from __future__ import annotations

import torch

from ..logs import get_logger
from .support import PROBE_TOLERANCES

logger = get_logger(__name__)

PER_TOKEN = ("token_type_ids", "mm_token_type_ids")
PACKABLE = frozenset({"pixel_values", "image_grid_thw", *PER_TOKEN})


def packs_images(backbone, images: dict | None, padding_free: bool | None = None) -> bool:
    """Whether this call's `images` go packed: packing not switched off (`padding_free` False), a layout this module
    packs, on a model the probe found exact."""
    if padding_free is False or not images or not set(images) <= PACKABLE or "pixel_values" not in images:
        return False
    if "image_grid_thw" in images and "mm_token_type_ids" not in images:
        return False  # the 3-D positions are computed from the marked tokens (the model itself refuses without)
    support = getattr(backbone, "_trl_scale_image_packing", None)
    if support is None:
        support = probe_image_packing(backbone)
        backbone._trl_scale_image_packing = support
        if not support[0]:
            logger.warning(
                f"trl-scale: calls with images are scored padded for model type "
                f"'{backbone.config.model_type}' ({support[1]}): their padding stays, the chunked head still runs"
            )
    return support[0]


def image_pieces(backbone, input_ids, attention_mask, images: dict) -> list:
    """The call's hidden states from one packed forward with its images, as the engine's pieces: ``[(flat index into
    the padded [B, T], hidden [n, H])]``. One forward per call, as TRL's padded one: under ZeRO-3 or FSDP every rank
    then runs as many forwards through the vision tower (split by a token budget, ranks could differ and wait on
    each other's gathers); its rows are no wider than the longest sequence, so its masks are no larger than the
    padded call's."""
    inputs, packed_flat, padded_flat = packed_inputs(backbone, input_ids, attention_mask, images)
    hidden = backbone(**inputs).last_hidden_state
    return [(padded_flat, hidden.reshape(-1, hidden.size(-1))[packed_flat])]


def packed_rows(lengths: list[int]) -> list[list[int]]:
    """Sequences (by batch index) into rows no wider than the longest, filled in batch order (next fit): the rows'
    images, read row after row, are then the batch's in its order. Empty sequences are left out."""
    width, rows, used = max(lengths), [[]], 0
    for index, length in enumerate(lengths):
        if not length:
            continue
        if rows[-1] and used + length > width:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def packed_inputs(backbone, input_ids, attention_mask, images: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The backbone's inputs for the call's sequences packed into rows as wide as the longest (`packed_rows`: the
    attention of a dense mask then costs no more than the padded batch's), and the flat indices that pair each packed
    token (into ``[R * W]``) with its place in the padded ``[B, T]`` batch."""
    real = attention_mask.bool()
    lengths = real.sum(1).tolist()
    rows = packed_rows(lengths)
    width, device = max(lengths), input_ids.device
    ids = torch.zeros(len(rows), width, dtype=input_ids.dtype, device=device)
    positions = torch.zeros_like(ids)
    sequences = torch.full_like(ids, -1)  # -1: filler at a row's end
    types = {name: torch.zeros_like(ids) for name in PER_TOKEN if name in images}
    grid = images.get("image_grid_thw")
    rope = None if grid is None else grid_positions(backbone, input_ids, attention_mask, images)  # [3, B, T]
    packed_rope = None if rope is None else rope.new_zeros(3, *ids.shape)
    packed_flat, padded_flat = [], []
    for row, members in enumerate(rows):
        column = 0
        for index in members:
            columns = real[index].nonzero()[:, 0]
            span = slice(column, column + len(columns))
            ids[row, span], sequences[row, span] = input_ids[index, columns], index
            positions[row, span] = torch.arange(len(columns), device=device)
            for name, value in types.items():
                value[row, span] = images[name][index, columns]
            if rope is not None:
                packed_rope[:, row, span] = rope[:, index, columns]
            packed_flat.append(torch.arange(span.start, span.stop, device=device) + row * width)
            padded_flat.append(columns + index * real.size(1))
            column = span.stop
    inputs = {"input_ids": ids, "position_ids": positions, "use_cache": False, "pixel_values": images["pixel_values"]}
    inputs |= types
    token_types = next(iter(types.values()), None)  # one tensor per image: its tokens attend both ways
    if rope is not None:  # a grid per image: causal, 3-D positions behind the plain ones (filler: its own)
        packed_rope = torch.where(sequences[None] >= 0, packed_rope, positions[None])
        inputs["position_ids"] = torch.cat([positions[None], packed_rope])
        inputs["image_grid_thw"], token_types = grid, None
    inputs["attention_mask"] = packed_masks(backbone, positions, sequences, token_types)
    return inputs, torch.cat(packed_flat), torch.cat(padded_flat)


def grid_positions(backbone, input_ids, attention_mask, images: dict) -> torch.Tensor:
    """The padded call's 3-D positions ``[3, B, T]``, as the model computes them for it (each row's image tokens at
    (time, height, width) of its own grid, text after an image continuing from the grid's extent)."""
    rope, _ = backbone.get_rope_index(
        input_ids=input_ids,
        mm_token_type_ids=images["mm_token_type_ids"],
        image_grid_thw=images["image_grid_thw"],
        attention_mask=attention_mask,
    )
    return rope


def packed_masks(backbone, positions, sequences, token_types) -> dict:
    """The attention masks of packed rows with images (``[R, W]`` positions, batch index per token or -1 for filler,
    token types), per layer type, as Gemma 3 composes them for one sequence (full layers: causal or within one image;
    sliding layers: that, within the window), each token kept to its own sequence (filler to itself). Built here
    because transformers' packed-sequence masks read the image blocks at the tokens' positions in their sequence
    instead of in the row: a packed sequence's image then attends as another's would (measured: 0.8 off on the
    second of two sequences with their images at other places)."""
    is_image = token_types == 1 if token_types is not None else torch.zeros_like(positions, dtype=torch.bool)
    starts = is_image & ~torch.cat([is_image.new_zeros(is_image.size(0), 1), is_image[:, :-1]], dim=1)
    blocks = torch.where(is_image, starts.long().cumsum(1), torch.zeros_like(positions))  # 0: text
    same_sequence = sequences[:, :, None] == sequences[:, None, :]
    causal = positions[:, None, :] <= positions[:, :, None]
    one_image = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] > 0)
    itself = torch.eye(positions.size(1), dtype=torch.bool, device=positions.device)[None]
    full = (same_sequence & (causal | one_image)) | itself
    text = backbone.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    sliding = full if window is None else full & (positions[:, :, None] - positions[:, None, :] < window)
    dtype = next(backbone.parameters()).dtype
    eager = getattr(backbone.config, "_attn_implementation", None) == "eager"

    def laid_out(allowed):
        allowed = allowed[:, None]
        if not eager:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )

    return {"full_attention": laid_out(full), "sliding_attention": laid_out(sliding)}


def probe_image_packing(backbone) -> tuple[bool, str]:
    """Three sequences with an image each (the model's own image tokens and image size, or patch grids), packed and
    alone: the same hidden states (within the packing probe's tolerance)? Returns ``(exact, reason)``."""
    config = backbone.config
    generator = torch.Generator().manual_seed(0)
    drawn = _probe_images(backbone, generator)
    if isinstance(drawn, str):
        return False, drawn
    runs, pixels, grids, type_name = drawn
    parameter = next(backbone.parameters())
    image_token, vocab = config.image_token_id, config.get_text_config().vocab_size
    sequences = []
    for run, (before, after) in zip(runs, ((2, 2), (1, 2), (6, 14))):  # the first two share a row; images elsewhere
        text = torch.randint(0, vocab, (before + after,), generator=generator)
        text[text == image_token] = 0
        sequences.append(torch.cat([text[:before], run, text[before:]]))
    pixels = [p.to(parameter.device, parameter.dtype) for p in pixels]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)], mask[row, : len(sequence)] = sequence, 1
    ids, mask = ids.to(parameter.device), mask.to(parameter.device)
    images = {"pixel_values": torch.cat(pixels), type_name: (ids == image_token).long() * mask}
    alone_images = [{"pixel_values": p} for p in pixels]
    if grids is not None:
        images["image_grid_thw"] = grids.to(parameter.device)
        alone_images = [
            dict(a, image_grid_thw=images["image_grid_thw"][i : i + 1]) for i, a in enumerate(alone_images)
        ]
    was_training = backbone.training
    backbone.eval()
    try:
        with torch.no_grad(), torch.autocast(parameter.device.type, enabled=False):
            inputs, packed_flat, padded_flat = packed_inputs(backbone, ids, mask, images)
            hidden = backbone(**inputs).last_hidden_state.float()
            packed = hidden.new_zeros(ids.numel(), hidden.size(-1))
            packed[padded_flat] = hidden.reshape(-1, hidden.size(-1))[packed_flat]
            packed = packed.view(*ids.shape, -1)
            alone = []
            for sequence, own in zip(sequences, alone_images):
                sequence = sequence[None].to(parameter.device)
                own[type_name] = (sequence == image_token).long()
                alone.append(backbone(input_ids=sequence, use_cache=False, **own).last_hidden_state[0].float())
    except (ValueError, TypeError, RuntimeError, AttributeError) as error:
        return False, f"its packed forward with images fails ({type(error).__name__}: {str(error)[:160]})"
    finally:
        backbone.train(was_training)
    tolerance = PROBE_TOLERANCES["full" if parameter.dtype == torch.float32 else "half"]["alone"]
    for row, own in enumerate(alone):
        error = (packed[row, : len(own)] - own).abs().max().item() / max(1.0, own.abs().max().item())
        if error > tolerance:
            return False, f"a packed sequence with an image differs from it alone by {error:.1e}"
    return True, ""


def _probe_images(backbone, generator) -> tuple | str:
    """The probe's three images in the model's layout: ``(image token runs, pixel values per image, grids or None,
    the per-token field's name)``, or why it has none."""
    config = backbone.config
    vision = getattr(config, "vision_config", None)
    image_token = getattr(config, "image_token_id", None)
    if image_token is None or vision is None:
        return "it names no image token or vision tower"
    if getattr(config, "mm_tokens_per_image", None) is not None:  # one tensor per image (Gemma 3)
        size, channels = vision.image_size, getattr(vision, "num_channels", 3)
        runs = [torch.full((config.mm_tokens_per_image,), image_token)] * 3
        return runs, list(torch.rand(3, 1, channels, size, size, generator=generator)), None, "token_type_ids"
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is not None and hasattr(backbone, "get_rope_index"):  # a patch grid per image, 3-D positions
        grids = torch.tensor([[1, 2 * merge, 2 * merge], [1, merge, 2 * merge], [1, 2 * merge, merge]])
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        runs = [torch.full((int(g.prod()) // merge**2,), image_token) for g in grids]
        pixels = [torch.rand(int(g.prod()), patch, generator=generator) for g in grids]
        return runs, pixels, grids, "mm_token_type_ids"
    return "its images are neither one run of image tokens each (mm_tokens_per_image) nor a patch grid"
