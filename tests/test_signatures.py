"""Drop-in means every constructor call TRL 1.16 accepts is accepted: the same signatures, positional arguments in
TRL's order, and optional reward functions when an environment owns the reward."""

import inspect
import os

import pytest
import trl
from transformers import AutoTokenizer
from trl.chat_template_utils import qwen3_template

import trl_scale
from trl_scale.toy import counting_prompts, preference_pairs
from trl_scale.trainers.packing import PackedScoring

from .helpers import cpu_args, paired, step_logs, token_parity_reward

PAIRS = [
    (trl_scale.GRPOTrainer, trl.GRPOTrainer),
    (trl_scale.RLOOTrainer, trl.RLOOTrainer),
    (trl_scale.DPOTrainer, trl.DPOTrainer),
]


@pytest.mark.parametrize("ours, theirs", PAIRS, ids=lambda c: c.__name__)
def test_trainer_signatures_equal_trls(ours, theirs):
    assert inspect.signature(ours.__init__) == inspect.signature(theirs.__init__)
    assert inspect.signature(ours) == inspect.signature(theirs)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (trl_scale.GRPOConfig, trl.GRPOConfig),
        (trl_scale.RLOOConfig, trl.RLOOConfig),
        (trl_scale.DPOConfig, trl.DPOConfig),
    ],
    ids=lambda c: c.__name__,
)
def test_configs_keep_every_trl_field_and_default(ours, theirs):
    ours_fields = {f.name: f for f in ours.__dataclass_fields__.values()}
    for name, field in theirs.__dataclass_fields__.items():
        assert name in ours_fields, name
        if name == "padding_free":  # DPO's own flag is trl-scale's packing switch (TRL 1.16 disables its own)
            continue
        assert ours_fields[name].default == field.default, name


def test_online_trainers_take_trls_positional_order(tiny_llama, tmp_path):
    dataset = counting_prompts(16, seed=0)
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, max_completion_length=4))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    # model, reward_funcs, args, train_dataset, eval_dataset, processing_class: TRL's order.
    trainer = trl_scale.GRPOTrainer(tiny_llama, token_parity_reward, config, dataset, None, tokenizer)
    assert trainer.train_dataset is dataset and trainer.processing_class is tokenizer
    assert trainer.reward_func_names == ["token_parity_reward"]
    rloo = trl_scale.RLOOTrainer(
        tiny_llama, [token_parity_reward], trl_scale.RLOOConfig(**cpu_args(tmp_path, num_generations=4)), dataset
    )
    assert rloo.train_dataset is dataset
    with pytest.raises(TypeError):
        trl_scale.GRPOTrainer(tiny_llama, token_parity_reward, config, dataset, not_a_trl_argument=1)


# A chat template that renders tool calls and tool results, as TRL requires of environments.
TOOL_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{%- for call in m.get('tool_calls', []) -%}{{ call['function']['name'] }}"
    "{{ call['function']['arguments'] | tojson }}{%- endfor -%}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


class CountingEnvironment:
    """An environment that owns the reward (`get_reward`): TRL then makes `reward_funcs` optional."""

    def reset(self, **kwargs):
        self.calls = 0

    def increment(self, value: int) -> str:
        """Add one to a number.

        Args:
            value: the number.
        """
        self.calls += 1
        return str(value + 1)

    def get_reward(self) -> float:
        return float(self.calls)


@pytest.mark.parametrize("package", [trl, trl_scale], ids=["trl", "trl_scale"])
def test_environment_without_reward_funcs_is_accepted(package, tiny_llama, tmp_path):
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = qwen3_template  # any parser will do: nothing is generated here
    dataset = counting_prompts(8, seed=0).map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    trainer = package.GRPOTrainer(
        model=tiny_llama,
        args=package.GRPOConfig(**cpu_args(tmp_path, num_generations=4, max_completion_length=4)),
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=CountingEnvironment,
    )
    assert trainer.reward_func_names == ["CountingEnvironment"]


def _assert_trains_with_trls_numbers(make_trainer, keys: tuple[str, ...], abs: float = 1e-7) -> None:
    """Trains `make_trainer(package)` with TRL, then with trl-scale: equal step logs, and trl-scale packed (no shape
    passes on a silent fallback to the padded path)."""
    runs = {}
    for package in (trl, trl_scale):
        trainer = make_trainer(package)
        trainer.train()
        runs[package.__name__] = step_logs(trainer, keys)
    assert trainer.features.get(PackedScoring).stats is not None, (
        "trl-scale fell back to the padded path: the shape went untested"
    )
    for theirs, ours in paired(runs["trl"], runs["trl_scale"]):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=abs)


