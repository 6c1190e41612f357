"""An MoE policy's scoring, packed with its router's load-balancing loss (`scoring/router_loss.py`): log-probs, the
loss TRL adds and the gradients equal to TRL's padded fused forward, whether the call asks for the router's logits
(TRL's loss with `compute_aux_loss`) or the model's config does; packed rows hold filler, and only the real tokens'
logits count."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import install_packed_scoring

from .helpers import padded_scoring_batch

# GPT-OSS (eager attention with sinks) packs inexactly: the engine steps aside for it (tests/test_model_zoo.py)
MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe"]


def _models(path: str, config_asks: bool):
    model = AutoModelForCausalLM.from_pretrained(path, output_router_logits=config_asks).eval()
    if model.config.model_type == "granitemoe":  # TRL's forward reads `num_experts`, which GraniteMoE's config lacks
        model.config.num_experts = model.config.num_local_experts  # (the packed copy below reads num_local_experts)
    add_fused_lm_head(model, outputs=("log_probs",))
    packed_model = copy.deepcopy(model)
    if model.config.model_type == "granitemoe":
        del packed_model.config.num_experts
    # sdpa: rows as wide as the longest sequence, the shorter ones' ends filled (one token of filler here)
    config = install_packed_scoring(packed_model, padding_free=True)
    assert config is not None
    return model, packed_model, config


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("config_asks", [False, True], ids=["the call asks", "the config asks"])
def test_packed_scoring_with_the_router_loss_equals_trls_padded_forward(zoo, family, config_asks):
    model, packed_model, config = _models(zoo(family), config_asks)
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(zoo(family)))
    asked = {} if config_asks else {"output_router_logits": True}
    padded = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True, **asked)
    packed = packed_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True, **asked)
    assert config.stats.calls == 1 and config.stats.fallbacks == 0
    assert config.stats.forwarded_tokens > config.stats.real_tokens, "the packed rows hold filler"
    valid = padded.label_mask
    assert (packed.log_probs - padded.log_probs)[valid].abs().max().item() <= 1e-5
    assert padded.aux_loss is not None and abs(packed.aux_loss.item() - padded.aux_loss.item()) <= 1e-6
    assert abs(packed.loss.item() - padded.loss.item()) <= 1e-6  # TRL adds coef x aux to its loss: so does the engine

    def objective(out):
        return (out.log_probs * valid).sum() + 10.0 * out.aux_loss

    expected = torch.autograd.grad(objective(padded), [p for p in model.parameters()], allow_unused=True)
    got = torch.autograd.grad(objective(packed), [p for p in packed_model.parameters()], allow_unused=True)
    router = [n for n, _ in model.named_parameters() if ("gate" in n or "router" in n) and "proj" not in n]
    assert router, "the router's weights are among the parameters compared"
    for (name, _), g, e in zip(model.named_parameters(), got, expected):
        if e is None:
            assert g is None or g.abs().max().item() == 0.0, name
            continue
        assert (g - e).abs().max().item() <= 1e-5, name


def test_a_call_that_does_not_ask_has_no_router_loss(zoo):
    _, packed_model, config = _models(zoo("qwen3_moe"), config_asks=False)
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(zoo("qwen3_moe")))
    out = packed_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert out.aux_loss is None and config.stats.fallbacks == 0


def test_the_docs_moe_figures_are_the_benchmarks():
    import json

    from .helpers import ROOT

    record = json.loads((ROOT / "benchmarks" / "results" / "moe_cpu.jsonl").read_text().splitlines()[-1])
    page = " ".join((ROOT / "docs" / "packed-scoring.md").read_text().split())
    steps = record["step_s"]
    assert f"a batch of {record['rows']} long-tailed rows ({record['pad_fraction']:.0%} padding)" in page
    assert f"stock TRL {steps['trl']:.2f} s, trl-scale {steps['trl_scale']:.2f} s ({record['speedup']:.2f}x)" in page
    assert record["max_logprob_diff"] <= 1e-5 and record["aux_loss_diff"] <= 1e-6
