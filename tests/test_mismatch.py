"""The mismatch gate (`trl_scale/mismatch`, `trainers/mismatch_gate.py`): per-server figures of the sampler against
the policy, told apart by cause, and a server past its budget stopped, warned of or dropped before step 1, against
`trl-scale serve` (real vLLM: tests/test_mismatch_vllm.py)."""

from __future__ import annotations

import logging
import math
import random

import pytest

import trl_scale
from trl_scale.mismatch import mismatch_figures, sequence_mismatch_figures, verdict
from trl_scale.mismatch.figures import likely_cause
from trl_scale.toy import build_tiny_model

from .helpers import cpu_args, server_grpo, server_rloo_or_ppo, start_servers


def _rows(values: list[float], rows: int = 4) -> list[list[float]]:
    return [list(values) for _ in range(rows)]


def test_a_server_at_the_policy_measures_zero_and_passes_any_budget():
    sampled = _rows([-1.0, -2.0, -0.5, -3.0])
    figures = mismatch_figures("http://a", sampled, sampled, clip_max=3.0)
    assert (figures.kl, figures.mean_abs, figures.p99_abs, figures.past_cap) == (0.0, 0.0, 0.0, 0.0)
    assert figures.tokens == 16 and verdict(figures, 1e-9) is None


def test_the_kl_figure_estimates_the_kl_from_the_samplers_own_draws():
    """Tokens drawn from q, scored by q and p: mean(e^d - 1 - d) converges to KL(q || p) (exact here: 0.0869)."""
    q, p = [0.5, 0.3, 0.2], [0.3, 0.3, 0.4]
    exact = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p))
    draws = random.Random(0).choices(range(3), weights=q, k=40_000)
    sampler = [[math.log(q[t]) for t in draws]]
    policy = [[math.log(p[t]) for t in draws]]
    assert mismatch_figures("http://a", sampler, policy).kl == pytest.approx(exact, rel=0.03)


def test_the_sequence_figure_estimates_the_same_kl_per_token_from_sums_alone():
    """RLOO keeps each completion's summed log-prob: sum(e^D - 1 - D) / tokens over sequences of independent tokens
    drawn from q converges to the per-token KL(q || p) too (0.0869 here); red if D were averaged per token first."""
    q, p = [0.5, 0.3, 0.2], [0.3, 0.3, 0.4]
    exact = sum(qi * math.log(qi / pi) for qi, pi in zip(q, p))
    rng, length = random.Random(0), 3
    sequences = [rng.choices(range(3), weights=q, k=length) for _ in range(60_000)]
    sampler = [sum(math.log(q[t]) for t in seq) for seq in sequences]
    policy = [sum(math.log(p[t]) for t in seq) for seq in sequences]
    figures = sequence_mismatch_figures("http://a", sampler, policy, [length] * len(sequences), clip_max=3.0)
    assert figures.kl == pytest.approx(exact, rel=0.05) and figures.tokens == length * len(sequences)
    assert figures.mean_abs is None and 0.0 < figures.past_cap < 1.0  # sequences whose ratio passes 3
    assert "weights other than the policy's" in verdict(figures, 1e-3) and "of completions past" in verdict(figures, 0)
    same = sequence_mismatch_figures("http://a", sampler[:10], sampler[:10], [length] * 10)
    assert same.kl == 0.0 and verdict(same, 1e-9) is None