class PromptingEnvironment(CountingEnvironment):
    """An environment that owns the data: `reset` returns the prompt built from the row's `start` column."""

    def reset(self, start: int, **kwargs):
        self.calls = 0
        return f"count from {start}"


def test_environment_dataset_without_prompt_column_trains_as_in_trl(tiny_llama, tmp_path):
    """TRL 1.16 accepts an environment dataset with no `prompt` column (`reset()` supplies the prompt): trl-scale
    trains on it with TRL's numbers."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    dataset = counting_prompts(8, seed=0).map(lambda row, i: {"start": i}, with_indices=True).remove_columns("prompt")

    def make_trainer(package):
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        tokenizer.chat_template = TOOL_TEMPLATE
        tokenizer.response_template = qwen3_template
        return package.GRPOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            args=package.GRPOConfig(
                **cpu_args(tmp_path / package.__name__, num_generations=4, max_completion_length=4, max_steps=2)
            ),
            train_dataset=dataset,
            processing_class=tokenizer,
            environment_factory=PromptingEnvironment,
        )

    _assert_trains_with_trls_numbers(make_trainer, ("loss", "grad_norm", "reward"))


@pytest.mark.parametrize("method", ["GRPO", "RLOO", "DPO"])
def test_config_docstrings_keep_trls_fields_and_add_trl_scales(method):
    """help(GRPOConfig) documents TRL's fields as TRL does, then trl-scale's."""
    ours, theirs = getattr(trl_scale, f"{method}Config").__doc__, getattr(trl, f"{method}Config").__doc__
    assert theirs.strip() in ours
    assert "padding_free (`bool` or `None`" in ours and ours.index("padding_free (`bool`") > ours.index(theirs.strip())


class FixedPromptEnvironment(CountingEnvironment):
    """Owns the data outright: TRL trains it with no train_dataset (placeholder rows; max_steps sets the length)."""

    def reset(self, **kwargs):
        self.calls = 0
        return "count from three"


def _conversational(dataset):
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})


@pytest.mark.parametrize(
    "shape", ["standard", "conversational", "iterable", "no-dataset-environment", "extra-columns"]
)
def test_every_dataset_shape_trl_accepts_trains_with_trls_numbers(shape, tiny_llama, tmp_path):
    """The dataset shapes TRL 1.16's GRPOTrainer accepts, each trained 2 steps by TRL and by trl-scale."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    base = counting_prompts(16, seed=0)
    extra = {}
    if shape == "conversational":
        data = _conversational(base)
    elif shape == "iterable":
        data = base.to_iterable_dataset()
    elif shape == "no-dataset-environment":
        data, extra = None, {"environment_factory": FixedPromptEnvironment}
    elif shape == "extra-columns":  # TRL passes other columns to the reward functions
        data = base.map(lambda row, i: {"answer": i % 2, "source": "toy"}, with_indices=True)
    else:
        data = base

    def make_trainer(package):
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        if extra:
            tokenizer.chat_template, tokenizer.response_template = TOOL_TEMPLATE, qwen3_template
        return package.GRPOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            args=package.GRPOConfig(
                **cpu_args(tmp_path / package.__name__, num_generations=4, max_completion_length=4, max_steps=2)
            ),
            train_dataset=data,
            processing_class=tokenizer,
            **extra,
        )

    _assert_trains_with_trls_numbers(make_trainer, ("loss", "grad_norm", "reward"))


@pytest.mark.parametrize("shape", ["standard", "conversational", "iterable", "extra-columns"])
def test_every_dataset_shape_trl_accepts_trains_rloo_with_trls_numbers(shape, tiny_llama, tmp_path):
    """The prompt dataset shapes TRL 1.16's RLOOTrainer accepts (it has no environments), 2 steps each."""
    data = {
        "standard": counting_prompts(16, seed=0),
        "conversational": _conversational(counting_prompts(16, seed=0)),
        "iterable": counting_prompts(16, seed=0).to_iterable_dataset(),
        "extra-columns": counting_prompts(16, seed=0).map(lambda row: {"answer": 1, "source": "toy"}),
    }[shape]

    def make_trainer(package):
        return package.RLOOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            args=package.RLOOConfig(
                **cpu_args(tmp_path / package.__name__, num_generations=4, max_completion_length=4, max_steps=2)
            ),
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        )

    _assert_trains_with_trls_numbers(make_trainer, ("loss", "grad_norm", "reward"))


