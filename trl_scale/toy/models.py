"""Tiny causal LMs and reward models built from configs and saved to disk, so that ``from_pretrained(path)``
runs the real loading code with no Hub access."""

from __future__ import annotations

import os
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

from .tokenizer import build_tokenizer

ModelFamily = Literal["llama", "qwen2"]
ModelKind = Literal["causal-lm", "reward"]


def tiny_config(
    family: ModelFamily = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    **overrides,
) -> PretrainedConfig:
    """A small config of the given family (untied embeddings, fp32, sdpa attention)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        **overrides,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"family={family!r} is not supported; use 'llama' or 'qwen2'")


def build_tiny_model(
    output_dir: str | os.PathLike,
    family: ModelFamily = "llama",
    kind: ModelKind = "causal-lm",
    words: list[str] | None = None,
    seed: int = 0,
    **config_kwargs,
) -> str:
    """Create a tiny random model of ``family`` and the toy tokenizer, save both to ``output_dir``.

    ``kind="reward"`` builds a sequence-classification model with one label (a reward or value model).
    Returns the directory, ready for ``AutoModelFor*.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    output_dir = os.fspath(output_dir)
    tokenizer = build_tokenizer(words)
    config = tiny_config(
        family,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    if kind == "causal-lm":
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.bos_token_id = None
    elif kind == "reward":
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        raise ValueError(f"kind={kind!r} is not supported; use 'causal-lm' or 'reward'")
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    check_tokenizer_round_trip(output_dir, tokenizer)
    return output_dir


def check_tokenizer_round_trip(path: str, tokenizer=None, text: str | None = None) -> None:
    """Fail loudly if the tokenizer saved at ``path`` does not reload as the one that was saved."""
    tokenizer = tokenizer or build_tokenizer()
    text = text or "three four five the cat"
    reloaded = AutoTokenizer.from_pretrained(path)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    got = reloaded(text, add_special_tokens=False)["input_ids"]
    if got != expected or reloaded.decode(got) != text:
        raise RuntimeError(
            f"tokenizer saved at {path} reloads as {type(reloaded).__name__} and encodes {text!r} as {got}, "
            f"not {expected}"
        )
