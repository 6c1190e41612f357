"""Toy tasks with verifiable rewards, and preference pairs, all generated offline and seeded.

The counting task: a prompt is a run of consecutive number words ("three four five"); the right completion
continues the count modulo ten (" six seven eight nine"). The reward is the fraction of the first
``COUNT_TARGET_LENGTH`` completion words that are right, position by position, so a random model of the
toy vocabulary scores about 1/10 after a warm-up that only teaches it to speak in number words.
"""

from __future__ import annotations

import random

from datasets import Dataset

from .tokenizer import FILLER_WORDS, NUMBER_WORDS

COUNT_TARGET_LENGTH = 4


def _count_from(start: int, length: int) -> list[str]:
    return [NUMBER_WORDS[(start + i) % 10] for i in range(length)]


def counting_prompts(num_prompts: int = 256, seed: int = 0, min_len: int = 1, max_len: int = 3) -> Dataset:
    """Prompt-only dataset (column ``prompt``) for the counting task."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        rows.append({"prompt": " ".join(_count_from(rng.randrange(10), rng.randint(min_len, max_len)))})
    return Dataset.from_list(rows)


def expected_continuation(prompt: str, length: int = COUNT_TARGET_LENGTH) -> list[str]:
    """The next ``length`` number words after the last word of ``prompt``."""
    last = prompt.split()[-1]
    return _count_from(NUMBER_WORDS.index(last) + 1, length)


def counting_reward(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Fraction of the first words of each completion that continue the count (TRL reward signature)."""
    rewards = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
            completion = completion[-1]["content"]
        if isinstance(prompt, list):
            prompt = prompt[-1]["content"]
        target = expected_continuation(prompt)
        words = completion.split()[: len(target)]
        rewards.append(sum(w == t for w, t in zip(words, target)) / len(target))
    return rewards


def number_word_corpus(num_texts: int = 512, seed: int = 0, length: int = 8, count_prob: float = 0.3) -> list[str]:
    """Noisy warm-up text: runs of number words where each next word continues the count with probability
    ``count_prob`` and is random otherwise. A short supervised pass on it gives a weak counter that RL sharpens,
    as supervised fine-tuning on imperfect data does before RLHF."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        index = rng.randrange(10)
        words = [NUMBER_WORDS[index]]
        for _ in range(length - 1):
            index = (index + 1) % 10 if rng.random() < count_prob else rng.randrange(10)
            words.append(NUMBER_WORDS[index])
        texts.append(" ".join(words))
    return texts


def preference_pairs(num_pairs: int = 64, seed: int = 0) -> Dataset:
    """Preference dataset (``prompt``, ``chosen``, ``rejected``): the chosen completion continues the count,
    the rejected one is random filler. Completions start with a space so that ``prompt + chosen`` tokenizes
    as the prompt followed by the completion."""
    rng = random.Random(seed)
    rows = []
    prompts = counting_prompts(num_pairs, seed=seed)["prompt"]
    for prompt in prompts:
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + " ".join(expected_continuation(prompt)),
                "rejected": " " + " ".join(rng.choice(FILLER_WORDS) for _ in range(COUNT_TARGET_LENGTH)),
            }
        )
    return Dataset.from_list(rows)
