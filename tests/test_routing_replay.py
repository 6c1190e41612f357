"""Routing replay (`scoring/routing_replay.py`) on transformers' MoE blocks, and the routes `trl-scale serve` returns
in vLLM's format (`serve/routed_experts.py`): replaying a model's own routes changes nothing (log-probs and every
gradient, the router's included), in TRL's padded forward and in the packed engine; replaying another sampler's
routes moves each token to those experts (agreement below 1 counted); the routes are found by the sequence's tokens,
and two rows' routes swapped, or the routes shifted by one token, give other log-probs (the red checks)."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import install_packed_scoring
from trl_scale.scoring.routing_replay import RouteBook, RouteReplay
from trl_scale.serve.routed_experts import decode_routes, routed_experts

from .helpers import padded_scoring_batch, start_servers

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _model(path: str, packed: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    if packed:
        assert install_packed_scoring(model, padding_free=True) is not None
    return model


def _sequences(input_ids, mask) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(input_ids, mask)]


def _book_of(sampler, sequences, shift: int = 0, swap: bool = False) -> RouteBook:
    """The sampler's routes of each sequence (as `trl-scale serve` reads them), in a book; `shift` moves each one
    token later, `swap` gives rows 0 and 2 each other's."""
    routes = [decode_routes(text) for text in routed_experts(sampler, sequences, 0)]
    if swap:
        a, b = routes[0], routes[2]
        n = min(len(a), len(b))
        routes[0], routes[2] = np.concatenate([b[:n], a[n:]]), np.concatenate([a[:n], b[n:]])
    if shift:
        routes = [np.concatenate([r[:shift], r[:-shift]]) for r in routes]
    book = RouteBook()
    for sequence, known in zip(sequences, routes):
        book.add(sequence, known)
    return book


def _scored(model, input_ids, mask, labels):
    return model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replaying_a_models_own_routes_changes_no_log_prob_or_gradient(zoo, family, packed):
    path = zoo(family)
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    model, replayed = _model(path), _model(path, packed)
    replay = RouteReplay(replayed, _book_of(model, _sequences(input_ids, mask)))
    own, got = _scored(model, input_ids, mask, labels), _scored(replayed, input_ids, mask, labels)
    valid = own.label_mask
    assert (got.log_probs - own.log_probs)[valid].abs().max().item() <= 1e-5
    assert replay.agreement.share == 1.0 and replay.agreement.compared > 0
    expected = torch.autograd.grad((own.log_probs * valid).sum(), list(model.parameters()), allow_unused=True)
    grads = torch.autograd.grad((got.log_probs * valid).sum(), list(replayed.parameters()), allow_unused=True)
    routers = 0
    for (name, _), g, e in zip(model.named_parameters(), grads, expected):
        if e is None:
            assert g is None or g.abs().max().item() == 0.0, name
            continue
        routers += name.endswith("mlp.gate.weight")
        assert (g - e).abs().max().item() <= 1e-5, name
    assert routers == model.config.num_hidden_layers  # the routers keep their gradient under replay


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_another_samplers_routes_are_taken_and_misplaced_ones_are_not_the_same(zoo, packed):
    """A sampler whose routers differ (a perturbed copy: a bf16 server's near-ties, exaggerated) routes some tokens
    elsewhere: replayed, the trainer's forward takes its experts (agreement below 1, other log-probs than its own
    routing); the same routes swapped between two rows, or one token late, give other log-probs again."""
    path = zoo("qwen3_moe")
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    sequences = _sequences(input_ids, mask)
    sampler = _model(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.add_(0.5 * torch.randn_like(parameter) * parameter.std())
    model = _model(path, packed)
    own = _scored(model, input_ids, mask, labels).log_probs
    replay = RouteReplay(model, _book_of(sampler, sequences))
    replayed = _scored(model, input_ids, mask, labels)
    valid = replayed.label_mask
    assert 0.0 < replay.agreement.share < 1.0, replay.agreement
    assert (replayed.log_probs - own)[valid].abs().max().item() > 1e-4
    # the padded reference of the same replay: packed or padded, the same experts for the same tokens
    reference_model = _model(path)
    reference = RouteReplay(reference_model, _book_of(sampler, sequences))
    expected = _scored(reference_model, input_ids, mask, labels).log_probs
    assert (replayed.log_probs - expected)[valid].abs().max().item() <= 1e-5
    reference.remove()
    for misplaced in (dict(swap=True), dict(shift=1)):
        replay.remove()
        replay = RouteReplay(model, _book_of(sampler, sequences, **misplaced))
        wrong = _scored(model, input_ids, mask, labels).log_probs
        assert (wrong - replayed.log_probs)[valid].abs().max().item() > 1e-4, misplaced


def test_a_sequence_the_book_does_not_know_keeps_its_own_routes(zoo):
    path = zoo("qwen3_moe")
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    model = _model(path)
    own = _scored(model, input_ids, mask, labels).log_probs
    replay = RouteReplay(model, RouteBook())
    assert torch.equal(_scored(model, input_ids, mask, labels).log_probs, own) and replay.agreement.compared == 0
    with pytest.raises(ValueError, match=r"routing_replay=True: LlamaForCausalLM has no MoE router"):
        RouteReplay(_model(zoo("llama")), RouteBook())
    with pytest.raises(ValueError, match=r"routes of shape \(3, 2, 2\) for a sequence of 5 tokens"):
        RouteBook().add([1, 2, 3, 4, 5], np.zeros((3, 2, 2), dtype=np.uint8))


@pytest.fixture(scope="module")
def moe_servers(zoo):
    path = zoo("qwen3_moe")
    servers = start_servers(path, 2, ("--enable-return-routed-experts",), ())
    yield path, servers
    for server in servers:
        server.stop()


def test_serve_returns_routes_in_vllms_format(moe_servers):
    """`--enable-return-routed-experts`: each choice's `routed_experts` decodes as vLLM documents it, `[prompt +
    completion - 1 - start, layers, top_k]` uint8, equal to the model's own router top-k over the sequence;
    `routed_experts_prompt_start` drops the prompt's first tokens; without the flag no routes come."""
    path, (with_routes, without) = moe_servers
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    config = model.config
    prompt = [5, 9, 14, 3, 8]
    body = {"prompt": [prompt], "n": 2, "max_tokens": 6, "logprobs": 0, "seed": 0, "return_token_ids": True}
    choices = requests.post(f"{with_routes.url}/v1/completions", json=body, timeout=60).json()["choices"]
    for choice in choices:
        sequence = prompt + choice["token_ids"]
        routes = decode_routes(choice["routed_experts"])
        assert routes.dtype == np.uint8
        assert routes.shape == (len(sequence) - 1, config.num_hidden_layers, config.num_experts_per_tok)
        with torch.no_grad():
            layers = model(input_ids=torch.tensor([sequence[:-1]]), output_router_logits=True).router_logits
        for layer, logits in enumerate(layers):
            own = logits.topk(config.num_experts_per_tok, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(torch.from_numpy(np.sort(routes[:, layer].astype(np.int64), axis=-1)), own)
    late = requests.post(
        f"{with_routes.url}/v1/completions", json={**body, "routed_experts_prompt_start": 3}, timeout=60
    ).json()["choices"]
    assert late[0]["token_ids"] == choices[0]["token_ids"]  # the same seed, the same answer
    assert np.array_equal(decode_routes(late[0]["routed_experts"]), decode_routes(choices[0]["routed_experts"])[3:])
    refused = requests.post(
        f"{with_routes.url}/v1/completions", json={**body, "routed_experts_prompt_start": 6}, timeout=60
    )
    assert refused.status_code == 400 and "routed_experts_prompt_start must be between 0 and 5" in refused.text
    plain = requests.post(f"{without.url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert all("routed_experts" not in choice for choice in plain)
    info = requests.get(f"{with_routes.url}/server_info?config_format=json", timeout=30).json()["vllm_config"]
    assert info["aux_output_config"] == {"enable_return_routed_experts": True}


def test_serve_refuses_the_flag_on_a_model_without_a_router(zoo):
    from trl_scale.serve.app import create_app

    with pytest.raises(ValueError, match=r"--enable-return-routed-experts: LlamaConfig is not a mixture-of-experts"):
        create_app(zoo("llama"), return_routed_experts=True)
