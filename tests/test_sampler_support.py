"""Log-probs on the sampler's support (top-k / top-p / min-p): the kept set follows vLLM's rule, checked against a
reference written from vLLM's description with plain Python loops; the kept mass's gradient against autograd; the
scoring engine (packed and padded routes) against log_softmax over the kept tokens; the config's choices. The
comparison with real vLLM's own log-probs is in test_real_vllm.py."""

import math

import pytest
import torch

import trl_scale
from trl_scale.scoring import ScoringSettings, install_packed_scoring
from trl_scale.scoring.sampler_support import SamplerSupport, kept_log_mass, kept_tokens

from .helpers import cpu_args


def reference_kept(row: list[float], support: SamplerSupport, target: int) -> set[int]:
    """vLLM's order in words: min-p on the probabilities, top-k on the logits (ties at the k-th value kept), top-p on
    the probabilities left (a token is dropped when it and every less likely token together hold at most 1 - p;
    the most likely token stays)."""
    vocab = range(len(row))
    kept = set(vocab)
    if support.min_p > 0:
        total = sum(math.exp(z) for z in row)
        best = max(math.exp(z) / total for z in row)
        kept = {j for j in kept if math.exp(row[j]) / total >= support.min_p * best}
    if support.top_k > 0:
        kth = sorted((row[j] for j in kept), reverse=True)[min(support.top_k, len(kept)) - 1]
        kept = {j for j in kept if row[j] >= kth}
    if support.top_p < 1.0:
        total = sum(math.exp(row[j]) for j in kept)
        ascending = sorted(kept, key=lambda j: row[j])
        mass, dropped = 0.0, set()
        for j in ascending[:-1]:
            mass += math.exp(row[j]) / total
            if mass <= 1.0 - support.top_p:
                dropped.add(j)
        kept -= dropped
    return kept | {target}


SUPPORTS = [
    SamplerSupport(top_p=0.8),
    SamplerSupport(top_k=7),
    SamplerSupport(min_p=0.05),
    SamplerSupport(top_k=12, top_p=0.7, min_p=0.02),
]


@pytest.mark.parametrize("support", SUPPORTS, ids=["top_p", "top_k", "min_p", "all"])
def test_the_kept_tokens_follow_vllms_rule(support):
    generator = torch.Generator().manual_seed(0)
    z = torch.randn(16, 40, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(0, 40, (16,), generator=generator)
    keep = kept_tokens(z, support, targets)
    for i in range(16):
        expected = reference_kept(z[i].tolist(), support, int(targets[i]))
        assert set(keep[i].nonzero().flatten().tolist()) == expected, i
    assert keep.sum(1).float().mean() < 40  # something is cut


def test_the_kept_mass_and_its_gradient_match_autograd_on_the_kept_set():
    """log S = logsumexp(kept) - logsumexp(all) under softcap, logit scale and temperature; gradients for hidden,
    weight and bias equal autograd's through the same transform with the kept set held fixed."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(30, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (10,), generator=generator)
    support = SamplerSupport(top_k=10, top_p=0.8)
    mass = kept_log_mass(hidden, weight, bias, targets, support, 0.7, 3, 5.0, 1.3)  # chunks of 3 tokens
    upstream = torch.randn(10, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((mass * upstream).sum(), (hidden, weight, bias))

    z = torch.tanh((hidden @ weight.t() + bias) * 1.3 / 5.0) * 5.0 / 0.7
    keep = kept_tokens(z.detach(), support, targets)
    expected = z.masked_fill(~keep, float("-inf")).logsumexp(1) - z.logsumexp(1)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight, bias))
    assert torch.allclose(mass, expected, atol=1e-12)
    assert (mass < -1e-3).all()  # every position loses mass here
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-10), (got - want).abs().max()


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_the_engine_scores_the_sampled_tokens_on_the_kept_support(tiny_llama, padding_free):
    """Both routes of the engine (packed rows; TRL's padded forward where packing is off) give each labelled token
    log_softmax over the kept tokens of its position, and the whole-vocabulary log-prob without a support."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    support = SamplerSupport(top_k=20, top_p=0.8)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    add_fused_lm_head(model, temperature=0.9)
    settings = ScoringSettings(padding_free=padding_free, temperature=0.9, sampler_support=support)
    assert install_packed_scoring(model, settings) is not None
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(3, 200, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0  # left padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :6] = -100  # a prompt of 6: the completion's 6 tokens are scored
    with torch.no_grad():
        got = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs
        # position ids as the engine's route sets them: restarting per sequence when packed, TRL's own when padded
        positions = (attention_mask.cumsum(1) - 1).clamp(min=0) if padding_free else None
        logits = reference(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions).logits / 0.9
    logits, targets = logits[:, :-1], input_ids[:, 1:]
    scored = labels[:, 1:] != -100
    keep = kept_tokens(logits[scored], support, targets[scored])
    on_support = logits[scored].masked_fill(~keep, float("-inf")).log_softmax(1).gather(1, targets[scored, None])
    whole = logits[scored].log_softmax(1).gather(1, targets[scored, None])
    assert torch.allclose(got[scored], on_support[:, 0], atol=1e-5), (got[scored] - on_support[:, 0]).abs().max()
    assert (on_support - whole).abs().min() > 1e-3  # the support really cuts here


def test_the_config_decides_where_the_support_applies(tmp_path):
    """The run plan reads where the support applies, once (`ScoringPlan.sampler_support`)."""
    from trl_scale.trainers.plan import ScoringPlan

    vllm = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, top_p=0.9, top_k=5, **vllm))
    assert ScoringPlan.from_config(config).sampler_support == SamplerSupport(top_k=5, top_p=0.9)
    # generation_kwargs are sent last, so they win, as in the request
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path, top_p=0.9, generation_kwargs={"top_p": 0.5}, **vllm))
    assert ScoringPlan.from_config(config).sampler_support == SamplerSupport(top_p=0.5)
    for off in (
        dict(top_p=0.9, logprobs_on_sampler_support=False, **vllm),  # TRL's numbers
        dict(top_p=0.9, vllm_importance_sampling_correction=False, **vllm),  # no sampler log-probs compared
        dict(top_p=0.9),  # no vLLM: transformers' own sampling
        dict(**vllm),  # nothing truncated
    ):
        assert ScoringPlan.from_config(trl_scale.GRPOConfig(**cpu_args(tmp_path, **off))).sampler_support is None
    with pytest.raises(ValueError, match=r"\['repetition_penalty'\] changed its logits.*logprobs_on_sampler_support"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path, top_p=0.9, repetition_penalty=1.2, **vllm))
    trl_scale.GRPOConfig(**cpu_args(tmp_path, repetition_penalty=1.2, **vllm))  # no truncation: nothing to refuse


def test_the_preflight_warns_of_the_kept_mass_only_when_the_trainer_scores_the_whole_vocabulary():
    from trl_scale.rollout.preflight import RunNeeds, ServerReport, problems_of

    report = ServerReport("http://s", reachable=True, max_model_len=256, dev_mode=True)
    report.logprobs_mode = "processed_logprobs"
    truncated = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    whole = RunNeeds(importance_sampling=True, sampling=truncated)
    assert any("carries the kept mass" in w and "top_p=0.9" in w for w in problems_of(report, whole)[1])
    on_support = RunNeeds(importance_sampling=True, sampling=truncated, on_sampler_support=True)
    assert not problems_of(report, on_support)[1]
    neutral = RunNeeds(importance_sampling=True, sampling=dict(truncated, top_p=1.0))
    assert not problems_of(report, neutral)[1]
