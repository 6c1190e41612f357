"""Tiny offline models, tokenizers, toy tasks and the CPU demo."""

from .models import build_tiny_model, build_tiny_qwen2_vl, build_tiny_vlm, check_tokenizer_round_trip, tiny_config
from .tokenizer import CHAT_TEMPLATE, NUMBER_WORDS, TOY_WORDS, build_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "NUMBER_WORDS",
    "TOY_WORDS",
    "build_tiny_model",
    "build_tiny_qwen2_vl",
    "build_tiny_vlm",
    "build_tokenizer",
    "check_tokenizer_round_trip",
    "tiny_config",
]
from .code_task import counting_code_prompts, number_words_as_code  # noqa: E402
from .tasks import (  # noqa: E402
    COUNT_TARGET_LENGTH,
    counting_prompts,
    counting_reward,
    expected_continuation,
    number_word_corpus,
    preference_pairs,
)
from .visual import squares_prompts, squares_reward, warm_up_vlm  # noqa: E402

__all__ += [
    "COUNT_TARGET_LENGTH",
    "counting_code_prompts",
    "number_words_as_code",
    "counting_prompts",
    "counting_reward",
    "expected_continuation",
    "number_word_corpus",
    "preference_pairs",
    "squares_prompts",
    "squares_reward",
    "warm_up_vlm",
]
