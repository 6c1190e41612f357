"""`RowImages`: a scoring call's image inputs split over a role group's workers row by row, each shard with its own
rows' images, in TRL's layouts (one tensor per image; an image grid's patch rows); tiled images refused."""

import pytest
import torch

from trl_scale.distributed.row_images import RowImages
from trl_scale.scoring.packing import UnpaddedRows


def test_images_of_one_tensor_each_follow_their_rows():
    num_images = [1, 2, 0, 1, 1]  # a row with two images, one with none
    pixels = torch.arange(5).view(5, 1, 1, 1).float()  # image k holds the value k
    tokens = torch.arange(5)[:, None].expand(5, 3)  # row r's token types hold r
    images = RowImages.from_kwargs(
        {"pixel_values": pixels, "num_images": num_images, "token_type_ids": tokens, "image_grid_thw": None}, 5
    )
    shards = images.split(2)
    rows = UnpaddedRows.from_padded(torch.ones(5, 3, dtype=torch.long), torch.ones(5, 3)).split(2)
    assert [s.num_images for s in shards] == [[1, 2, 0], [1, 1]] and [r.num_rows for r in rows] == [3, 2]
    assert shards[0].per_image["pixel_values"].flatten().tolist() == [0, 1, 2]
    assert shards[1].per_image["pixel_values"].flatten().tolist() == [3, 4]
    assert shards[1].per_token["token_type_ids"][:, 0].tolist() == [3, 4]
    assert set(shards[0].model_inputs(torch.device("cpu"))) == {"pixel_values", "token_type_ids"}
    assert [s.num_images for s in images.split(7)][5:] == [[], []]  # more workers than rows


def test_an_image_grid_splits_its_patch_rows_by_image():
    grid = torch.tensor([[1, 2, 2], [1, 2, 4], [1, 4, 4]])  # 4, 8 and 16 patch rows
    patches = torch.arange(28).float()[:, None]
    images = RowImages.from_kwargs({"pixel_values": patches, "image_grid_thw": grid, "num_images": [2, 1]}, 2)
    first, second = images.split(2)
    assert first.patches["pixel_values"].flatten().tolist() == list(range(12))
    assert second.patches["pixel_values"].flatten().tolist() == list(range(12, 28))
    assert first.per_image["image_grid_thw"].tolist() == grid[:2].tolist() and first.patch_rows == [4, 8]


def test_images_the_workers_could_not_pair_with_rows_are_refused_naming_the_fix():
    assert RowImages.from_kwargs({"pixel_values": None, "num_images": None}, 3) is None
    with pytest.raises(ValueError, match=r"come in tiles \(\['num_tiles'\]\). Fix: reference_placement=None"):
        RowImages.from_kwargs({"pixel_values": torch.zeros(4, 3), "num_tiles": [2, 2], "num_images": [1, 1]}, 2)
    with pytest.raises(ValueError, match="holds 3 entries for 2 images.*Fix: reference_placement=None"):
        RowImages.from_kwargs({"pixel_values": torch.zeros(3, 3, 2, 2), "num_images": [1, 1]}, 2)