def _preference_shape(shape: str):
    """TRL's preference dataset types: explicit prompt or prompt implicit in chosen/rejected, as text or messages."""
    pairs = preference_pairs(16, seed=0)
    if shape in ("conversational", "implicit-conversational"):
        pairs = pairs.map(
            lambda row: {
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
                "rejected": [{"role": "assistant", "content": row["rejected"].strip()}],
            }
        )
    if shape.startswith("implicit"):  # TRL extracts the shared prefix as the prompt
        pairs = pairs.map(
            lambda row: {"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]},
            remove_columns=["prompt"],
        )
    if shape == "iterable":
        pairs = pairs.to_iterable_dataset()
    if shape == "extra-columns":
        pairs = pairs.map(lambda row: {"source": "toy", "score_gap": 1.0})
    return pairs


@pytest.mark.parametrize(
    "shape", ["standard", "conversational", "implicit", "implicit-conversational", "iterable", "extra-columns"]
)
def test_every_preference_shape_trl_accepts_trains_dpo_with_trls_numbers(shape, tiny_llama, tmp_path):
    """The preference dataset shapes TRL 1.16's DPOTrainer accepts, 2 steps each (trl-scale's packing on)."""
    data = _preference_shape(shape)

    def make_trainer(package):
        return package.DPOTrainer(
            model=tiny_llama,
            args=package.DPOConfig(**cpu_args(tmp_path / package.__name__, max_length=64, max_steps=2)),
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        )

    _assert_trains_with_trls_numbers(make_trainer, ("loss", "grad_norm", "rewards/margins"), abs=1e-6)


def _environment_trainer(tiny_llama, tmp_path, environment):
    """trl-scale's GRPOTrainer with `environment` as its environment_factory (conversational prompts, a chat template
    with tools), built but not trained."""
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = qwen3_template
    dataset = counting_prompts(8, seed=0).map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    return trl_scale.GRPOTrainer(
        model=tiny_llama,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, max_completion_length=4)),
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=environment,
    )


class InfiniteRewardEnvironment(CountingEnvironment):
    def get_reward(self) -> float:
        return float("inf")


class TextRewardEnvironment(CountingEnvironment):
    def get_reward(self):
        return "1.0"


@pytest.mark.parametrize(
    "environment, message",
    [
        (InfiniteRewardEnvironment, r"'InfiniteRewardEnvironment.get_reward' returned inf for completion 0"),
        (TextRewardEnvironment, r"'TextRewardEnvironment.get_reward' returned '1.0' \(str\)"),
    ],
)
def test_an_environments_get_reward_is_checked_as_reward_functions_are(environment, message, tiny_llama, tmp_path):
    """TRL adds `get_reward` as a reward function inside its constructor, after trl-scale checked the user's: an
    infinite reward trained (logged inf, the group's advantages zeroed), a string failed deep in TRL."""
    trainer = _environment_trainer(tiny_llama, tmp_path, environment)
    instance = environment()
    instance.reset()
    with pytest.raises(ValueError, match=message):
        trainer.reward_funcs[0](prompts=["p"], completions=["c"], environments=[instance])


class DictResetEnvironment(CountingEnvironment):
    def reset(self, **kwargs):
        super().reset(**kwargs)
        return {"prompt": "count"}


def test_an_environments_reset_returning_a_dict_is_named(tiny_llama, tmp_path):
    """TRL appends what reset() returns to the last message: a dict failed deep in TRL (`content + observation`).
    Every instance TRL makes is checked (the probe it pooled, and each one made later); the tools are unchanged."""
    trainer = _environment_trainer(tiny_llama, tmp_path, DictResetEnvironment)
    instances = [*trainer._environment_pool[None], trainer.environment_factories[None]()]
    for instance in instances:
        with pytest.raises(TypeError, match=r"DictResetEnvironment.reset\(\) returned dict .*Fix: return the"):
            instance.reset(prompt="p")
    assert [tool.__name__ for tool in trainer._env_tools[None]] == ["increment"]


def test_tools_with_plain_text_prompts_are_refused_naming_the_fix(tiny_llama, tmp_path):
    """TRL offers tools through the chat template: plain-text prompts failed at step 1 inside TRL ('str' object has
    no attribute 'get')."""
    from trl_scale.toy.tools import tick

    with pytest.raises(ValueError, match=r"tools= needs conversational prompts .*Fix: dataset.map"):
        trl_scale.GRPOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, max_completion_length=4)),
            train_dataset=counting_prompts(8, seed=0),
            tools=[tick],
        )
