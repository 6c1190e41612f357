"""The trainers' features on TRL's hooks: the chain runs them in the listed order (outermost first), the adapter is
the only place TRL's private hooks are overridden (PPO's algorithm hooks apart), and the order is pinned where it
matters."""

import time

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.trainers.adapter import TRL_METHODS, FeatureHooks, OnlineHooks, PreferenceHooks
from trl_scale.trainers.dynamic_sampling import DynamicSampling
from trl_scale.trainers.feature import AROUND_HOOKS, Feature, FeatureChain
from trl_scale.trainers.online import ONLINE_FEATURES
from trl_scale.trainers.timing import PhaseTiming

from .helpers import cpu_args
from .test_dynamic_sampling import _dataset, flat_or_varied

# ---- the chain ---------------------------------------------------------------------------------------------------


class Recording(Feature):
    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def rewards(self, trainer, proceed, value):
        self.seen.append(f"{self.name} in")
        result = proceed(value + [self.name])
        self.seen.append(f"{self.name} out")
        return result

    def setup(self, trainer):
        self.seen.append(f"{self.name} setup")


class NoRewards(Feature):
    name = "no_rewards"


def test_the_chain_runs_outermost_first_skips_features_without_the_hook_and_ends_in_trl():
    seen = []
    outer, inner = Recording("outer", seen), Recording("inner", seen)
    chain = FeatureChain([outer, NoRewards(), inner])
    assert chain.names("rewards") == ["outer", "inner"] and chain.names() == ["outer", "no_rewards", "inner"]
    assert chain.around("rewards", None, lambda value: value + ["trl"], []) == ["outer", "inner", "trl"]
    assert seen == ["outer in", "inner in", "inner out", "outer out"]
    seen.clear()
    assert chain.below(outer, "rewards", None, lambda value: value + ["trl"])([]) == ["inner", "trl"]
    assert chain.below(inner, "rewards", None, lambda value: value + ["trl"])([]) == ["trl"]
    chain.event("setup", None)
    assert seen == ["inner in", "inner out", "outer setup", "inner setup"]
    no_rewards = chain.features[1]  # a feature without the hook: what runs under it is what runs after it
    assert chain.below(no_rewards, "rewards", None, lambda value: value + ["trl"])([]) == ["inner", "trl"]
    with pytest.raises(ValueError, match="listed twice"):
        FeatureChain([outer, Recording("outer", seen)])


def test_every_around_hook_has_its_trl_method_and_its_adapter_override():
    assert set(TRL_METHODS) == set(AROUND_HOOKS)
    for hook, method in TRL_METHODS.items():
        owners = [cls for cls in (FeatureHooks, OnlineHooks, PreferenceHooks) if method in vars(cls)]
        assert len(owners) == 1, f"{method} ({hook}) is overridden by {owners}: once, in one adapter"


# PPO's own algorithm (values, GAE, the critic's update and state) stays on its class.
PPO_ALGORITHM_HOOKS = {
    "_calculate_rewards",
    "_generate_and_score_completions",
    "_compute_loss",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
}


@pytest.mark.parametrize("name", ["GRPOTrainer", "RLOOTrainer", "DPOTrainer", "PPOTrainer"])
def test_only_the_adapter_overrides_trls_private_hooks(name):
    trainer_class = getattr(trl_scale, name)
    trl_class = next(c for c in trainer_class.__mro__ if c.__module__.startswith("trl."))
    adapters = {FeatureHooks, OnlineHooks, PreferenceHooks}
    for cls in trainer_class.__mro__:
        if not cls.__module__.startswith("trl_scale.") or cls in adapters:
            continue
        allowed = PPO_ALGORITHM_HOOKS if cls is trl_scale.PPOTrainer else set()
        private = {
            attribute
            for attribute in vars(cls)
            if attribute.startswith("_")
            and not attribute.startswith("__")
            and callable(getattr(trl_class, attribute, None))
        }
        assert private <= allowed, f"{cls.__qualname__} overrides TRL's {sorted(private - allowed)}: use a feature"


