"""The tiny-model toolkit: offline builds that reload through the real `from_pretrained` code."""

import json
import os

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_scale.toy import (
    NUMBER_WORDS,
    TOY_WORDS,
    build_tiny_model,
    build_tokenizer,
    counting_prompts,
    counting_reward,
    expected_continuation,
    preference_pairs,
)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tokenizer_round_trips_through_auto_tokenizer(tmp_path, family):
    path = build_tiny_model(tmp_path, family=family)
    built = build_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(path)
    text = " ".join(TOY_WORDS)
    ids = reloaded(text, add_special_tokens=False)["input_ids"]
    assert ids == built(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(TOY_WORDS)  # one token per word, none lost (Qwen2's trap encoded them wrongly)
    assert reloaded.decode(ids) == text
    assert reloaded.eos_token == "<|end|>" and reloaded.pad_token == "<|pad|>"
    conversation = [{"role": "user", "content": "three four"}]
    assert reloaded.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) == (
        "<|user|>three four<|end|><|assistant|>"
    )
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == family


def test_qwen2_reloads_as_its_own_tokenizer_class(tiny_qwen2):
    # transformers picks Qwen2Tokenizer from the model type; our builder must survive exactly that class.
    assert type(AutoTokenizer.from_pretrained(tiny_qwen2)).__name__ == "Qwen2Tokenizer"


def test_causal_lm_and_reward_model_load(tiny_model_path, tiny_reward_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    reward = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model)
    assert reward.config.num_labels == 1 and reward.config.pad_token_id == tokenizer.pad_token_id


def test_tokenizer_rejects_words_the_split_regex_would_break():
    with pytest.raises(ValueError, match="letters only"):
        build_tokenizer(["w5", "cat"])


def test_counting_reward_scores_positions():
    assert expected_continuation("seven eight") == ["nine", "zero", "one", "two"]
    rewards = counting_reward(["seven eight", "nine", "one"], [" nine zero one two", " zero x one", ""])
    assert rewards == [1.0, 0.25, 0.0]
    conversational = counting_reward(
        [[{"role": "user", "content": "one"}]], [[{"role": "assistant", "content": "two"}]]
    )
    assert conversational == [0.25]


def test_datasets_are_seeded_and_well_formed():
    assert list(counting_prompts(8, seed=3)["prompt"]) == list(counting_prompts(8, seed=3)["prompt"])
    for prompt in counting_prompts(32)["prompt"]:
        assert all(w in NUMBER_WORDS for w in prompt.split())
    pairs = preference_pairs(4)
    assert all(c.startswith(" ") and r.startswith(" ") for c, r in zip(pairs["chosen"], pairs["rejected"]))