@pytest.mark.parametrize(
    "shape, cause",
    [
        ("uniform", "another dtype or a quantization"),
        ("everywhere", "another model or revision"),
        ("first tokens", "another tokenizer or chat template"),
        ("lora", "LoRA adapter is not loaded"),
    ],
)
def test_each_cause_is_told_apart_by_its_shape(shape, cause):
    rng = random.Random(1)
    sampler = [[-2.0 + rng.uniform(-1, 1) for _ in range(12)] for _ in range(8)]
    if shape == "uniform":  # small, no tail
        policy = [[s + rng.uniform(-0.02, 0.02) for s in row] for row in sampler]
    elif shape == "everywhere":
        policy = [[s + rng.uniform(-3, 3) for s in row] for row in sampler]
    elif shape == "first tokens":
        policy = [[s - (6.0 if i < 2 else rng.uniform(-0.01, 0.01)) for i, s in enumerate(row)] for row in sampler]
    else:  # the base model (adapter off) is what the server samples from
        policy = [[s + rng.uniform(-2, 2) for s in row] for row in sampler]
    base = sampler if shape == "lora" else None
    figures = mismatch_figures("http://s", sampler, policy, clip_max=3.0, base=base)
    assert cause in likely_cause(figures)
    line = verdict(figures, budget=1e-6)
    assert line.startswith("http://s: ") and "rollout_mismatch_budget=1e-06" in line and cause in line


def test_tokens_past_the_corrections_bounds_are_counted():
    sampler = [[-1.0, -1.0, -1.0, -1.0]]
    policy = [[-1.0 + math.log(4.0), -1.0 + math.log(0.1), -1.0, -1.0]]  # ratios 4, 0.1, 1, 1
    assert mismatch_figures("u", sampler, policy, clip_max=3.0).past_cap == 0.25
    assert mismatch_figures("u", sampler, policy, clip_max=3.0, clip_min=0.5).past_cap == 0.5


def test_the_settings_are_checked_and_refused_where_nothing_reads_them(tmp_path):
    with pytest.raises(ValueError, match="rollout_mismatch_budget=-1"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), rollout_mismatch_budget=-1.0)
    with pytest.raises(ValueError, match="rollout_mismatch_action='stop'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), rollout_mismatch_action="stop")
    with pytest.raises(ValueError, match="rollout_mismatch_prompts=0"):
        trl_scale.RLOOConfig(**cpu_args(tmp_path), rollout_mismatch_prompts=0)


# A tiny random model's next-token distributions are nearly uniform (initializer_range 0.02: entropy 6 nats of 6.2),
# where no mismatch can show; 0.2 makes them peaked as a trained model's are (entropy 4.9).
PEAKED = {"initializer_range": 0.2}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("policy"), family="llama", **PEAKED)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """Another revision of the policy: its shape, tokenizer and names, other weights and a config value no weight
    sync carries (a sync before step 1 overwrites the weights, so the probe after it sees the config's part)."""
    return build_tiny_model(tmp_path_factory.mktemp("other"), family="llama", seed=7, rms_norm_eps=0.5, **PEAKED)


@pytest.fixture(scope="module")
def mixed_servers(policy, other_model):
    servers = start_servers(policy, 2) + start_servers(other_model, 1)
    yield servers
    for server in servers:
        server.stop()


MODES = {
    "sync": {},
    "ordered": {"async_rollout_staleness": 1, "async_rollout_mode": "ordered"},
    "streaming": {"async_rollout_staleness": 1, "async_rollout_mode": "streaming"},
}


@pytest.mark.parametrize(
    "method, mode",
    [("grpo", "sync"), ("grpo", "ordered"), ("grpo", "streaming"), ("rloo", "sync"), ("ppo", "streaming")],
)
def test_a_server_of_another_revision_stops_the_run_before_step_1_named(mixed_servers, policy, tmp_path, method, mode):
    good, _, wrong = (s.url for s in mixed_servers)
    if method == "grpo":
        trainer = server_grpo(policy, tmp_path, [good, wrong], max_steps=1, **MODES[mode])
    else:
        trainer = server_rloo_or_ppo(method, policy, tmp_path, [good, wrong], max_steps=1, **MODES[mode])
    with pytest.raises(ValueError) as raised:
        trainer.train()
    message = str(raised.value)
    assert wrong in message and good not in message.split("Fix:")[0], message
    assert "another model or revision" in message and "rollout_mismatch_budget=0.01" in message
    assert trainer.state.global_step == 0


