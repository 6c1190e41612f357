"""The features' state in checkpoints (`trainers/feature_state.py`): one file per rank keyed by feature name, each
feature checking its own dict; a checkpoint in the format written before that file existed (trl-scale 1581e27: each
feature its own file) still resumes."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts
from trl_scale.trainers.dynamic_sampling import DynamicSampling
from trl_scale.trainers.feature_state import load_feature_states, save_feature_states, state_path
from trl_scale.trainers.trl_facade import TrlFacade

from .helpers import cpu_args


def flat_reward(completion_ids, **kwargs):
    return [0.5] * len(completion_ids)


def _trainer(model_path, out):
    """A GRPO run with dynamic sampling (every group flat, so top-ups are drawn) and a rollout spanning 2 optimizer
    steps."""
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


@pytest.fixture(scope="module")
def legacy(tiny_llama, tmp_path_factory):
    """A checkpoint folder holding what 1581e27 saved inside a rollout window, in its format: the rollout buffer as
    `torch.save({"step", "inputs"})` in `rollout_buffer_rank0.pt` (its `RolloutResume.save_state`) and the top-ups
    drawn as `{"drawn": n}` in `dynamic_sampling_rank0.json` (its `DynamicSampling.save_state`), from one step."""
    folder = tmp_path_factory.mktemp("legacy-checkpoint")
    trainer = _trainer(tiny_llama, folder / "run")
    trainer.train()
    torch.save({"step": trainer._step, "inputs": trainer._buffered_inputs}, folder / "rollout_buffer_rank0.pt")
    drawn = trainer.features.get(DynamicSampling).top_up.drawn
    (folder / "dynamic_sampling_rank0.json").write_text(json.dumps({"drawn": drawn}))
    return folder


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_checkpoint_of_the_earlier_format_still_resumes_each_feature(tiny_llama, legacy, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path / "run")
    load_feature_states(trainer.features, trainer.run, str(legacy))
    saved = torch.load(legacy / "rollout_buffer_rank0.pt", weights_only=False)
    drawn = json.loads((legacy / "dynamic_sampling_rank0.json").read_text())["drawn"]
    assert trainer._step == saved["step"] and _same(trainer._buffered_inputs, saved["inputs"])
    assert drawn > 0 and trainer.features.get(DynamicSampling).drawn_at_resume == drawn
    # saved again, it is the one file, keyed by feature name, with the same states
    path = save_feature_states(trainer.features, trainer.run, str(tmp_path / "again"))
    assert path == state_path(str(tmp_path / "again"), 0)
    states = torch.load(path, weights_only=False)["features"]
    assert set(states) == {"rollout_resume"}  # no top-up drawn since: nothing of dynamic sampling's to keep
    window = {"steps_per_generation": 2, "num_iterations": 1}  # recorded now: a resume with another is refused
    assert _same(states["rollout_resume"], {"step": saved["step"], "inputs": saved["inputs"], "window": window})


def test_the_one_file_round_trips_and_a_legacy_checkpoint_of_other_processes_is_refused(tiny_llama, legacy, tmp_path):
    trainer = _trainer(tiny_llama, tmp_path / "run")
    load_feature_states(trainer.features, trainer.run, str(legacy))
    drawn = json.loads((legacy / "dynamic_sampling_rank0.json").read_text())["drawn"]
    trainer.features.get(DynamicSampling).top_up_rows(trainer.run.trl, 8)  # two more top-up groups drawn
    path = save_feature_states(trainer.features, trainer.run, str(tmp_path / "new"))
    resumed = _trainer(tiny_llama, tmp_path / "resumed")
    load_feature_states(resumed.features, resumed.run, str(tmp_path / "new"))
    assert _same(resumed._buffered_inputs, trainer._buffered_inputs)
    assert resumed.features.get(DynamicSampling).drawn_at_resume == drawn + 2
    # as if two processes had saved: refused on one, naming the files
    shutil.copy(path, state_path(str(tmp_path / "new"), 1))
    with pytest.raises(ValueError, match=r"by 2 process\(es\).*trl_scale_state_rankN.pt.*this run has 1"):
        load_feature_states(resumed.features, resumed.run, str(tmp_path / "new"))
    two = tmp_path / "legacy"
    shutil.copytree(legacy, two, ignore=shutil.ignore_patterns("run"))
    shutil.copy(two / "rollout_buffer_rank0.pt", two / "rollout_buffer_rank1.pt")
    with pytest.raises(ValueError, match=r"by 2 process\(es\).*rollout_buffer_rankN.pt.*this run has 1"):
        load_feature_states(resumed.features, resumed.run, str(two))


class _Recorded:
    """A feature that records the state it is given back."""

    name = "recorded"

    def __init__(self):
        self.given = None

    def load_state_dict(self, trainer, state, path):
        self.given = (state, path)

    def load_legacy_state(self, trainer, checkpoint):
        raise AssertionError("a checkpoint with state files is read from them")


def _rank(index: int):

    return SimpleNamespace(trl=TrlFacade(SimpleNamespace(accelerator=SimpleNamespace(process_index=index))))


def test_each_rank_reads_its_own_state_file(tmp_path):
    """Two ranks saved different states: rank 1 gets rank 1's (a data-parallel resume inside a rollout window holds
    each rank's own buffer), never rank 0's."""
    from trl_scale.trainers.feature import FeatureChain

    for rank in (0, 1):
        torch.save({"format": 1, "features": {"recorded": {"rank": rank}}}, state_path(str(tmp_path), rank))
    for rank in (0, 1):
        feature = _Recorded()
        load_feature_states(FeatureChain((feature,)), _rank(rank), str(tmp_path))
        assert feature.given == ({"rank": rank}, state_path(str(tmp_path), rank))


@pytest.mark.parametrize("damage", ["half-written", "empty", "not ours"])
def test_a_damaged_state_file_is_named_with_the_fix(tmp_path, damage):
    from trl_scale.trainers.feature import FeatureChain

    path = state_path(str(tmp_path), 0)
    torch.save({"format": 1, "features": {"recorded": {"big": torch.arange(10_000)}}}, path)
    data = open(path, "rb").read()
    content = {"half-written": data[: len(data) // 2], "empty": b"", "not ours": None}[damage]
    if content is None:
        torch.save([1, 2, 3], path)
    else:
        open(path, "wb").write(content)
    match = "is not a trl-scale state file" if damage == "not ours" else "cannot be read .*Fix: resume from an earlier"
    with pytest.raises(ValueError, match=rf"trl_scale_state_rank0\.pt {match}"):
        load_feature_states(FeatureChain((_Recorded(),)), _rank(0), str(tmp_path))
