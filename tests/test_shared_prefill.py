"""Shared prefill (issue 61, item 5): local generation prefills each repeated prompt once and copies its KV cache to
the group's rows; the completions are those of plain `generate` for the same seed, greedy and sampled, per family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import trl_scale
from trl_scale.generation import PrefillStats, shared_prefill_generate, shared_rows, why_not_shared
from trl_scale.generation import prefill as prefill_module

FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gpt2", "mistral", "gemma3", "gemma2"]


def _groups(vocab: int, prompts: int = 3, group: int = 4, width: int = 24, seed: int = 0):
    """`prompts` prompts of random lengths (longer than the zoo's sliding windows of 8), each repeated `group`
    times, left-padded to `width`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, width + 1, (prompts,), generator=generator).tolist()
    ids = torch.zeros(prompts * group, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p, length in enumerate(lengths):
        tokens = torch.randint(3, vocab, (length,), generator=generator)
        ids[p * group : (p + 1) * group, width - length :] = tokens
        mask[p * group : (p + 1) * group, width - length :] = 1
    return ids, mask


def _generated(model, ids, mask, sample: bool, shared: bool, stats=None):
    config = GenerationConfig(
        max_new_tokens=12, do_sample=sample, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None
    )
    torch.manual_seed(1)
    with torch.no_grad():
        if shared:
            return shared_prefill_generate(
                model.generate, model, ids, mask, stats=stats, generation_config=config,
                output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        return model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_completions_are_plain_generates(zoo, family, sample):
    """Each prompt prefilled once: the same tokens as plain generate (greedy, and sampled from the same seed), the
    step scores within 1e-5, and the prompt tokens prefilled cut to one group's share."""
    model = AutoModelForCausalLM.from_pretrained(zoo(family)).eval()
    ids, mask = _groups(model.config.vocab_size)
    stats = PrefillStats()
    plain = _generated(model, ids, mask, sample, shared=False)
    shared = _generated(model, ids, mask, sample, shared=True, stats=stats)
    assert torch.equal(plain.sequences, shared.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(plain.scores, shared.scores)) <= 1e-5
    figures = stats.pop()
    # three prompts of four rows: each prefilled once, up to its last column (which every row runs itself)
    distinct = int(mask[::4, :-1].sum()) + ids.shape[0]
    assert figures["shared_prefill/tokens_before"] == mask.sum() and figures["shared_prefill/tokens_after"] == distinct


def test_a_cache_copied_to_the_wrong_rows_is_caught(zoo, monkeypatch):
    """The test above is red when a row gets another prompt's cache (the copy is what makes the rows right)."""
    model = AutoModelForCausalLM.from_pretrained(zoo("llama")).eval()
    ids, mask = _groups(model.config.vocab_size)
    plain = _generated(model, ids, mask, False, shared=False)
    right = prefill_module.shared_rows

    def rolled(*args):
        rows = right(*args)
        return prefill_module.SharedRows(rows.first, rows.of_row.roll(4))

    monkeypatch.setattr(prefill_module, "shared_rows", rolled)
    assert not torch.equal(plain.sequences, _generated(model, ids, mask, False, shared=True).sequences)


def test_distinct_rows_in_order_of_first_appearance():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [1, 2, 3], [7, 7, 7]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    mask_only_differs = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    rows = shared_rows(ids, mask)
    assert rows.first.tolist() == [0, 1, 4] and rows.of_row.tolist() == [0, 1, 0, 1, 2]
    assert shared_rows(ids, mask_only_differs).distinct == 4  # same ids, another mask: another row


def test_where_the_sharing_is_not_exact_generate_runs_as_it_was(zoo):
    """Dropout drawing in the forward, a cache implementation, beams, inputs besides the ids, a recurrent or
    convolutional model: plain generate, with the reason named."""
    gpt2 = AutoModelForCausalLM.from_pretrained(zoo("gpt2")).train()  # the zoo's GPT-2 has dropout 0.1
    plain = GenerationConfig(max_new_tokens=2)
    assert "dropout" in why_not_shared(gpt2, plain, {})
    assert why_not_shared(gpt2.eval(), plain, {}) is None
    assert "dropout" in why_not_shared(gpt2, plain, {}, training=True)
    llama = AutoModelForCausalLM.from_pretrained(zoo("llama"))
    assert "static" in why_not_shared(llama, GenerationConfig(cache_implementation="static"), {})
    assert "beam" in why_not_shared(llama, GenerationConfig(num_beams=2), {})
    assert "pixel_values" in why_not_shared(llama, plain, {"pixel_values": None})
    for family in ("lfm2", "nemotron_h"):  # convolutional / recurrent states, which a row copy would leave behind
        hybrid = AutoModelForCausalLM.from_pretrained(zoo(family))
        assert "recurrent or convolutional" in why_not_shared(hybrid, plain, {}), family

    stats = PrefillStats()
    ids, mask = _groups(gpt2.config.vocab_size)
    gpt2.train()
    _generated(gpt2, ids, mask, True, shared=True, stats=stats)
    figures = stats.pop()
    assert figures["shared_prefill/fraction_of_calls"] == 0.0
    assert figures["shared_prefill/tokens_after"] == figures["shared_prefill/tokens_before"]


def _grpo(model_path: str, out, **overrides):
    from transformers import AutoTokenizer

    from trl_scale.toy import counting_prompts

    from .helpers import cpu_args, token_parity_reward

    config = dict(max_steps=1, max_completion_length=6, num_generations=4) | overrides
    return trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(**cpu_args(out, **config)),
        train_dataset=counting_prompts(16, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


def test_tree_packing_true_refuses_a_policy_whose_prefill_cannot_be_shared(zoo, tmp_path, caplog):
    """tree_packing=True where local generation cannot share the prompt (dropout drawing in the forward): an error
    at construction naming the fix. "auto" trains as TRL does (no shared prefill, no tree rows: dropout would drop a
    shared token out alike for every row) and says why."""
    with pytest.raises(ValueError, match="disable_dropout=True"):
        _grpo(zoo("gpt2"), tmp_path / "true", tree_packing=True)
    with caplog.at_level("WARNING"):
        trainer = _grpo(zoo("gpt2"), tmp_path / "auto", tree_packing="auto", max_steps=1)
        trainer.train()
    assert "prefills every row's prompt (dropout" in caplog.text and "tree packing steps aside" in caplog.text
    assert not any("shared_prefill/share_ratio" in e for e in trainer.state.log_history)
    assert all(e.get("tree_packing/fraction_of_calls", 0.0) == 0.0 for e in trainer.state.log_history)
    shared = _grpo(zoo("gpt2"), tmp_path / "no_dropout", tree_packing=True, disable_dropout=True)
    assert "shared_prefill" in shared.features.names()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_trl_scale_serve_prefills_a_prompt_once_for_its_n_choices(zoo, temperature, monkeypatch):
    """`trl-scale serve` answers n choices per prompt from one prefill: the tokens and log-probs of generating the
    n copies one prefill each, for the same seed."""
    from fastapi.testclient import TestClient

    from trl_scale.serve import completions, create_app

    app = create_app(zoo("qwen3"))
    body = {"prompt": [[5, 6, 7, 8, 9, 10], [11, 12]], "n": 4, "max_tokens": 6, "temperature": temperature}
    body |= {"logprobs": 0, "seed": 3, "return_tokens_as_token_ids": True}
    stats = PrefillStats()
    shared = completions.shared_prefill_generate

    def counted(generate, model, input_ids, *args, **kwargs):
        return shared(generate, model, input_ids, *args, stats=stats, **kwargs)

    with TestClient(app) as client:
        monkeypatch.setattr(completions, "shared_prefill_generate", counted)
        got = client.post("/v1/completions", json=body).json()["choices"]
        monkeypatch.setattr(completions, "shared_prefill_generate", lambda generate, model, ids, mask, **kw: generate(
            input_ids=ids, attention_mask=mask, **kw
        ))  # fmt: skip
        plain = client.post("/v1/completions", json=body).json()["choices"]
    assert stats.shared_calls == 1 and stats.tokens_after == 6 + 2 - 2 + 8  # two prompts once, each row's last column
    assert [c["token_ids"] for c in got] == [c["token_ids"] for c in plain]
    for a, b in zip(got, plain):
        assert (
            max(abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])) <= 1e-5
        )
