"""A tool-calling toy: a chat template TRL's tool loop accepts (prefix-preserving, with a response template so
`parse_response` finds the calls), one tool, and a tiny model taught to call it, for tool-using rollouts without the
Hub (TRL's own templates render a tool schema of hundreds of byte-level tokens; this one names the tools only)."""

from __future__ import annotations

import os

import torch
from datasets import Dataset

from .tokenizer import NUMBER_WORDS, VLM_CONTENT

TOOL_CHAT_TEMPLATE = (
    "{%- if tools -%}<|system|>tools:"
    "{%- for tool in tools %} {{ tool['function']['name'] if tool['function'] is defined else tool['name'] }}"
    "{%- endfor -%}<|end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] -%}<call>{{ call['function'] | tojson }}</call>{%- endfor -%}"
    "<|end|>"
    "{%- else -%}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
# transformers' response template (what `parse_response` reads): calls between <call> and </call>, as JSON.
TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open": "<call>",
            "close_pattern": "</call>\\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": "<\\|end\\|>\\s*", "content": "text"},
    },
}
TOOL_CALL = '<call>{"name": "tick", "arguments": {}}</call>'


def tick() -> str:
    """The next number word."""
    return "five"


def tool_prompts(count: int = 64) -> Dataset:
    """Conversational prompts ("count <number>"), one column `prompt`."""
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"count {NUMBER_WORDS[i % 10]}"}]} for i in range(count)]
    )


def build_tool_calling_model(base_path: str, directory: str, steps: int = 100, seed: int = 0) -> str:
    """The model at `base_path` taught (a short supervised pass) to answer every prompt of `tool_prompts` with a
    call to `tick`; saved with the toy tokenizer carrying `TOOL_CHAT_TEMPLATE` and `TOOL_RESPONSE_TEMPLATE` under
    `directory`, whose path it returns. After 100 steps about 7 in 8 sampled answers (temperature 1) are the call."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_path)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    texts = [
        tokenizer.apply_chat_template(row["prompt"], tools=[tick], add_generation_prompt=True, tokenize=False)
        + TOOL_CALL
        + tokenizer.eos_token
        for row in tool_prompts(10)
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tool_vlm_chat_template(image_placeholder: str) -> str:
    """`TOOL_CHAT_TEMPLATE` for vision-language prompts: a message's content may be a list, whose image items become
    ``image_placeholder`` (the processor expands it into the image's tokens), as `vlm_chat_template` renders them."""
    content = VLM_CONTENT.replace("IMAGE_PLACEHOLDER", image_placeholder)
    plain = "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    return TOOL_CHAT_TEMPLATE.replace(plain, "<|{{ message['role'] }}|>" + content + "<|end|>")


def build_tool_calling_vlm(base_path: str, directory: str, steps: int = 100, seed: int = 0) -> str:
    """The tiny vision-language model at `base_path` (`build_tiny_vlm`) taught (a short supervised pass) to answer
    the visual task's image prompts (`toy.visual.squares_prompts`) with a call to `tick`; saved with its processor
    carrying `tool_vlm_chat_template` and `TOOL_RESPONSE_TEMPLATE` under `directory`, whose path it returns: tool
    conversations whose every turn holds the prompt's image. After 100 steps about 3 in 4 sampled answers (temperature
    1) are the call."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from .training import supervised_steps
    from .visual import squares_prompts

    processor = AutoProcessor.from_pretrained(base_path)
    tokenizer = processor.tokenizer
    processor.chat_template = tokenizer.chat_template = tool_vlm_chat_template(tokenizer.boi_token)
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    model = AutoModelForImageTextToText.from_pretrained(base_path, dtype=torch.float32)
    for name, parameter in model.named_parameters():  # only the language model learns the call
        parameter.requires_grad_("language_model" in name or "lm_head" in name)
    torch.manual_seed(seed)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " count"}]}]
    prompt = processor.apply_chat_template(messages, tools=[tick], add_generation_prompt=True, tokenize=False)
    rows, size = squares_prompts(steps * 8, seed=seed), 8
    answer = len(tokenizer(TOOL_CALL + tokenizer.eos_token, add_special_tokens=False)["input_ids"])

    def batches():
        for step in range(steps):
            images = [[row["image"]] for row in rows.select(range(step * size, (step + 1) * size))]
            text = [prompt + TOOL_CALL + tokenizer.eos_token] * size
            batch = processor(text=text, images=images, return_tensors="pt", padding=True, padding_side="right")
            labels = torch.full_like(batch["input_ids"], -100)
            labels[:, -answer:] = batch["input_ids"][:, -answer:]  # one prompt: every row the same length
            yield batch, labels

    supervised_steps(model, batches(), 3e-3)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory
