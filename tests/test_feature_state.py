"""The features' state in checkpoints (`trainers/feature_state.py`): one file per rank keyed by feature name, each
feature checking its own dict; a checkpoint in the format written before that file existed (trl-scale 1581e27: each
feature its own file) is refused, naming it and the fix."""

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
def saved(tiny_llama, tmp_path_factory):
    """A checkpoint's feature states, saved inside a rollout window after one step (a rollout buffer and top-ups
    drawn), with the trainer that saved them."""
    folder = tmp_path_factory.mktemp("checkpoint")
    trainer = _trainer(tiny_llama, folder / "run")
    trainer.train()
    save_feature_states(trainer.features, trainer.run, str(folder))
    return folder, trainer


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_one_file_round_trips_and_a_checkpoint_of_other_processes_is_refused(tiny_llama, saved, tmp_path):
    folder, trainer = saved
    drawn = trainer.features.get(DynamicSampling).top_up.drawn
    states = torch.load(state_path(str(folder), 0), weights_only=False)["features"]
    window = {"steps_per_generation": 2, "num_iterations": 1}  # recorded: a resume with another is refused
    assert _same(
        states["rollout_resume"], {"step": trainer._step, "inputs": trainer._buffered_inputs, "window": window}
    )
    assert drawn > 0 and states["dynamic_sampling"] == {"drawn": drawn}
    resumed = _trainer(tiny_llama, tmp_path / "resumed")
    load_feature_states(resumed.features, resumed.run, str(folder))
    assert resumed._step == trainer._step and _same(resumed._buffered_inputs, trainer._buffered_inputs)
    assert resumed.features.get(DynamicSampling).drawn_at_resume == drawn
    # as if two processes had saved: refused on one, naming the files
    two = tmp_path / "two"
    shutil.copytree(folder, two, ignore=shutil.ignore_patterns("run"))
    shutil.copy(state_path(str(two), 0), state_path(str(two), 1))
    with pytest.raises(ValueError, match=r"by 2 process\(es\).*trl_scale_state_rankN.pt.*this run has 1"):
        load_feature_states(resumed.features, resumed.run, str(two))


@pytest.mark.parametrize(
    "earlier", ["rollout_buffer_rank0.pt", "rollout_stream_rank0.pt", "dynamic_sampling_rank0.json"]
)
def test_a_checkpoint_of_the_earlier_format_is_refused_naming_it(tiny_llama, tmp_path, earlier):
    """What trl-scale 1581e27 saved (each feature its own file, for one day) is not read: resumed without it, the
    run would silently drop its rollout; it is named with the fix instead."""
    trainer = _trainer(tiny_llama, tmp_path / "run")
    (tmp_path / earlier).write_bytes(b"")
    with pytest.raises(ValueError, match=rf"\({earlier}, .*trl-scale 1581e27.*Fix: resume with trl-scale 1581e27"):
        load_feature_states(trainer.features, trainer.run, str(tmp_path))
    (tmp_path / earlier).unlink()
    load_feature_states(trainer.features, trainer.run, str(tmp_path))  # no state at all: nothing to restore


class _Recorded:
    """A feature that records the state it is given back."""

    name = "recorded"

    def __init__(self):
        self.given = None

    def load_state_dict(self, trainer, state, path):
        self.given = (state, path)


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