def test_a_server_of_a_model_with_another_tokenizer_is_named_before_anything_is_generated(
    mixed_servers, policy, tmp_path
):
    """A server whose model has the policy's shape and vocabulary size but another tokenizer (the toy vocabulary's
    first word, by the order ids are given, swapped for a new last one: most ids mean another word): the preflight's
    tokenizer check names it while the trainer is built, before the probe or any generation (the probe could not see
    it: the tokens go as ids, and the first sync gives the server the policy's weights)."""
    from trl_scale.toy.tokenizer import TOY_WORDS

    words = [word for word in TOY_WORDS if word != min(TOY_WORDS)] + ["zyzzyva"]
    other = build_tiny_model(tmp_path / "reversed", family="llama", words=words, **PEAKED)
    (reversed_server,) = start_servers(other, 1)
    try:
        with pytest.raises(ValueError) as raised:
            server_grpo(policy, tmp_path, [mixed_servers[0].url, reversed_server.url], max_steps=1)
    finally:
        reversed_server.stop()
    message = str(raised.value)
    assert reversed_server.url in message and "whose tokenizer encodes" in message, message
    assert mixed_servers[0].url not in message.split("Fix:")[0]


def test_a_server_that_stops_answering_during_the_probe_is_left_to_the_per_step_check(mixed_servers):
    """The losing order, forced: one server's connection is refused when the probe asks it (a managed server killed
    and restarting, as tests/test_fleet.py's dying server is, mid-probe). Its entry is None (measured at the first
    step it draws tokens in, said by the gate); the others' samples come back."""
    from trl_scale.net import free_port
    from trl_scale.rollout.client import RolloutClient
    from trl_scale.rollout.mismatch_probe import sample_each_server

    gone = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([mixed_servers[0].url, gone], request_timeout=30)
    try:
        samples = sample_each_server(client, [[432, 375]], {"max_tokens": 3, "temperature": 1.0})
    finally:
        client.close()
    assert samples[gone] is None
    (choices,) = samples[mixed_servers[0].url]
    assert len(choices) == 2 and all(len(ids) == len(logprobs) > 0 for ids, logprobs in choices)


def test_the_policys_servers_pass_with_their_figures_in_the_first_log(mixed_servers, policy, tmp_path, caplog):
    from trl_scale.timeline import MISMATCH_COUNTER, Timeline

    urls = [s.url for s in mixed_servers[:2]]
    trainer = server_grpo(policy, tmp_path, urls, max_steps=2, rollout_timeline=True)
    with caplog.at_level(logging.INFO, logger="trl_scale"):
        trainer.train()
    first, second = [log for log in trainer.state.log_history if "loss" in log][:2]
    for index in (0, 1):
        assert first[f"rollout/mismatch_probe/server{index}/kl"] < 1e-6, first
        assert first[f"rollout/mismatch_probe/server{index}/tokens"] > 0
    for log in (first, second):  # every step's own, per server that drew its tokens (the router's choice)
        measured = [v for k, v in log.items() if k.startswith("rollout/mismatch/server") and k.endswith("/kl")]
        assert measured and all(value < 1e-6 for value in measured), log
    assert not any(key.startswith("rollout/mismatch_probe/") for key in second)
    assert "trl-scale mismatch probe (before step 1)" in caplog.text
    # the timeline: a counter per server and step, on the server's own track, as logged
    counters = Timeline.read(str(tmp_path / "timeline" / "trace.json")).counters()
    drawn = [(group, values["step"]) for group, name, _, values in counters if name == MISMATCH_COUNTER]
    logged = {(url, log["step"] - 1) for log in (first, second) for url in urls if _logged_for(trainer, log, url)}
    assert set(drawn) == logged and len(drawn) == len(logged), (drawn, logged)


