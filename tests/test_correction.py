"""The importance-sampling ratios before TRL clips them (huggingface/trl#5231): logged beside TRL's clipped ones."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_scale.rollout.correction import raw_ratio_statistics
from trl_scale.trainers.trl_facade import TrlFacade


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


@pytest.mark.parametrize("mode, low_weight", [("sequence_mask", 0.0), ("sequence_truncate", 0.5)])
def test_rloo_sequence_correction_honours_clip_min(mode, low_weight):
    """RLOO's per-sequence weights through the trainer's own method: a ratio below
    `vllm_importance_sampling_clip_min` is masked or raised to it, as one above `clip_max` is; within, the ratio."""

    from trl_scale.rollout.record import RECORD_KEY, GeneratedBatch
    from trl_scale.trainers.correction import importance_weights

    from .helpers import rloo_correction_view

    # three sequences of two tokens; the sampler's log-probs sum to 0, so each ratio is exp(old_logps)
    ratios = [0.3, 1.2, 5.0]
    batch = {
        "completion_ids": torch.ones(3, 2, dtype=torch.long),
        "completion_mask": torch.ones(3, 2),
        "old_logps": torch.tensor([math.log(r) for r in ratios]),
        RECORD_KEY: GeneratedBatch(((0, 0),) * 3, ([0.0, 0.0],) * 3),  # the batch's record, as the rollout hands it
    }
    backend = SimpleNamespace()
    trainer = rloo_correction_view(backend, clip_min=0.5, clip_max=3.0, mode=mode)
    weights = importance_weights(TrlFacade(trainer), batch)
    high_weight = 0.0 if mode == "sequence_mask" else 3.0
    assert torch.allclose(weights, torch.tensor([low_weight, 1.2, high_weight]), atol=1e-6)
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/clipped_fraction"] == [pytest.approx(2 / 3)]
