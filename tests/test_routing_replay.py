"""Routing replay (`scoring/routing_replay.py`) on transformers' MoE blocks, and the routes `trl-scale serve` returns
in vLLM's format (`serve/routed_experts.py`): replaying a model's own routes changes nothing (log-probs and every
gradient, the router's included), in TRL's padded forward and in the packed engine; replaying another sampler's
routes moves each token to those experts (agreement below 1 counted); the routes are found by the sequence's tokens,
and two rows' routes swapped, or the routes shifted by one token, give other log-probs (the red checks)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import install_packed_scoring
from trl_scale.scoring.routing_replay import RouteBook, RouteReplay, decode_routes, routers_of
from trl_scale.serve.routed_experts import routed_experts
from trl_scale.trainers.routing_replay import RoutingReplay

from .helpers import padded_scoring_batch, server_grpo, start_servers

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "deepseek_v3"]


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


def _perturbed_sampler(path: str):
    """The model with its routers' weights moved (a sampler that routes some tokens elsewhere: a bf16 server's
    near-ties, exaggerated)."""
    sampler = _model(path)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                parameter.add_(0.5 * torch.randn_like(parameter) * parameter.std())
    return sampler


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
    router_weights = {f"{name}.weight" for name, module in model.named_modules() if module in routers_of(model)}
    routers = 0
    for (name, _), g, e in zip(model.named_parameters(), grads, expected):
        if e is None:
            assert g is None or g.abs().max().item() == 0.0, name
            continue
        routers += name in router_weights and g.abs().max().item() > 0
        assert (g - e).abs().max().item() <= 1e-5, name
    assert routers == len(router_weights) == model.config.num_hidden_layers  # the routers keep their gradient


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_another_samplers_routes_are_taken_and_misplaced_ones_are_not_the_same(zoo, packed):
    """A sampler whose routers differ (a perturbed copy: a bf16 server's near-ties, exaggerated) routes some tokens
    elsewhere: replayed, the trainer's forward takes its experts (agreement below 1, other log-probs than its own
    routing); the same routes swapped between two rows, or one token late, give other log-probs again."""
    path = zoo("qwen3_moe")
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    sequences = _sequences(input_ids, mask)
    sampler = _perturbed_sampler(path)
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


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_layer_recomputes_with_the_routes_its_forward_took(zoo, reentrant):
    """Activation checkpointing (TRL's default) recomputes each layer in backward, after the forward's replay ended:
    the recomputation takes the routes the forward took (else torch's checkpoint sees other tensors, or the
    gradients are another routing's). Gradients equal the same replay without checkpointing."""
    path = zoo("qwen3_moe")
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    sequences = _sequences(input_ids, mask)
    sampler = _perturbed_sampler(path)
    grads = []
    for checkpointed in (False, True):
        model = _model(path, packed=True).train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        replay = RouteReplay(model, _book_of(sampler, sequences))
        out = _scored(model, input_ids, mask, labels)
        (out.log_probs * out.label_mask).sum().backward()  # (reentrant checkpointing refuses autograd.grad)
        grads.append([p.grad for p in model.parameters()])
        assert replay.agreement.share < 1.0
    for plain, checkpointed in zip(*grads, strict=True):
        if plain is None:
            continue
        assert (plain - checkpointed).abs().max().item() <= 1e-5


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


ROUTES = "--enable-return-routed-experts"


@pytest.fixture(scope="module")
def moe_servers(zoo):
    """Routes in fp32, none, and two bf16 servers with routes (a sampler that differs from an fp32 trainer)."""
    path = zoo("qwen3_moe")
    bf16 = (ROUTES, "--dtype", "bfloat16")
    servers = start_servers(path, 4, (ROUTES,), (), bf16, bf16)
    yield path, servers
    for server in servers:
        server.stop()


def test_serve_returns_routes_in_vllms_format(moe_servers):
    """`--enable-return-routed-experts`: each choice's `routed_experts` decodes as vLLM documents it, `[prompt +
    completion - 1 - start, layers, top_k]` uint8, equal to the model's own router top-k over the sequence;
    `routed_experts_prompt_start` drops the prompt's first tokens; without the flag no routes come."""
    path, (with_routes, without, *_) = moe_servers
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

    with pytest.raises(ValueError, match=r"--enable-return-routed-experts: LlamaConfig has no mixture-of-experts"):
        create_app(zoo("llama"), return_routed_experts=True)


def _replay_run(path, out, urls, replay: bool, steps: int = 2, **fields):
    return server_grpo(
        path,
        out,
        urls,
        max_steps=steps,
        routing_replay=replay,
        weight_sync="shared_dir",
        learning_rate=0.0,  # the same weights on both sides: what differs is the sampler's precision and routes
        generation_kwargs={"seed": 0},
        **fields,
    )


def test_a_grpo_run_replays_its_bf16_servers_routes_in_the_fp32_trainer(moe_servers, tmp_path, caplog):
    """Two bf16 `trl-scale serve` servers returning routes, an fp32 trainer: with routing_replay=True every completion
    token's experts are the sampler's in the old and policy forwards (`routing/agreement`: how often the trainer's
    own router chose them too); the log-prob gap to the sampler (TRL's `sampling/sampling_logp_difference/mean`),
    with and without replay, is printed (the figure the docs quote)."""
    path, (_, _, bf16_a, bf16_b) = moe_servers
    urls = [bf16_a.url, bf16_b.url]
    replayed = _replay_run(path, tmp_path / "replay", urls, replay=True)
    replayed.train()
    logs = [log for log in replayed.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(0.0 < log["routing/agreement"] <= 1.0 for log in logs), logs
    assert all(log["routing/replayed_token_layers"] > 0 for log in logs)
    feature = replayed.features.get(RoutingReplay)
    assert len(feature.book) > 0
    # without replay, a server past the mismatch budget is said with the MoE's likely cause (the budget set below
    # what bf16 gives)
    plain = _replay_run(
        path, tmp_path / "plain", urls, replay=False, rollout_mismatch_budget=1e-9, rollout_mismatch_action="warn"
    )
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        plain.train()
    warned = [r.getMessage() for r in caplog.records if "past rollout_mismatch_budget" in r.getMessage()]
    assert warned and all("the policy is a mixture of experts" in message for message in warned), warned
    plain_logs = [log for log in plain.state.log_history if "loss" in log]
    assert not any("routing/agreement" in log for log in plain_logs)
    gap = "sampling/sampling_logp_difference/mean"
    print(
        {
            "agreement": [log["routing/agreement"] for log in logs],
            "gap_with_replay": [log[gap] for log in logs],
            "gap_without_replay": [log[gap] for log in plain_logs],
        }
    )


def test_routing_replay_is_refused_against_a_server_without_routes(moe_servers, tmp_path):
    path, (with_routes, without, *_) = moe_servers
    with pytest.raises(ValueError) as raised:
        _replay_run(path, tmp_path, [with_routes.url, without.url], replay=True)
    message = str(raised.value)
    assert f"{without.url}: returns no expert routes" in message and "--enable-return-routed-experts" in message
    assert with_routes.url not in message
    with pytest.raises(ValueError, match=r"routing_replay=True and tree_packing=True"):
        server_grpo(path, tmp_path / "tree", [with_routes.url], routing_replay=True, tree_packing=True)


def test_the_trainer_yaml_and_the_command_line_switch_replay_on(moe_servers, tmp_path, monkeypatch):
    import trl_scale
    from trl_scale.cli import main

    from .helpers import ROOT

    path, (with_routes, *_) = moe_servers
    seen = {}

    def fake_train(self, resume_from_checkpoint=None):
        seen["plan"], seen["replay"] = self.plan, self.features.get(RoutingReplay)

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        (ROOT / "examples" / "grpo_tiny_cpu.yaml").read_text()
        + f"\nuse_vllm: true\nvllm_mode: server\nvllm_server_base_urls: [{with_routes.url}]\n"
    )
    argv = ["grpo", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--model_name_or_path", path]
    assert main([*argv, "--routing_replay", "true"]) == 0
    assert seen["plan"].routing_replay and seen["replay"] is not None and seen["replay"].replays
    assert main(argv) == 0
    assert not seen["plan"].routing_replay and seen["replay"] is None
    config.write_text(config.read_text() + "routing_replay: true\n")
    assert main(argv) == 0
    assert seen["plan"].routing_replay and seen["replay"] is not None


def test_the_moe_page_states_the_benchmarks_numbers():
    """docs/moe.md quotes the newest lines of benchmarks/results/routing_replay_cpu.jsonl and moe_cpu.jsonl."""
    import json

    from .helpers import ROOT

    results = ROOT / "benchmarks" / "results"
    replay = json.loads((results / "routing_replay_cpu.jsonl").read_text().splitlines()[-1])
    moe = json.loads((results / "moe_cpu.jsonl").read_text().splitlines()[-1])
    page = " ".join((ROOT / "docs" / "moe.md").read_text().split())
    assert f"agrees with the sampler's on {replay['agreement_median']:.1%} of (token, layer)" in page
    gaps = f"is {replay['gap_median_with_replay']:.3f} with replay against {replay['gap_median_without_replay']:.3f}"
    assert gaps in page
    kl = (max(replay["mismatch_kl_without_replay"]), max(replay["mismatch_kl_with_replay"]))
    assert f"drops from up to {kl[0]:.3g} (past the default budget of 0.01) to at most {kl[1]:.2g}" in page
    assert kl[0] > 0.01 > kl[1] and replay["gap_median_with_replay"] < replay["gap_median_without_replay"]
    steps = moe["step_s"]
    assert (
        f"takes {steps['trl_scale_replay']:.2f} s replayed, {steps['trl_scale']:.2f} s packed, {steps['trl']:.2f} s "
        f"in stock TRL ({moe['speedup_with_replay']:.2f}x with replay)" in page
    )
    assert moe["max_logprob_diff_replay"] <= 1e-5 and moe["replay_agreement"] == 1.0


@pytest.mark.parametrize(
    "method, mode",
    [("rloo", {}), ("ppo", {}), ("grpo", {"async_rollout_staleness": 1, "async_rollout_mode": "streaming"})],
    ids=["rloo", "ppo", "grpo-streaming"],
)
def test_every_method_and_streaming_replay_the_servers_routes(moe_servers, tmp_path, method, mode):
    """RLOO, PPO (its policy's forwards; the critic has no routes to take) and streaming GRPO: every step replays."""
    from .helpers import server_rloo_or_ppo

    path, (_, _, bf16_a, bf16_b) = moe_servers
    fields = dict(max_steps=2, routing_replay=True, weight_sync="shared_dir", **mode)
    urls = [bf16_a.url, bf16_b.url]
    if method == "grpo":
        trainer = server_grpo(path, tmp_path, urls, **fields)
    else:
        trainer = server_rloo_or_ppo(method, path, tmp_path, urls, **fields)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log or "loss/policy_avg" in log]
    assert len(logs) == 2, trainer.state.log_history
    assert all(log["routing/replayed_token_layers"] > 0 and 0.0 < log["routing/agreement"] <= 1.0 for log in logs)


def test_a_cut_answer_and_its_continuation_keep_the_routes_of_the_weights_that_drew_each_token():
    """A partial rollout (a sync cut the answer, `async_rollout_interrupt="partial"`): the joined choice's routes are
    the cut request's for what it forwarded and the continuation's after; its prompt and tokens match them. Red if
    the continuation's routes replaced the first part's."""
    from trl_scale.rollout.client import joined
    from trl_scale.scoring.routing_replay import encode_routes

    prompt, done, rest = [1, 2, 3], [4, 5], [6, 7, 8]
    old = np.arange(len(prompt + done) - 1)[:, None, None].repeat(2, 1).repeat(2, 2).astype(np.uint8)  # [4, 2, 2]
    new = 100 + np.arange(len(prompt + done + rest) - 1)[:, None, None].repeat(2, 1).repeat(2, 2).astype(np.uint8)
    cut = {"token_ids": done, "prompt_token_ids": prompt, "finish_reason": "abort"}
    cut["routed_experts"] = encode_routes(old)
    more = {"token_ids": rest, "prompt_token_ids": prompt + done, "finish_reason": "stop"}
    whole = joined(cut, {**more, "routed_experts": encode_routes(new)})
    routes = decode_routes(whole["routed_experts"])
    assert routes.shape == (len(prompt + done + rest) - 1, 2, 2) and whole["prompt_token_ids"] == prompt
    assert np.array_equal(routes[: len(old)], old) and np.array_equal(routes[len(old) :], new[len(old) :])
    book = RouteBook()
    book.add(whole["prompt_token_ids"] + whole["token_ids"], routes)  # the record's sequence fits the routes
    assert "routed_experts" not in joined(cut, more)  # a continuation without routes: none (the feature names it)


def test_a_deepseek_v3_policy_syncs_and_replays_over_serve(zoo, tmp_path):
    """DeepSeek-V3 (group-limited, bias-corrected routing; its routing bias a buffer the checkpoint holds, no sync
    carries and nothing trains): its syncs pass the placement check, the server's routes are its router's own
    choice, and GRPO replays them, the servers' log-probs of its samples within float noise of the trainer's."""
    path = zoo("deepseek_v3")
    (server,) = start_servers(path, 1, (ROUTES,))
    try:
        trainer = server_grpo(path, tmp_path, [server.url], max_steps=2, routing_replay=True, weight_sync="shared_dir")
        trainer.train()
    finally:
        server.stop()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(log["routing/agreement"] == 1.0 for log in logs), logs  # fp32 both sides
    assert all(log["sampling/sampling_logp_difference/mean"] < 1e-4 for log in logs), logs


def test_a_lora_run_on_an_moe_policys_attention_syncs_its_adapter_and_replays(moe_servers, tmp_path):
    """LoRA on a Qwen3-MoE's attention (`weight_sync="lora"`), routes replayed through PEFT's wrapper: after every
    sync the fp32 server samples from the policy (the mismatch gate's per-step KL within float noise: the adapter
    reached it), and its routes are the trainer's own (agreement 1.0)."""
    from peft import LoraConfig

    path, (fp32, *_) = moe_servers
    trainer = server_grpo(
        path,
        tmp_path,
        [fp32.url],
        max_steps=3,
        routing_replay=True,
        weight_sync="lora",
        weight_sync_dir=str(tmp_path / "adapters"),
        learning_rate=0.05,
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(log["routing/agreement"] == 1.0 for log in logs), logs
    assert all(log["rollout/mismatch/server0/kl"] < 1e-6 for log in logs), logs
    assert logs[-1]["rollout/mismatch/server0/weights_version"] == 3


def test_a_tool_calling_conversation_replays_every_turns_routes(zoo, tmp_path):
    """Tool calls (TRL's tool loop, synchronous): a conversation's later turn is a request of its own whose prompt is
    the conversation so far, so its routes cover the sequence TRL scores (booked before the rollout folds the turns'
    records into the batch's); a conversation TRL cut at max_completion_length is the start of one the book holds.
    Every training row is replayed (`routing/rows_without_routes` 0: red with the first turn's routes only, 0.375,
    or without the cut conversations' prefix, 0.125)."""
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy.tools import build_tool_calling_model, tick, tool_prompts

    from .helpers import cpu_args, token_parity_reward

    path = build_tool_calling_model(zoo("qwen3_moe"), str(tmp_path / "tool-moe"))
    (server,) = start_servers(path, 1, (ROUTES,))
    try:
        config = trl_scale.GRPOConfig(
            **cpu_args(
                tmp_path / "run",
                max_steps=2,
                num_generations=4,
                max_completion_length=80,
                max_tool_calling_iterations=1,
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_urls=[server.url],
                routing_replay=True,
            )
        )
        trainer = trl_scale.GRPOTrainer(
            model=path,
            reward_funcs=token_parity_reward,
            args=config,
            train_dataset=tool_prompts(32),
            processing_class=AutoTokenizer.from_pretrained(path),
            tools=[tick],
        )
        trainer.train()
    finally:
        server.stop()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and any(log["tools/call_frequency"] > 0 for log in logs), logs
    assert any(log["completions/clipped_ratio"] > 0 for log in logs), logs  # a conversation TRL cut
    for log in logs:
        assert log["routing/rows_without_routes"] == 0.0 and log["routing/agreement"] == 1.0, log