def _logged_for(trainer, log: dict, url: str) -> bool:
    from trl_scale.trainers.mismatch_gate import MismatchGate

    label = trainer.features.get(MismatchGate).labels.get(url)
    return label is not None and f"rollout/mismatch/server{label}/kl" in log


def test_drop_trains_on_the_servers_that_pass_and_says_so_once(mixed_servers, policy, tmp_path, caplog):
    good, also_good, wrong = (s.url for s in mixed_servers)
    trainer = server_grpo(policy, tmp_path, [good, wrong, also_good], max_steps=2, rollout_mismatch_action="drop")
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        trainer.train()
    assert trainer.state.global_step == 2
    served = [server.url for server in trainer.vllm_generation.client.servers]
    assert served == [good, also_good]
    said = [r for r in caplog.records if "dropped from the fleet" in r.getMessage()]
    assert len(said) == 1 and wrong in said[0].getMessage()


@pytest.mark.parametrize("action", ["warn", "drop"])
def test_the_probe_runs_beside_the_first_batch_unless_a_server_may_be_dropped(
    mixed_servers, policy, tmp_path, monkeypatch, action
):
    """The probe's requests go while the first batch generates (the trainer waits only for what is left of them,
    and for scoring): forced here, the probe's sampling waits for the batch's first request, which comes only if the
    probe does not hold the batch back. With `rollout_mismatch_action='drop'` the probe runs first instead (a server
    to drop must draw none of the batch): its sampling is over before the batch's first request."""
    import threading

    from trl_scale.trainers import mismatch_gate

    urls = [s.url for s in mixed_servers[:2]]
    trainer = server_grpo(policy, tmp_path, urls, max_steps=1, rollout_mismatch_action=action)
    batch_sent, probe_done, order = threading.Event(), threading.Event(), []
    client = trainer.vllm_generation.client
    generate, sample = client.generate, mismatch_gate.sample_each_server

    def first_batch(*args, **kwargs):
        order.append("batch sent" if not probe_done.is_set() else "batch sent after the probe")
        batch_sent.set()
        return generate(*args, **kwargs)

    def probe(*args):
        if action == "warn":
            order.append("probe waited" if batch_sent.wait(timeout=120) else "probe held the batch back")
        try:
            return sample(*args)
        finally:
            probe_done.set()

    monkeypatch.setattr(client, "generate", first_batch)
    monkeypatch.setattr(mismatch_gate, "sample_each_server", probe)
    trainer.train()
    assert trainer.state.global_step == 1
    if action == "warn":
        assert order[:2] == ["batch sent", "probe waited"], order
    else:
        assert order[0] == "batch sent after the probe", order