def test_the_features_of_each_trainer_in_their_order():
    online = [
        "ratio_metrics",
        "context_length",
        "empty_rewards_warning",
        "tool_images",
        "text_policy_tool_answers",
        "evaluation",
        "safe_checkpoint",
        "rollout_resume",
        "model_card",
        "mismatch_gate",
        "server_rollout",
        "routing_replay",
        "packed_scoring",
        "decoder_layers",
        "shared_prefill",
        "router_logits_in_generation",
        "dynamic_sampling",
        "phase_timing",
        "stream_rewards",
        "remote_reference",
    ]
    assert [kind.name for kind in trl_scale.GRPOTrainer.FEATURES] == online
    assert [kind.name for kind in trl_scale.PPOTrainer.FEATURES] == online
    assert [kind.name for kind in trl_scale.RLOOTrainer.FEATURES] == ["sequence_correction", *online]
    assert [kind.name for kind in trl_scale.DPOTrainer.FEATURES] == [
        "safe_checkpoint",
        "model_card",
        "packed_scoring",
        "decoder_layers",
    ]


# ---- where the order matters -------------------------------------------------------------------------------------

SLEEP = 0.03


def _timed_dynamic_sampling(model_path, out, features) -> tuple[float, int]:
    """A GRPO run with dynamic sampling (every group flat: each step tops up to its budget) and a reward function
    that takes SLEEP seconds a call: the reward phase's seconds and the calls."""
    calls = []

    def slow_reward(completion_ids, flat, **kwargs):
        calls.append(1)
        time.sleep(SLEEP)
        return flat_or_varied(completion_ids, flat)

    class Trainer(trl_scale.GRPOTrainer):
        FEATURES = features

    config = trl_scale.GRPOConfig(
        **cpu_args(out, num_generations=4, max_completion_length=8, max_steps=2, logging_steps=100),
        dynamic_sampling=True,
        dynamic_sampling_max_oversampling=2.0,
    )
    trainer = Trainer(
        model=model_path,
        reward_funcs=slow_reward,
        args=config,
        train_dataset=_dataset(flat_every=1),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    return trainer.features.get(PhaseTiming).seconds["reward"], len(calls)


def test_phase_timing_inside_dynamic_sampling_times_the_rounds_not_the_served_answers(tiny_llama, tmp_path):
    """Each round's rewards are computed under dynamic sampling, and TRL's own call is answered from the chosen
    rows. Timing inside it measures the rounds (every reward call); outside it, only the instant answers."""
    seconds, calls = _timed_dynamic_sampling(tiny_llama, tmp_path / "listed", ONLINE_FEATURES)
    assert calls >= 4  # 2 steps, each its own round and a top-up
    assert seconds >= calls * SLEEP
    swapped = list(ONLINE_FEATURES)
    i, j = swapped.index(DynamicSampling), swapped.index(PhaseTiming)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    seconds, calls = _timed_dynamic_sampling(tiny_llama, tmp_path / "swapped", tuple(swapped))
    assert seconds < SLEEP, "with timing outside dynamic sampling the rounds' reward calls would be timed"


def test_a_trainer_built_without_the_constructor_runs_trls_methods():
    """TRL's own tests build a trainer with `object.__new__` and set TRL's attributes by hand: with no feature chain,
    each hook is TRL's method (the adapter failed with AttributeError: no attribute 'features'). Here TRL's
    `_generate` with a rollout_func missing keys gives TRL's own error."""
    from types import SimpleNamespace

    trainer = object.__new__(trl_scale.GRPOTrainer)
    trainer.model = SimpleNamespace(training=True)
    trainer.accelerator = SimpleNamespace(device=torch.device("cpu"))
    trainer.use_vllm = False
    trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\]"):
        trainer._generate(["a prompt"])
