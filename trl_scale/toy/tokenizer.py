"""A tokenizer made in code, with a chat template, that round-trips through ``AutoTokenizer`` offline.

transformers 5 picks the tokenizer class from the model type: a Qwen2 checkpoint always reloads as
``Qwen2Tokenizer``, which rebuilds its own pipeline (Qwen's split regex + byte-level BPE) from the saved
vocab and merges and ignores the rest of ``tokenizer.json``. A WordLevel tokenizer saved beside a Qwen2
config therefore reloads as a different tokenizer that encodes every text wrongly. We build the one
tokenizer that survives both paths: a byte-level BPE with exactly Qwen2's pipeline, trained in code on the
toy vocabulary so that every toy word (with or without a leading space) is a single token.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen2Tokenizer's split pattern (transformers/models/qwen2/tokenization_qwen2.py).
_QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
FILLER_WORDS = (
    "the a cat dog sun moon tree river stone bird fish red blue green small big fast slow happy sad "
    "runs sees eats likes and or not yes no good bad count next after before please answer word"
).split()
TOY_WORDS = NUMBER_WORDS + FILLER_WORDS

# `{% generation %}` marks assistant tokens for TRL's assistant-only losses.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- else -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def vlm_chat_template(image_placeholder: str) -> str:
    """The toy chat template for vision-language prompts (TRL turns an image column into content lists): an image
    item becomes ``image_placeholder``, which the processor expands into the image's tokens."""
    return _VLM_CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", image_placeholder)


# A message's content, a string or a content list whose image items become IMAGE_PLACEHOLDER (shared with the
# tool-calling vision-language template, `toy.tools.tool_vlm_chat_template`).
VLM_CONTENT = (
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}IMAGE_PLACEHOLDER"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
)
_VLM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}<|assistant|>{%- else -%}<|{{ message['role'] }}|>{%- endif -%}"
    + VLM_CONTENT
    + "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_tokenizer(
    words: list[str] | None = None, model_special_tokens: dict[str, str] | None = None
) -> PreTrainedTokenizerFast:
    """Build the toy tokenizer: every word of ``words`` (default: the toy vocabulary) is one token.

    Words must be letters only, so that Qwen2's split regex keeps each one whole. ``model_special_tokens`` adds
    named special tokens a processor reads as attributes (e.g. Gemma 3's ``{"image_token": "<image_soft_token>"}``).
    """
    words = list(words) if words is not None else list(TOY_WORDS)
    bad = [w for w in words if not w.isalpha()]
    if bad:
        raise ValueError(f"toy words must be letters only (Qwen2's split regex breaks others): {bad[:5]}")

    tokenizer = Tokenizer(
        models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Every word appears with and without a leading space; a generous vocab size lets BPE merge each whole.
    corpus = [" ".join(words)] * 4 + [w for w in words] + [f" {w}" for w in words]
    trainer = trainers.BpeTrainer(
        vocab_size=100_000,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS + list((model_special_tokens or {}).values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        truncation_side="left",
        **({"extra_special_tokens": dict(model_special_tokens)} if model_special_tokens else {}),
    )
    for word in words:
        for text in (word, f" {word}"):
            if len(hf_tokenizer(text, add_special_tokens=False)["input_ids"]) != 1:
                raise RuntimeError(f"toy tokenizer split {text!r} into several tokens")
    return hf_tokenizer
