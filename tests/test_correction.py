"""The importance-sampling ratios before TRL clips them (huggingface/trl#5231): logged beside TRL's clipped ones."""

import math

import torch

from trl_scale.rollout.correction import raw_ratio_statistics


def test_raw_ratios_and_the_share_clipped_per_token():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    sampling = torch.log(torch.tensor([[0.5, 0.05, 0.25], [0.5, float("nan"), 0.9]]))  # ratios 1, 10, 2 | 1, -, .56
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token is padding
    stats = raw_ratio_statistics(old, sampling, mask, "token_truncate", None, 3.0)
    assert math.isclose(stats["max"].item(), 10.0, rel_tol=1e-5)  # what TRL's clipped metric shows as 3
    assert math.isclose(stats["min"].item(), 1.0, rel_tol=1e-6)  # the NaN token counts as 1, padding not at all
    assert math.isclose(stats["mean"].item(), (1 + 10 + 2 + 1 + 1) / 5, rel_tol=1e-5)
    assert math.isclose(stats["clipped"].item(), 1 / 5, rel_tol=1e-6)
    stats = raw_ratio_statistics(old, sampling, mask, "token_mask", 0.9, 3.0)
    assert math.isclose(stats["clipped"].item(), 1 / 5, rel_tol=1e-6)


def test_raw_ratios_per_sequence():
    old = torch.zeros(2, 2)
    sampling = torch.tensor([[-1.0, -1.0], [0.5, 0.0]])
    stats = raw_ratio_statistics(old, sampling, torch.ones(2, 2), "sequence_truncate", None, 2.0)
    assert math.isclose(stats["max"].item(), math.exp(2.0), rel_tol=1e-6)
    assert math.isclose(stats["min"].item(), math.exp(-0.5), rel_tol=1e-6)
    assert math.isclose(stats["clipped"].item(), 0.5)
    assert raw_ratio_statistics(old, sampling, torch.zeros(2, 2), "token_truncate", None, 2.0) is None  # no token
