"""Shared prefill: a batch's repeated prompts (a group's G copies) prefilled once, their KV cache copied to each row.

TRL's local generation (`use_vllm=False`) calls `model.generate` on B·G left-padded rows, G copies of each prompt,
and prefills every copy. `shared_prefill_generate` prefills each distinct row once, up to its last column, copies
the cache's rows out to the batch (`Cache.batch_select_indices`), and lets `generate` run the last column and every
new token as before: the same decoding loop, the same sampler draws, so the completions are today's (the first
step's logits agree to float rounding; a test compares them per model family). Where the sharing cannot be exact
(a model without transformers' dynamic cache, a cache implementation, beams, dropout drawing random numbers in the
forward, inputs besides the ids and the mask), `why_not_shared` says why and `generate` runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..scoring.support import draws_random_numbers

# generate's keyword arguments the sharing passes through untouched; any other (images, a cache, an assistant
# model, a streamer, ...) means the rows are not just their ids.
PASSED_THROUGH = frozenset({"generation_config", "pad_token_id", "eos_token_id", "output_scores"})
PASSED_THROUGH |= {"return_dict_in_generate", "output_logits", "logits_processor", "stopping_criteria"}
PASSED_THROUGH |= {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty"}


@dataclass
class PrefillStats:
    """Prompt tokens prefilled by the generation calls since the last log: as every row would (`before`) and with
    each distinct row once (`after`)."""

    calls: int = 0
    shared_calls: int = 0
    tokens_before: int = 0
    tokens_after: int = 0

    def record(self, before: int, after: int) -> None:
        self.calls += 1
        self.shared_calls += int(after < before)
        self.tokens_before += before
        self.tokens_after += after

    def pop(self) -> dict[str, float]:
        """The figures for a training log (none without a generation call), and a fresh count."""
        if not self.calls:
            return {}
        figures = {
            "shared_prefill/fraction_of_calls": self.shared_calls / self.calls,
            "shared_prefill/tokens_before": float(self.tokens_before),
            "shared_prefill/tokens_after": float(self.tokens_after),
            "shared_prefill/share_ratio": self.tokens_before / max(1, self.tokens_after),
        }
        self.__init__()
        return figures


@dataclass(frozen=True)
class SharedRows:
    """The distinct rows of a generation batch: `first[u]` is the batch row that stands for distinct row u, and
    `of_row[i]` the distinct row batch row i repeats."""

    first: torch.Tensor
    of_row: torch.Tensor

    @property
    def distinct(self) -> int:
        return int(self.first.numel())

    @property
    def rows(self) -> int:
        return int(self.of_row.numel())


def shared_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> SharedRows:
    """Rows equal in their ids and their mask, found once (in the order they first appear)."""
    keys = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    inverse = torch.unique(keys, dim=0, return_inverse=True)[1].tolist()
    first_of = {}
    for row, key in enumerate(inverse):
        first_of.setdefault(key, row)
    order = {key: index for index, key in enumerate(first_of)}  # distinct rows in order of first appearance
    first = torch.tensor(list(first_of.values()), device=input_ids.device)
    of_row = torch.tensor([order[key] for key in inverse], device=input_ids.device)
    return SharedRows(first, of_row)


def why_not_shared(model, generation_config, kwargs: dict, training: bool | None = None) -> str | None:
    """Why sharing the prefill would not give today's completions for this call (`generate`'s keyword arguments
    `kwargs`), or None when it does; `training` as for `draws_random_numbers`."""
    extra = sorted(set(kwargs) - PASSED_THROUGH)
    if extra:
        return f"generate was given {extra} besides the ids and the mask"
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if not getattr(model, "_supports_default_dynamic_cache", lambda: False)():
        return f"{type(model).__name__} keeps no transformers dynamic cache"
    stateful = _stateful_cache_layers(model)
    if stateful:
        return f"its cache has recurrent or convolutional layers ({stateful}), whose rows cannot be copied"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "a prompt-learning adapter (it brings its own cache)"
    generation = generation_config or model.generation_config
    if generation.cache_implementation is not None:
        return f"cache_implementation={generation.cache_implementation!r}"
    if generation.use_cache is False:
        return "use_cache=False"
    if max(generation.num_beams or 1, generation.num_return_sequences or 1) > 1:
        return "beam search or num_return_sequences > 1"
    if generation.prefill_chunk_size is not None:
        return "chunked prefill"
    if draws_random_numbers(model, training):
        return "dropout is active in the forward (set disable_dropout=True or the model's attention_dropout to 0)"
    return None


def _stateful_cache_layers(model) -> str:
    """The cache layer kinds of `model` that keep a state besides keys and values (convolutional or recurrent:
    `batch_select_indices` would not copy that state), comma-separated; empty where there are none."""
    from transformers import DynamicCache, cache_utils

    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    layers = DynamicCache(config=model.config.get_text_config(decoder=True)).layers
    kinds = {
        type(layer).__name__
        for layer in layers
        if (linear and isinstance(layer, linear)) or not callable(getattr(layer, "batch_select_indices", None))
    }
    return ", ".join(sorted(kinds))


def prefilled_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The dynamic cache of `input_ids` (every column) as `generate` would build it: positions from the mask, the
    model's own input preparation, one forward."""
    from transformers import DynamicCache

    config = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=config)
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    inputs = model.prepare_inputs_for_generation(
        input_ids,
        past_key_values=cache,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
        is_first_iteration=True,
    )
    model(**inputs, return_dict=True)
    return cache


def shared_prefill_generate(
    generate: Callable,
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    stats: PrefillStats | None = None,
    **kwargs,
):
    """`generate(input_ids=..., attention_mask=..., **kwargs)` with each distinct row's prompt prefilled once (see the
    module's docstring); `generate` itself where nothing repeats or the sharing would not be exact. `stats` counts
    the prompt tokens prefilled."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    stats = stats if stats is not None else PrefillStats()
    before = int(attention_mask.sum())
    if input_ids.shape[1] < 2 or why_not_shared(model, kwargs.get("generation_config"), kwargs) is not None:
        stats.record(before, before)
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    rows = shared_rows(input_ids, attention_mask)
    # each distinct row's columns but the last, then every row's last column (generate runs it per row)
    stats.record(before, int(attention_mask[rows.first, :-1].sum() + attention_mask[:, -1].sum()))
    if rows.distinct == rows.rows:
        return generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    # The cache stops one column short: generate needs a column of its own to run (and samples from its logits).
    cache = prefilled_cache(model, input_ids[rows.first, :-1], attention_mask[rows.first, :-1])
    cache.batch_select_indices(rows.of_row)
    return generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)
