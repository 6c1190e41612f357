"""A tool-calling toy: a chat template TRL's tool loop accepts (prefix-preserving, with a response template so
`parse_response` finds the calls), one tool, and a tiny model taught to call it, for tool-using rollouts without the
Hub (TRL's own templates render a tool schema of hundreds of byte-level tokens; this one names the tools only)."""

from __future__ import annotations

import os

import torch
from datasets import Dataset

from .tokenizer import NUMBER_WORDS

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