def test_warn_goes_on_with_every_server_and_says_so_once_per_server(mixed_servers, policy, tmp_path, caplog):
    """The probe warns of the wrong server; the steps after, which measure it again on the tokens it draws, do not
    warn of it a second time."""
    from trl_scale.routing import routing_policy

    good, _, wrong = (s.url for s in mixed_servers)
    trainer = server_grpo(policy, tmp_path, [good, wrong], max_steps=2, rollout_mismatch_action="warn")
    # each step's two requests, sent together, go one to each server: the wrong one draws tokens every step
    trainer.vllm_generation.client.rotation.policy = routing_policy("least_outstanding")
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        trainer.train()
    assert trainer.state.global_step == 2 and len(trainer.vllm_generation.client.servers) == 2
    warned = [
        r.getMessage() for r in caplog.records if "past rollout_mismatch_budget (training goes on)" in r.getMessage()
    ]
    assert len(warned) == 1 and wrong in warned[0], warned
    assert all("rollout/mismatch/server1/kl" in log for log in trainer.state.log_history if "loss" in log)


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_a_server_a_sync_did_not_reach_is_caught_at_the_step_after_it(
    mixed_servers, policy, tmp_path, monkeypatch, method
):
    """One server takes the first sync, then claims each later version without loading it (weights a sync did not
    reach): the first step after the missed sync in which it draws tokens names it; the steps before trained. RLOO
    measures it from each completion's summed log-probs (it keeps no per-token old log-probs)."""
    from trl_scale.rollout.weight_sync.shared_dir import SharedDirSync
    from trl_scale.routing import routing_policy

    good, stale = (s.url for s in mixed_servers[:2])
    reload = SharedDirSync._reload
    loads = {good: 0, stale: 0}

    def missing_later_syncs(self, server, path, version):
        loads[server.url] += 1
        if server.url == stale and loads[stale] > 1:  # the version is claimed, the weights never loaded
            self.client.transport.post(server, "/update_weight_version", 30, json={"new_version": version})
            return
        reload(self, server, path, version)

    monkeypatch.setattr(SharedDirSync, "_reload", missing_later_syncs)
    fields = dict(max_steps=3, weight_sync="shared_dir", learning_rate=0.05)
    if method == "grpo":
        trainer = server_grpo(policy, tmp_path, [good, stale], **fields)
    else:
        trainer = server_rloo_or_ppo(method, policy, tmp_path, [good, stale], **fields)
    # each step's two requests, sent together, go one to each server (latency routing may keep to the faster one)
    trainer.vllm_generation.client.rotation.policy = routing_policy("least_outstanding")
    with pytest.raises(ValueError) as raised:
        trainer.train()
    message = str(raised.value)
    assert stale in message.split("Fix:")[0] and good not in message.split("Fix:")[0], message
    # caught at the first step after the missed sync in which it drew tokens (which server draws is the router's)
    step = trainer.state.global_step
    assert step >= 1 and f"at step {step}, weights of sync {step + 1}" in message, message
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == step and logs[0]["rollout/mismatch_probe/server1/kl"] < 1e-6
    for log in logs:  # each step before: every server that drew tokens measured clean, on the newest weights
        assert all(v < 1e-6 for k, v in log.items() if k.startswith("rollout/mismatch/") and k.endswith("/kl"))
        versions = [v for k, v in log.items() if k.startswith("rollout/mismatch/") and k.endswith("/weights_version")]
        assert versions and all(v == log["step"] for v in versions), log  # sync N drew step N's tokens


