"""The features' state in checkpoints (`trainers/feature_state.py`): one file per rank keyed by feature name, each
feature checking its own dict; a checkpoint written before that file existed (tests/data/legacy_checkpoint, made by
trl-scale 1581e27) still resumes."""

import shutil

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts
from trl_scale.trainers.dynamic_sampling import DynamicSampling
from trl_scale.trainers.feature_state import load_feature_states, save_feature_states, state_path

from .helpers import ROOT, cpu_args

LEGACY = ROOT / "tests" / "data" / "legacy_checkpoint"


def flat_reward(completion_ids, **kwargs):
    return [0.5] * len(completion_ids)


def _trainer(model_path, out):
    """The run that wrote the legacy files (see their make.py), not trained."""
    settings = dict(num_generations=4, max_completion_length=8, steps_per_generation=2, max_steps=1)
    config = trl_scale.GRPOConfig(
        **cpu_args(out, **settings), dynamic_sampling=True, dynamic_sampling_max_oversampling=2.0
    )
    return trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=flat_reward,
        args=config,
        train_dataset=counting_prompts(64, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_checkpoint_of_the_earlier_format_still_resumes_each_feature(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path / "run")
    load_feature_states(trainer.features, trainer, str(LEGACY))
    saved = torch.load(LEGACY / "rollout_buffer_rank0.pt", weights_only=False)
    assert trainer._step == saved["step"] and _same(trainer._buffered_inputs, saved["inputs"])
    assert trainer.features.get(DynamicSampling).drawn_at_resume == 4
    # saved again, it is the one file, keyed by feature name, with the same states
    path = save_feature_states(trainer.features, trainer, str(tmp_path / "again"))
    assert path == state_path(str(tmp_path / "again"), 0)
    states = torch.load(path, weights_only=False)["features"]
    assert set(states) == {"rollout_resume"}  # no top-up drawn since: nothing of dynamic sampling's to keep
    assert _same(states["rollout_resume"], {"step": saved["step"], "inputs": saved["inputs"]})


def test_the_one_file_round_trips_and_a_legacy_checkpoint_of_other_processes_is_refused(tiny_llama, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path / "run")
    load_feature_states(trainer.features, trainer, str(LEGACY))
    trainer.features.get(DynamicSampling).top_up_rows(trainer, 8)  # two more top-up groups drawn (after 4)
    path = save_feature_states(trainer.features, trainer, str(tmp_path / "new"))
    resumed = _trainer(tiny_llama, tmp_path / "resumed")
    load_feature_states(resumed.features, resumed, str(tmp_path / "new"))
    assert _same(resumed._buffered_inputs, trainer._buffered_inputs)
    assert resumed.features.get(DynamicSampling).drawn_at_resume == 4 + 2
    # as if two processes had saved: refused on one, naming the files
    shutil.copy(path, state_path(str(tmp_path / "new"), 1))
    with pytest.raises(ValueError, match=r"by 2 process\(es\).*trl_scale_state_rankN.pt.*this run has 1"):
        load_feature_states(resumed.features, resumed, str(tmp_path / "new"))
    legacy = tmp_path / "legacy"
    shutil.copytree(LEGACY, legacy, ignore=shutil.ignore_patterns("*.py"))
    shutil.copy(legacy / "rollout_buffer_rank0.pt", legacy / "rollout_buffer_rank1.pt")
    with pytest.raises(ValueError, match=r"by 2 process\(es\).*rollout_buffer_rankN.pt.*this run has 1"):
        load_feature_states(resumed.features, resumed, str(legacy))
