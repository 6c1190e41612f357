"""A scoring call's image inputs, kept with their rows as they cross to a role group (the reference's or PPO's
critic's Ray workers): split over the workers row by row, each shard's images with its own rows.

TRL hands its scoring call the image inputs of the whole batch with `num_images` (images per row): tensors with a
row per image (`pixel_values` of one tensor per image, `image_sizes`, `image_grid_thw`), `pixel_values` of patch
rows for models that take an image grid (Qwen2-VL: `grid.prod()` rows per image), and per-token tensors laid out as
the ids (`token_type_ids`, `mm_token_type_ids`). Tiled images (LFM2-VL, InternVL) are refused, naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring.image_packing import PER_TOKEN

PER_IMAGE = ("image_sizes", "image_grid_thw")
TILED = ("num_tiles", "spatial_shapes", "pixel_attention_mask", "image_position_ids")


@dataclass
class RowImages:
    """The image inputs of some rows (see the module's docstring), on the CPU."""

    num_images: list[int]  # per row
    per_image: dict[str, torch.Tensor]  # first dimension: one entry per image
    patches: dict[str, torch.Tensor]  # first dimension: patch rows (`patch_rows` per image)
    per_token: dict[str, torch.Tensor]  # [rows, T]
    patch_rows: list[int]  # per image: its rows of `patches` (empty without a grid)

    @classmethod
    def from_kwargs(cls, kwargs: dict, num_rows: int) -> RowImages | None:
        """The image inputs among a scoring call's keyword arguments (TRL's names), or None when it has none."""
        given = {name: value for name, value in kwargs.items() if value is not None}
        pixels = given.get("pixel_values")
        if pixels is None:
            return None
        tiled = sorted(set(given) & set(TILED))
        if tiled:
            raise ValueError(
                f"a Ray role group (the reference, PPO's critic) takes images of one tensor per image or an image "
                f"grid; this model's images come in tiles ({tiled}). Fix: reference_placement=None (the reference "
                "stays in the trainer), or backend='local' for PPO's critic"
            )
        num_images = [int(n) for n in given.get("num_images") or [1] * num_rows]
        per_image = {name: given[name].detach().cpu() for name in PER_IMAGE if name in given}
        per_token = {name: given[name].detach().cpu() for name in PER_TOKEN if name in given}
        grid = per_image.get("image_grid_thw")
        if grid is not None:
            return cls(
                num_images, per_image, {"pixel_values": pixels.detach().cpu()}, per_token, grid.prod(-1).tolist()
            )
        if pixels.size(0) != sum(num_images):
            raise ValueError(
                f"pixel_values holds {pixels.size(0)} entries for {sum(num_images)} images: a Ray role group cannot "
                "tell which are whose. Fix: reference_placement=None (the reference stays in the trainer), or "
                "backend='local' for PPO's critic"
            )
        return cls(num_images, {"pixel_values": pixels.detach().cpu(), **per_image}, {}, per_token, [])

    def rows(self, start: int, end: int) -> RowImages:
        """Rows `start` to `end` (exclusive), with their images."""
        first, last = sum(self.num_images[:start]), sum(self.num_images[:end])
        patch_first, patch_last = sum(self.patch_rows[:first]), sum(self.patch_rows[:last])
        return RowImages(
            self.num_images[start:end],
            {name: value[first:last] for name, value in self.per_image.items()},
            {name: value[patch_first:patch_last] for name, value in self.patches.items()},
            {name: value[start:end] for name, value in self.per_token.items()},
            self.patch_rows[first:last],
        )

    def split(self, n: int) -> list[RowImages]:
        """`n` shards at the row bounds `torch.tensor_split` gives (`UnpaddedRows.split`'s)."""
        bounds = [0]
        for part in torch.arange(len(self.num_images)).tensor_split(n):
            bounds.append(bounds[-1] + len(part))
        return [self.rows(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def model_inputs(self, device: torch.device) -> dict:
        """The keyword arguments of the model's forward for these rows."""
        inputs = {**self.per_image, **self.patches, **self.per_token}
        return {name: value.to(device) for name, value in inputs.items()}