def test_check_servers_measures_each_server_against_a_local_model(mixed_servers, policy, capsys):
    from trl_scale.cli import main

    (fresh,) = start_servers(policy, 1)  # the checkpoint's weights (the fleet's took other runs' syncs)
    good, wrong = fresh.url, mixed_servers[2].url
    try:
        assert main(["check-servers", good, wrong, "--model", policy, "--mismatch-budget", "0.01"]) == 1
        printed = capsys.readouterr()
        assert main(["check-servers", good, "--model", policy, "--mismatch-budget", "0.01"]) == 0
    finally:
        fresh.stop()
    table = printed.out.split(f"mismatch against {policy}:")[1]
    assert good in table and wrong in table
    problems = [line for line in printed.err.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 1 and wrong in problems[0] and "another model or revision" in problems[0]


def test_the_trainer_yaml_and_the_command_line_reach_the_gate(mixed_servers, tmp_path, monkeypatch):
    from trl_scale.cli import main
    from trl_scale.mismatch import MismatchSettings
    from trl_scale.trainers.mismatch_gate import MismatchGate

    from .helpers import ROOT

    seen = {}

    def fake_train(self, resume_from_checkpoint=None):
        seen["plan"], seen["gate"] = self.plan, self.features.get(MismatchGate)

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    config = tmp_path / "grpo.yaml"
    config.write_text(
        (ROOT / "examples" / "grpo_tiny_cpu.yaml").read_text()
        + f"\nuse_vllm: true\nvllm_mode: server\nvllm_server_base_urls: [{mixed_servers[0].url}]\n"
        "rollout_mismatch_action: drop\n"
    )
    model = mixed_servers[0].command[mixed_servers[0].command.index("--model") + 1]
    argv = ["grpo", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--model_name_or_path", model]
    assert main([*argv, "--rollout_mismatch_budget", "0.5"]) == 0
    assert seen["plan"].mismatch == MismatchSettings(0.5, "drop", 4) and seen["gate"].settings.budget == 0.5
    config.write_text(config.read_text() + "rollout_mismatch_budget: null\n")  # None: no probe, no gate
    assert main(argv) == 0
    assert seen["plan"].mismatch.budget is None and seen["gate"] is None


def test_the_docs_page_states_the_codes_numbers_and_the_newest_measurement():
    import json

    from trl_scale.mismatch.arguments import DEFAULT_BUDGET, MismatchArguments
    from trl_scale.mismatch.figures import FIRST_TOKENS
    from trl_scale.rollout.mismatch_probe import COMPLETIONS_PER_PROMPT
    from trl_scale.trainers.mismatch_gate import PROBE_TOKENS

    from .helpers import ROOT

    page = " ".join((ROOT / "docs" / "mismatch.md").read_text().split())
    assert f"`rollout_mismatch_budget` (`float` or `None`, default `{DEFAULT_BUDGET:g}`)" in page
    assert f"(`int`, default {MismatchArguments.rollout_mismatch_prompts})" in page
    assert f"{['one', 'two'][COMPLETIONS_PER_PROMPT - 1]} completions each, up to {PROBE_TOKENS} tokens" in page
    assert f"each completion's first {FIRST_TOKENS} tokens" in page
    record = json.loads((ROOT / "benchmarks" / "results" / "mismatch_cpu.jsonl").read_text().splitlines()[-1])
    servers = record["servers"]
    assert f"gives a KL of {servers['fp32']['kl']:.2g} nats per token" in page
    assert f"in bfloat16 {servers['bf16']['kl']:.2g}, another revision {servers['other_revision']['kl']:.2g}" in page
    assert f"the probe took {record['probe_s']:.2f} s, {record['probe_share_of_first_step']:.1%} of" in page
    assert f"that run's first step ({record['first_step_s']:.2f} s" in page
    assert f"took {record['first_step_ratio']:.2f}x the time" in page
    assert f"without it ({record['first_step_without_probe_s']:.2f} s)" in page
    assert f"(medians of {record['repeats']})" in page
    assert record["default_budget"] == DEFAULT_BUDGET


def test_a_lora_runs_server_without_the_adapter_is_named(policy, tmp_path, monkeypatch):
    """LoRA: the probe asks each server for the adapter just synced; one that did not load it is named (and a server
    that did is measured against the policy, and against its base model with the adapter off)."""
    from peft import LoraConfig

    from trl_scale.errors import RolloutError
    from trl_scale.rollout.weight_sync.lora import LoraSync

    fresh = start_servers(policy, 2)  # the checkpoint's base weights (a LoRA sync sends only the adapter)
    good, skipped = (s.url for s in fresh)
    load = LoraSync._load
    monkeypatch.setattr(
        LoraSync, "_load", lambda self, server, *a: None if server.url == skipped else load(self, server, *a)
    )
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    fields = dict(weight_sync="lora", weight_sync_dir=str(tmp_path / "adapters"), max_steps=1, peft_config=lora)
    trainer = server_grpo(policy, tmp_path / "run", [good, skipped], **fields)
    with pytest.raises(RolloutError, match=rf"{skipped}: .*the LoRA adapter is not loaded there"):
        trainer.train()
    monkeypatch.setattr(LoraSync, "_load", load)
    trainer = server_grpo(policy, tmp_path / "again", [good], **{**fields, "weight_sync_dir": str(tmp_path / "b")})
    try:
        trainer.train()
    finally:
        for server in fresh:
            server.stop()
    first = next(log for log in trainer.state.log_history if "loss" in log)
    assert first["rollout/mismatch_probe/server0/kl"] < 1e-6 and "rollout/mismatch_probe/server0/base_kl" in first
