"""The counting task with its answer run as code: the completion's number words become a Python program
(`answer = [5, 6, 7, 8]`) and each row's tests check `answer[i]` against the count, so the reward comes from the
sandboxed verifier (`trl_scale.rewards.CodeExecutionReward`, locally or behind `trl-scale reward-server`) and equals
the counting reward exactly: the fraction of the first four words that continue the count."""

from __future__ import annotations

from datasets import Dataset

from .tasks import COUNT_TARGET_LENGTH, counting_prompts, expected_continuation
from .tokenizer import NUMBER_WORDS


def number_words_as_code(completion) -> str:
    """The program a completion stands for: its words as digits (`None` for a word that is not a number)."""
    if isinstance(completion, list):  # conversational
        completion = completion[-1]["content"] if completion else ""
    digits = [NUMBER_WORDS.index(w) if w in NUMBER_WORDS else None for w in completion.split()]
    return f"answer = {digits!r}\n"


def counting_code_prompts(num_prompts: int = 256, seed: int = 0) -> Dataset:
    """`counting_prompts` with a `tests` column: `answer[i]` must be the i-th number after the prompt."""
    dataset = counting_prompts(num_prompts, seed)
    tests = [
        [{"call": f"answer[{i}]", "expected": NUMBER_WORDS.index(word)} for i, word in enumerate(expected)]
        for expected in (expected_continuation(p, COUNT_TARGET_LENGTH) for p in dataset["prompt"])
    ]
    return dataset.add_column("tests", tests)
