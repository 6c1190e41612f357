"""GRPO and RLOO on a tiny Qwen2-VL (3-D rope positions, patch grids; issue 62), with its processor built in code
(`toy.qwen2_vl_processor`): trl-scale's trainers take TRL's steps. With trl-scale's features off, bit for bit; with
its defaults (each scoring call with images packed, 3-D positions per sequence, and the chunked head), within 1e-5 of
TRL's losses and weights, every image call packed."""

from __future__ import annotations

import pytest
import trl
from datasets import Dataset
from PIL import Image

import trl_scale
from trl_scale.toy.qwen2_vl_processor import qwen2_vl_processor

from .helpers import assert_logs_close, cpu_args, max_param_diff, step_logs, token_parity_reward


@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    from trl_scale.toy import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


def _image_prompts(count: int) -> Dataset:
    """Prompts with one image each, of several sizes (grids of 2x2 to 6x8 patches: 1 to 12 image tokens) and
    colours, and prompts of several lengths."""
    sizes = [(14, 14), (28, 42), (42, 56), (28, 28)]
    rows = []
    for i in range(count):
        image = Image.new("RGB", sizes[i % 4], (40 * (i % 6), 255 - 30 * (i % 8), 90))
        text = " count" * (1 + i % 3)
        rows.append({"prompt": [{"role": "user", "content": text}], "image": image})
    return Dataset.from_list(rows)


def _run(trainer_cls, config_cls, path, tmp_path, **overrides):
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, beta=0.05, max_steps=2)
    args = config_cls(**cpu_args(tmp_path, **(settings | overrides)))
    trainer = trainer_cls(
        model=path,
        reward_funcs=token_parity_reward,
        args=args,
        train_dataset=_image_prompts(16),
        processing_class=qwen2_vl_processor(path),
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("method", ["grpo", "rloo"])
@pytest.mark.parametrize("features", ["off", "defaults"])
def test_a_tiny_qwen2_vl_trains_as_trl_trains_it(tiny_qwen2_vl, tmp_path, method, features):
    classes = {
        "grpo": ((trl.GRPOTrainer, trl.GRPOConfig), (trl_scale.GRPOTrainer, trl_scale.GRPOConfig)),
        "rloo": ((trl.RLOOTrainer, trl.RLOOConfig), (trl_scale.RLOOTrainer, trl_scale.RLOOConfig)),
    }[method]
    theirs = _run(*classes[0], tiny_qwen2_vl, tmp_path / "trl")
    off = {"padding_free": False} if features == "off" else {}
    ours = _run(*classes[1], tiny_qwen2_vl, tmp_path / "ours", **off)
    keys = ("loss", "grad_norm", "reward", "entropy", "kl")
    expected = step_logs(theirs, keys)
    assert all(e["grad_norm"] > 0 for e in expected)
    tolerance = 0.0 if features == "off" else 1e-5
    assert_logs_close(step_logs(ours, keys), expected, tolerance)
    assert max_param_diff(ours.model, theirs.model) <= tolerance
    key = "padding_free/image_calls_packed"
    packed = [entry[key] for entry in ours.state.log_history if key in entry]
    assert packed == ([] if features == "off" else [1.0, 1.0]), packed
