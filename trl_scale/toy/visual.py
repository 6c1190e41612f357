"""A toy visual task for tiny vision-language models (:func:`.models.build_tiny_vlm`): count the coloured squares.

Each image is 28x28 white with one to three coloured squares in distinct cells of a 4x4 grid; the prompt asks how
many, the answer is a number word. The reward is 1 when a completion's first word is the count. A warm-up
(:func:`warm_up_vlm`) teaches the policy to answer with one of the three words: drawn at random whatever the image
(it then starts at about 1/3, and what it gains past that it can only read from the image), or the count itself
(`right_answers`, a weak start the learning tests train on).
"""

from __future__ import annotations

import random

import torch
from datasets import Dataset

from .tokenizer import NUMBER_WORDS
from .training import supervised_steps

COUNTS = (1, 2, 3)
_CELL = 7  # 28 / 4
_COLOUR = (210, 40, 40)


def squares_image(count: int, rng: random.Random, size: int = 28):
    """A PIL image: `count` coloured squares filling distinct cells of a 4x4 grid, on white."""
    from PIL import Image  # Pillow: not a core dependency (the demo's matplotlib and vision models bring it)

    image = Image.new("RGB", (size, size), (255, 255, 255))
    for cell in rng.sample(range(16), count):
        left, top = (cell % 4) * _CELL, (cell // 4) * _CELL
        for x in range(left, left + _CELL):
            for y in range(top, top + _CELL):
                image.putpixel((x, y), _COLOUR)
    return image


def squares_prompts(num_prompts: int = 256, seed: int = 0) -> Dataset:
    """Conversational prompts with an ``image`` column (TRL turns it into content) and the ``answer`` word."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        count = rng.choice(COUNTS)
        rows.append(
            {
                "prompt": [{"role": "user", "content": " count"}],
                "image": squares_image(count, rng),
                "answer": NUMBER_WORDS[count],
            }
        )
    return Dataset.from_list(rows)


def squares_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 where a completion's first word is its row's answer (TRL reward signature; conversational or text)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        words = text.split()
        rewards.append(1.0 if words and words[0] == expected else 0.0)
    return rewards


def warm_up_vlm(
    model,
    processor,
    steps: int = 40,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 1,
    right_answers: bool = False,
) -> float:
    """A short supervised pass teaching the answer's form: the task's prompts answered with a number word drawn at
    random (`right_answers`: the count), then the end token. Returns the last loss."""
    rng = random.Random(seed)
    dataset = squares_prompts(steps * batch_size, seed=seed + 1000)
    eos = processor.tokenizer.eos_token
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " count"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # every row's

    def batches():
        for step in range(steps):
            rows = dataset.select(range(step * batch_size, (step + 1) * batch_size))
            words = [row["answer"] if right_answers else NUMBER_WORDS[rng.choice(COUNTS)] for row in rows]
            batch = processor(
                text=[prompt + word + eos for word in words], images=[[row["image"]] for row in rows],
                return_tensors="pt", padding=True, padding_side="right",
            )  # fmt: skip
            labels = torch.full_like(batch["input_ids"], -100)
            for row, end in enumerate(batch["attention_mask"].sum(1).tolist()):
                labels[row, end - 2 : end] = batch["input_ids"][row, end - 2 : end]  # the answer word and the end
            yield batch, labels

    return supervised_steps(model, batches(), learning_rate)
