"""Rollout against real vLLM (the CPU build of vLLM 0.32 in .venv-vllm; `bash scripts/setup_vllm.sh`).

One fleet per module, started in parallel: two dev-mode servers with LoRA and trl-scale's gloo weight-transfer
plugin (`A` with `--logprobs-mode processed_logprobs`, `B` with vLLM's default `raw_logprobs`), and a plain
`vllm serve` of another model (no dev mode, no LoRA). Each training test first reloads A and B with the base
weights; teardown checks no vLLM process is left. A server killed mid-run and restarted: tests/test_fleet_vllm.py
(managed servers) and tests/test_weight_sync.py (the version gate, against `trl-scale serve`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import requests
import torch

from trl_scale.rollout import RolloutClient
from trl_scale.rollout.weight_sync import SharedDirSync
from trl_scale.toy import build_tiny_model

from .helpers import cpu_args, subprocess_env, token_parity_reward
from .real_vllm import DEV_FLAGS, LORA_FLAGS, prompt_logprobs, served_models, start_vllm_servers, weight_version

pytestmark = pytest.mark.vllm_cpu

PROBE = [5, 17, 33, 42, 8, 99, 120, 7, 64, 250, 11]  # prompt-logprob probe: 10 scored tokens
SYNC_TOLERANCE = 1e-4  # |server - policy| prompt log-prob after a sync (fp32 both sides; measured ~1e-6)
PROCESSED = ("--logprobs-mode", "processed_logprobs")


class Fleet:
    def __init__(self, model_path, a, b, plain):
        self.model_path, self.a, self.b, self.plain = model_path, a, b, plain

    @property
    def rl_urls(self) -> list[str]:
        return [self.a.url, self.b.url]


@pytest.fixture(scope="module")
def fleet(tiny_llama_hd64, tmp_path_factory):
    other = build_tiny_model(
        tmp_path_factory.mktemp("other-model"),
        words=["one", "two", "three"],
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    rl_flags = ("--logprobs-mode", "processed_logprobs", *DEV_FLAGS[2:], *LORA_FLAGS)
    raw_flags = (*DEV_FLAGS[2:], *LORA_FLAGS)  # vLLM's default log-prob mode: raw_logprobs
    # A's context is long enough for a request that outlasts a weight sync's pause on a loaded machine (the keep-sync
    # test: its pause, after health checks of a busy server, once came later than a 240-token answer's end).
    servers = start_vllm_servers(
        [
            (tiny_llama_hd64, rl_flags, {"max_model_len": 1024}),
            (tiny_llama_hd64, raw_flags, {}),
            (other, (), {"dev_mode": False}),
        ]
    )
    yield Fleet(tiny_llama_hd64, *servers)
    for server in servers:
        server.stop()
    left = {server.url: server.group_pids() for server in servers}
    assert not any(left.values()), f"vLLM processes left running: {left}"


@pytest.fixture
def rl_urls(fleet) -> list[str]:
    """A and B serving the base weights again, with no adapter loaded (an earlier test synced its policy)."""
    dead = [why for why in (fleet.a.why_dead(), fleet.b.why_dead()) if why]
    if dead:  # an earlier test killed one: say why, once per later test, not as a refused connection
        pytest.fail("\n".join(dead))
    client = RolloutClient(fleet.rl_urls)
    try:
        SharedDirSync(client).reload(fleet.model_path, "base")
    finally:
        client.close()
    for url in fleet.rl_urls:
        for adapter in served_models(url)[1:]:
            requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": adapter}, timeout=30).raise_for_status()
    return fleet.rl_urls


def _trainer(method: str, model_path: str, out, urls: list[str], weight_sync: str, **overrides):
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy import counting_prompts

    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    settings = dict(
        max_completion_length=6,
        max_steps=3,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        weight_sync=weight_sync,
        weight_sync_timeout=60,
        rollout_request_timeout=60,
        learning_rate=3e-3,  # the policy moves visibly between syncs
    )
    if method == "ppo":  # one optimizer step per generation batch, so one sync per step as in GRPO and RLOO
        settings.update(num_ppo_epochs=1, num_mini_batches=1)
    else:
        settings["num_generations"] = 4
    peft_config = overrides.pop("peft_config", None)
    settings.update(overrides)
    if weight_sync == "lora" and peft_config is None:
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    if peft_config is not None:
        peft_config.target_modules = peft_config.target_modules or ["q_proj", "v_proj"]
    return trainer_cls(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config_cls(**cpu_args(out, **settings)),
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=peft_config,
    )


@torch.no_grad()
def _policy_logprobs(trainer, prompt: list[int]) -> list[float]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


def served_vs_policy(trainer, url: str) -> float:
    """Largest |server - policy| prompt log-prob on PROBE: at most SYNC_TOLERANCE once `url` serves the policy."""
    served = prompt_logprobs(url, PROBE, served_models(url)[0])
    return max(abs(a - b) for a, b in zip(served, _policy_logprobs(trainer, PROBE)))


def _check_every_sync(trainer, urls: list[str]) -> list[dict]:
    """After each sync: every server's prompt log-probs against the policy's, and the version each reports."""
    generation = trainer.vllm_generation
    sync = generation.sync_weights
    records = []

    def checked_sync():
        sync()
        expected = _policy_logprobs(trainer, PROBE)
        record = {"policy": expected, "diff": {}, "version": generation.syncer.version}
        for url in urls:
            served = served_models(url)
            model = generation.syncer.lora_name or served[0]
            got = prompt_logprobs(url, PROBE, model)
            assert len(got) == len(expected) > 0
            record["diff"][url] = max(abs(a - b) for a, b in zip(got, expected))
            if generation.syncer.name == "lora":
                record[url] = served[1:]  # the adapters it holds: only the current one
            else:
                record[url] = weight_version(url)
        records.append(record)

    generation.sync_weights = checked_sync
    return records


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["shared_dir", "lora", "nccl"])
@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo"])
def test_every_sync_reaches_every_real_vllm_server(fleet, rl_urls, tmp_path, method, weight_sync):
    """GRPO, RLOO and PPO × shared_dir / lora / nccl (trl-scale's gloo engine loaded into vLLM as a plugin): after
    every sync, both servers' prompt log-probs equal the policy's (<= 1e-4) and they report the sync's version."""
    trainer = _trainer(method, fleet.model_path, tmp_path, rl_urls, weight_sync)
    assert trainer.vllm_generation.syncer.name == weight_sync
    records = _check_every_sync(trainer, rl_urls)
    trainer.train()
    assert trainer.state.global_step == 3
    assert len(records) == 3  # one sync before each generation batch
    for record in records:
        for url in rl_urls:
            assert record["diff"][url] <= SYNC_TOLERANCE, (url, record["diff"])
            if weight_sync == "lora":
                assert record[url] == [record["version"]], record
            else:
                assert record[url] == record["version"], record
    # the check is not vacuous: the policy the servers followed moved between the first and last sync
    moved = max(abs(a - b) for a, b in zip(records[0]["policy"], records[-1]["policy"]))
    assert moved > 100 * SYNC_TOLERANCE, moved


def _streamed_long_answers() -> dict:
    """4 GRPO steps at staleness 1 whose answers (48 tokens, no early stop) outlast a training step, so generations
    run across syncs."""
    return dict(
        max_steps=4, max_completion_length=48, generation_kwargs={"ignore_eos": True}, async_rollout_staleness=1
    )


def _record_run(trainer) -> tuple[dict, list]:
    """Record, as `trainer` trains: the policy's weights after each sync (by sync count), and per generated batch its
    tensors, each completion's first version and (first, newest) span, and the sync count it was trained at."""
    generation = trainer.vllm_generation
    checkpoints, batches = {}, []
    sync, score = generation.sync_weights, trainer._generate_and_score_completions

    def recording_sync():
        sync()
        model = trainer.accelerator.unwrap_model(trainer.model)
        checkpoints[generation.sync_count] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def recording_score(inputs):
        batch = score(inputs)
        tensors = {k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}
        spans = list(generation.steps.newest_record().version_spans)
        batches.append((tensors, generation.steps.newest_record().versions, spans, generation.sync_count))
        return batch

    generation.sync_weights = recording_sync
    trainer._generate_and_score_completions = recording_score
    return checkpoints, batches


def _drawn_logprobs(model, checkpoint: dict, batch: dict, temperature: float = 1.0) -> torch.Tensor:
    """``[B, W]`` log-probs of a batch's completion tokens under ``checkpoint`` (the weights a server sampled with),
    positions restarting per sequence as a server's do."""
    model.load_state_dict(checkpoint)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0))
    logits = logits.logits[:, -batch["completion_ids"].size(1) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(2, batch["completion_ids"][..., None])[..., 0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["grpo", "ppo"])
def test_sampler_logprobs_from_real_vllm_feed_the_importance_sampling_correction(fleet, rl_urls, tmp_path, method):
    """Async rollout (staleness 1) at temperature 0.8 against the processed-log-prob server: each batch's
    `sampling_per_token_logps` are real vLLM's log-probs of the weights the batch was sampled from (checked against
    a forward of that very checkpoint), and TRL's token-level ratio is exp(old - sampling), clipped at 3: red when
    the sampler's log-probs are dropped or the ratio inverted. Stale batches make the ratio differ from 1."""
    trainer = _trainer(
        method,
        fleet.model_path,
        tmp_path,
        [fleet.a.url],
        "shared_dir",
        max_steps=5,
        temperature=0.8,
        async_rollout_staleness=1,
        async_rollout_mode="ordered",  # each completion of one version (streaming's per-token check: below)
        vllm_importance_sampling_mode="token_truncate",
    )
    generation = trainer.vllm_generation
    checkpoints, recorded = _record_run(trainer)
    trainer.train()
    batches = [(tensors, versions, current) for tensors, versions, _, current in recorded]

    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32)
    assert len(batches) >= 4
    lags, worst_logprob, worst_ratio = [], 0.0, 0.0
    for batch, versions, current in batches:
        mask = batch["completion_mask"].bool()
        assert mask.any()
        # A batch is sampled with the weights of its tag or newer (a prefetched request still queued when the next
        # sync starts waits for it), never older: each completion must match one checkpoint in that range.
        candidates = [
            _drawn_logprobs(sampler, checkpoints[version], batch, temperature=0.8)
            for version in range(min(versions), current + 1)
        ]
        sampling = batch["sampling_per_token_logps"]
        errors = torch.stack([((sampling - c) * mask).abs().amax(1) for c in candidates])  # [versions, rows]
        best = errors.argmin(0)
        expected = torch.stack([candidates[v][row] for row, v in enumerate(best.tolist())])
        worst_logprob = max(worst_logprob, errors.min(0).values.max().item())
        ratio = torch.exp(batch["old_per_token_logps"] - expected).clamp(max=3.0)
        worst_ratio = max(worst_ratio, (batch["importance_sampling_ratio"] - ratio)[mask].abs().max().item())
        lags.append(((ratio - 1)[mask].abs().max().item(), current))
    assert worst_logprob <= 1e-4, worst_logprob
    assert worst_ratio <= 1e-4, worst_ratio
    # off-policy batches were trained: some ratio is far from 1 (on-policy ones are within float noise)
    assert max(lag for lag, _ in lags) > 1e-2, lags
    assert generation.ahead.prefetcher.served_from_prefetch >= 2


def test_preflight_names_every_problem_of_each_server(fleet, rl_urls, tmp_path):
    """One error at construction, one line per problem, each naming the server, the flag and the fix: a plain
    `vllm serve` of another model, LoRA above the server's rank, raw log-probs under temperature 0.7, and a
    --max-model-len too short for the completions."""
    plain = fleet.plain.url
    for mode in ("auto", "shared_dir", "nccl"):  # 'auto' used to pick shared_dir silently and die at /pause
        with pytest.raises(ValueError) as caught:
            _trainer("grpo", fleet.model_path, tmp_path / mode, [fleet.a.url, plain], mode)
        message = str(caught.value)
        assert f"{plain}: vLLM's RL routes are off" in message and "VLLM_SERVER_DEV_MODE=1" in message
        assert f"{plain}: serves" in message and "vocabulary is smaller" in message  # another model
        assert fleet.a.url not in message  # A is fine
    with pytest.raises(ValueError) as caught:
        _trainer("grpo", fleet.model_path, tmp_path / "lora", [plain], "lora")
    assert f"{plain}: LoRA loading is off" in str(caught.value) and "--enable-lora" in str(caught.value)

    from peft import LoraConfig

    with pytest.raises(ValueError, match=r"peft_config.r has rank 16, above the server's --max-lora-rank 8"):
        _trainer("grpo", fleet.model_path, tmp_path / "r16", [fleet.a.url], "lora", peft_config=LoraConfig(r=16))
    # the same rules read from the real /server_info, for the rank vLLM 0.32 takes the maximum of
    from trl_scale.rollout.preflight import RunNeeds, inspect_all, problems_of

    client = RolloutClient([fleet.a.url])
    (report,) = inspect_all(client.transport.get_url, client.transport.post_url, [fleet.a.url])
    client.close()
    pattern = LoraConfig(r=4, rank_pattern={"v_proj": 32}, init_lora_weights="pissa")
    errors, _ = problems_of(report, RunNeeds(weight_sync="lora", lora_config=pattern))
    assert any("peft_config.rank_pattern has rank 32, above the server's --max-lora-rank 8" in e for e in errors)
    assert any("init_lora_weights='pissa'" in e for e in errors), errors
    # both boundaries: the server's own rank is accepted (vLLM refuses only above it)
    errors, _ = problems_of(report, RunNeeds(weight_sync="lora", lora_config=LoraConfig(r=8)))
    assert not errors, errors
    errors, _ = problems_of(report, RunNeeds(weight_sync="lora", lora_config=LoraConfig(r=9)))
    assert any("peft_config.r has rank 9, above the server's --max-lora-rank 8" in e for e in errors), errors
    # vLLM's CPU worker dies resuming seeded requests a streaming sync preempted: refused on this (CPU) server
    assert report.device_type == "cpu"
    seeded = RunNeeds(streaming=True, sampling={"seed": 0})
    errors, _ = problems_of(report, seeded)
    assert any("vLLM on CPU, streaming rollout and seeded requests" in e for e in errors), errors
    assert not problems_of(report, RunNeeds(streaming=False, sampling={"seed": 0}))[0]
    assert not problems_of(report, RunNeeds(streaming=True, sampling={}))[0]

    with pytest.raises(ValueError) as caught:
        _trainer("grpo", fleet.model_path, tmp_path / "raw", rl_urls, "shared_dir", temperature=0.7)
    message = str(caught.value)
    assert f"{fleet.b.url}: --logprobs-mode raw_logprobs" in message and "temperature=0.7" in message
    assert "--logprobs-mode processed_logprobs" in message and fleet.a.url not in message

    # B's context is 256 (A's is longer, for the keep-sync test)
    with pytest.raises(ValueError, match=r"--max-model-len 256 leaves no room .* max_completion_length=300"):
        _trainer("grpo", fleet.model_path, tmp_path / "len", [fleet.b.url], "shared_dir", max_completion_length=300)
    # the boundary: completions as long as the whole context leave no token for the prompt
    client = RolloutClient([fleet.b.url])
    (report,) = inspect_all(client.transport.get_url, client.transport.post_url, [fleet.b.url])
    client.close()
    errors, _ = problems_of(report, RunNeeds(max_completion_length=256))
    assert any("--max-model-len 256 leaves no room" in e for e in errors), errors
    assert not problems_of(report, RunNeeds(max_completion_length=255))[0]


@pytest.mark.slow
def test_a_generation_real_vllm_aborts_mid_answer_is_sent_again_not_returned_cut(fleet, rl_urls):
    """vLLM 0.32 answers a generation aborted mid-answer (`/pause?mode=abort`, its default pause mode) with 200, the
    tokens so far and finish_reason 'abort'. The client sends the request again (to the other server) and returns
    only whole answers: every choice `max_tokens` long (64 samples of 200 tokens), none 'abort'. The abort waits until
    vLLM reports the request running on a server (a delay from the send, as this test had, landed before it ran on a
    loaded machine); a try whose request ended before the abort is tried again."""
    import threading

    sampling = {"max_tokens": 200, "ignore_eos": True, "temperature": 1.0}  # B serves 256-token contexts
    model, sends = served_models(rl_urls[0])[0], []

    def abort_where_running():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for url in rl_urls:
                if _running(url):
                    requests.post(f"{url}/pause", params={"mode": "abort"}, timeout=30)
                    requests.post(f"{url}/resume", timeout=30)
                    return
            time.sleep(0.02)

    for _ in range(3):
        client = RolloutClient(rl_urls, request_timeout=120, generation_timeout=300, retry_after=0.5)
        before = len(sends)
        aborting = threading.Thread(target=abort_where_running)
        aborting.start()
        try:
            choices = client.complete(PROBE, 64, model, on_dispatch=lambda: sends.append(None), **sampling)
        finally:
            aborting.join()
            client.close()
        assert all(c.get("finish_reason") != "abort" and len(c["token_ids"]) == 200 for c in choices)
        if len(sends) - before >= 2:  # the abort landed mid-answer: the request was sent again
            break
    else:
        pytest.fail("in 3 tries no abort landed while the request was running")


def test_check_servers_prints_what_each_real_server_offers(fleet):
    command = [sys.executable, "-m", "trl_scale.cli", "check-servers", fleet.a.url, fleet.b.url, fleet.plain.url]
    command += ["--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {row["server"]: row for row in json.loads(done.stdout)}
    assert rows[fleet.a.url]["logprobs mode"] == "processed_logprobs"
    assert rows[fleet.b.url]["logprobs mode"] == "raw_logprobs"
    assert rows[fleet.a.url]["LoRA"] == "max rank 8" and rows[fleet.a.url]["weight transfer"] == "trl_scale_gloo"
    assert rows[fleet.plain.url]["dev mode"] == "no" and rows[fleet.plain.url]["LoRA"] == "?"
    assert rows[fleet.a.url]["max_model_len"] == "1024" and rows[fleet.a.url]["world size"] == "1"


def test_rollout_cli_checks_the_tokenizer_against_real_vllm(fleet, rl_urls, tmp_path):
    """Another model's tokenizer (a smaller vocabulary, so the vocabulary probe passes) against a real vLLM server:
    refused before generating, naming the encodings; the servers' own tokenizer evaluates."""
    other = build_tiny_model(tmp_path / "other", words=["one", "two", "three"])
    common = ["rollout", "eval", "--servers", fleet.a.url, "--dataset", "toy:counting"]
    common += ["--reward-funcs", "counting_reward", "--num-samples", "1", "--max-tokens", "2"]
    wrong = subprocess.run(
        [sys.executable, "-m", "trl_scale.cli", *common, "--tokenizer", other],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert wrong.returncode == 1 and "whose tokenizer encodes" in wrong.stderr, wrong.stderr[-2000:]
    assert "eval/reward" not in wrong.stdout
    right = subprocess.run(
        [sys.executable, "-m", "trl_scale.cli", *common, "--tokenizer", fleet.model_path],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert right.returncode == 0 and json.loads(right.stdout)["eval/num_completions"] == 64, right.stderr[-2000:]


@pytest.mark.parametrize(
    "truncation", [{"top_p": 0.8}, {"top_k": 20}, {"top_k": 20, "top_p": 0.8}], ids=["top_p", "top_k", "both"]
)
def test_log_probs_on_the_sampler_support_make_real_vllms_ratios_one(fleet, rl_urls, truncation):
    """Real vLLM samples at temperature 0.8 with top-p / top-k and reports processed (renormalised) log-probs. With
    unchanged weights, the trainer's log-probs on the sampler's support (`logprobs_on_sampler_support`) give every
    sampled token a ratio of 1 ± 1e-4; whole-vocabulary log-probs (TRL's) give the kept mass instead. Red when the
    support is not applied, or applied with another rule than vLLM's."""
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import ScoringSettings, install_packed_scoring
    from trl_scale.scoring.sampler_support import SamplerSupport

    prompt = PROBE[:6]
    body = {
        "model": served_models(fleet.a.url)[0],
        "prompt": [prompt],
        "max_tokens": 24,
        "n": 8,
        "temperature": 0.8,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "seed": 0,
        **truncation,
    }
    response = requests.post(f"{fleet.a.url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    rows = [
        ([int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]], c["logprobs"]["token_logprobs"])
        for c in response.json()["choices"]
    ]
    width = max(len(tokens) for tokens, _ in rows)
    input_ids = torch.zeros(len(rows), len(prompt) + width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    sampler = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, (tokens, logprobs) in enumerate(rows):
        input_ids[i, : len(prompt) + len(tokens)] = torch.tensor(prompt + tokens)
        attention_mask[i, : len(prompt) + len(tokens)] = 1
        sampler[i, : len(tokens)] = torch.tensor(logprobs, dtype=torch.float64)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, : len(prompt)] = -100
    mask = attention_mask[:, len(prompt) :].bool()

    def trainer_logprobs(support) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32).eval()
        add_fused_lm_head(model, temperature=0.8)
        install_packed_scoring(model, ScoringSettings(temperature=0.8, sampler_support=support))
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, len(prompt) - 1 :].double()

    support = SamplerSupport.from_sampling(truncation.get("top_k"), truncation.get("top_p"), None)
    on_support = (trainer_logprobs(support) - sampler).exp()[mask]
    whole_vocabulary = (trainer_logprobs(None) - sampler).exp()[mask]
    assert mask.sum() >= 100
    assert (on_support - 1).abs().max() <= 1e-4, (on_support - 1).abs().max()
    assert whole_vocabulary.mean() < 0.97, whole_vocabulary.mean()  # the kept mass: TRL's ratios are biased


def _stream_completion(url: str, body: dict, received: list, first_token) -> None:
    """Read a streamed completion into ``received`` ((token, sampler log-prob) pairs); set ``first_token`` once one
    has arrived (then the request is running on the server, not queued)."""
    with requests.post(f"{url}/v1/completions", json=dict(body, stream=True), stream=True, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice.get("index", 0) != 0:  # with n > 1: the first sample's tokens only
                    continue
                logprobs = choice.get("logprobs") or {}
                for token, value in zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", [])):
                    received.append((int(token.removeprefix("token_id:")), value))
            if received:
                first_token.set()


def _sync_during_a_request(url: str, body: dict, sync, after_s: float) -> list:
    """A streamed request, and ``sync()`` ``after_s`` seconds after it was sent; the request's (token, log-prob)
    pairs, every one of them (nothing lost). Not at its first streamed token: on a loaded machine vLLM's API server
    streams late (measured: the first token reached the client 2.8 s after the request, when the engine had already
    generated up to all 1000 tokens), so a sync started then came after the answer's end in every try."""
    import threading

    received, first_token = [], threading.Event()
    reader = threading.Thread(target=_stream_completion, args=(url, body, received, first_token))
    start = time.monotonic()
    reader.start()
    time.sleep(after_s)
    timings = {"after_s": after_s, "tokens_at_sync": len(received)}
    sync()
    timings["sync_done_s"] = time.monotonic() - start
    reader.join(300)
    timings["finished_s"] = time.monotonic() - start
    assert len(received) == body["max_tokens"], len(received)
    _sync_during_a_request.timings.append(timings)
    return received


_sync_during_a_request.timings = []


def _old_and_moved_weights(model_path: str, directory) -> tuple:
    """The served model (old weights) and a copy moved by noise (new weights, saved to `directory` for a sync)."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    new.save_pretrained(directory)
    return old, new


def _running(url: str) -> bool:
    """Whether vLLM reports a request running (`vllm:num_requests_running` in /metrics)."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[-1]) > 0:
            return True
    return False


def _wait_running(url: str, timeout: float) -> None:
    """Until vLLM reports a request running on `url`, at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _running(url):
        time.sleep(0.02)


def _probe_off(model, tokens: list[int], sampler: torch.Tensor) -> torch.Tensor:
    """Per token of an answer to PROBE: |the model's log-prob - the sampler's|."""
    ids = torch.tensor([PROBE + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROBE) - 1 : -1].double()
    return (logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0] - sampler).abs()


def test_a_keep_sync_lands_between_decoding_steps_of_a_running_request(fleet, rl_urls, tmp_path):
    """Syncs that do not drain (`pause_mode="keep"`), against real vLLM: a long request is running (its first
    tokens streamed back) when the sync pauses the server, loads other weights and resumes. The request is not
    waited for and not lost: it finishes with its first tokens sampled from the old weights and the rest from the
    new ones, each token's sampler log-prob that of the weights that drew it. A try whose request finished before
    the sync's pause (every token the old weights') is tried again; with "wait" every try is such a one, and the
    test fails."""

    from trl_scale.rollout.weight_sync import SyncSettings

    old, new = _old_and_moved_weights(fleet.model_path, tmp_path / "new")

    body = {
        "model": served_models(fleet.a.url)[0],
        "prompt": [PROBE],
        "max_tokens": 1000,
        # Unseeded: the sync's prefix-cache reset preempts the running samples, and vLLM 0.32's CPU worker dies
        # resuming preempted *seeded* ones ("CPU Generator does not use offset"; seen in the full suite).
        # 64 samples at once: about 7 s on an idle machine (one sample took 1.8 s, and under the suite's load its
        # whole answer once came back within 0.5 s): the sync lands long before the answer ends
        "n": 64,
        "ignore_eos": True,
        "temperature": 1.0,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }

    client = RolloutClient([fleet.a.url])
    sync = SharedDirSync(client, SyncSettings(timeout=120, pause_mode="keep"))
    try:
        # The sync must land after the first token and before the last: a try where it came before the first (every
        # token the new weights') or after the last (every token the old weights') is tried again, later or earlier.
        for attempt, after_s in enumerate((1.0, 2.0, 0.5, 3.0, 0.25, 4.0)):
            sync.reload(fleet.model_path, f"v-old-{attempt}")  # each try starts on the old weights
            received = _sync_during_a_request(
                fleet.a.url,
                body,  # no seed: vLLM 0.32's CPU engine dies resuming preempted seeded requests (below)
                lambda attempt=attempt: sync.reload(str(tmp_path / "new"), f"v-new-{attempt}"),
                after_s,
            )
            tokens = [token for token, _ in received]
            sampler = torch.tensor([value for _, value in received], dtype=torch.float64)
            off_old, off_new = _probe_off(old, tokens, sampler), _probe_off(new, tokens, sampler)
            if (off_old > 1e-4).any() and not (off_old[0] > 1e-4):
                break
        else:
            pytest.fail(
                "in 6 tries no sync landed while the request was running (each answer all old weights or all new); "
                f"timings: {_sync_during_a_request.timings[-6:]}"
            )
    finally:
        client.close()
    switch = int((off_old > 1e-4).nonzero()[0])
    assert switch >= 1, (off_old[:5], off_new[:5])  # tokens from both versions
    assert off_new[switch:].max() <= 1e-4, off_new[switch:].max()  # after the first new-weight token, only those


def test_a_partial_rollout_continues_each_cut_answer_on_the_new_weights(fleet, rl_urls, tmp_path):
    """Partial rollouts (`async_rollout_interrupt="partial"`, for servers without `keep`), against real vLLM: a sync
    pauses the server with mode=abort while 16 answers of 1000 tokens are running (it starts a delay after vLLM
    reports them running: a delay from the send landed before they ran in every try under the full suite's load,
    and 200-token answers were over before it on a loaded machine). vLLM cuts them (the tokens so far, finish_reason
    'abort'); the client continues each after the sync from where it stopped. Every answer comes back whole (1000
    tokens, none cut); a continued one is a run of tokens the old weights drew followed by a run the new weights
    drew, each token's sampler log-prob that of its weights (against a forward of each). A try whose sync came
    before or after the answers is tried again with another delay; red when the cut answers are re-sent whole
    instead (no answer holds both versions) or returned cut."""
    import threading

    from trl_scale.rollout.weight_sync import SyncSettings

    old, new = _old_and_moved_weights(fleet.model_path, tmp_path / "new")
    sampling = {"max_tokens": 1000, "ignore_eos": True, "temperature": 1.0, "logprobs": 0}
    sampling["return_tokens_as_token_ids"] = True

    client = RolloutClient([fleet.a.url], request_timeout=120, generation_timeout=300)
    sync = SharedDirSync(client, SyncSettings(timeout=120, pause_mode="abort"))
    model = served_models(fleet.a.url)[0]
    try:
        for attempt, after_s in enumerate((0.5, 1.0, 0.25, 2.0, 0.1, 3.0)):
            sync.reload(fleet.model_path, f"p-old-{attempt}")  # each try starts on the old weights
            continued = client.answers_continued

            def sync_once_running(attempt=attempt, after_s=after_s):
                _wait_running(fleet.a.url, timeout=60)
                time.sleep(after_s)
                sync.reload(str(tmp_path / "new"), f"p-new-{attempt}")

            syncing = threading.Thread(target=sync_once_running)
            syncing.start()
            try:
                choices = client.complete(PROBE, 16, model, continue_cut=True, **sampling)
            finally:
                syncing.join()
            if client.answers_continued > continued:
                break
        else:
            pytest.fail("in 6 tries no sync cut a running answer")
    finally:
        client.close()
    assert all(len(c["token_ids"]) == 1000 and c["finish_reason"] != "abort" for c in choices)
    switches = []
    for choice in choices:
        tokens = choice["token_ids"]
        sampler = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
        off_old, off_new = _probe_off(old, tokens, sampler), _probe_off(new, tokens, sampler)
        switch = int((off_old > 1e-4).nonzero()[0]) if (off_old > 1e-4).any() else len(tokens)
        assert (off_new[switch:] <= 1e-4).all(), (switch, off_new[switch:].max())  # after the cut: the new weights
        switches.append(switch)
    assert any(0 < switch < 1000 for switch in switches), switches  # continued: tokens of both versions


@pytest.mark.parametrize("interrupt", ["keep", "partial"])
def test_a_streaming_run_trains_each_token_with_the_sampler_log_prob_of_its_weights(
    fleet, rl_urls, tmp_path, interrupt
):
    """GRPO with `async_rollout_mode="streaming"` (staleness 1) against real vLLM: syncs do not wait for the
    prefetched generations, so a completion may start on one weight version and end on the next. Whatever the
    timing: each completion's tokens are a run drawn with the weights of its first version followed by a run drawn
    with the next version's (each token's sampler log-prob is that of the weights that drew it: what the correction
    uses), no completion's first token is more than one sync older than the weights it is trained against, and the
    run loses no step. Both interrupts: "keep" (running answers frozen, then go on) and "partial" (cut, then each
    continued after the sync)."""
    trainer = _trainer(
        "grpo",
        fleet.model_path,
        tmp_path,
        [fleet.a.url],
        "shared_dir",
        **_streamed_long_answers(),
        async_rollout_mode="streaming",
        async_rollout_interrupt=interrupt,
    )
    checkpoints, recorded = _record_run(trainer)
    trainer.train()
    batches = [(tensors, spans, current) for tensors, _, spans, current in recorded]
    assert trainer.state.global_step == 4 and len(batches) == 4

    from transformers import AutoModelForCausalLM

    sampler = AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32)
    for batch, spans, current in batches:
        sampled = batch["sampling_per_token_logps"]
        versions = {v for span in spans for v in span}
        off = {v: (_drawn_logprobs(sampler, checkpoints[v], batch) - sampled).abs() for v in versions}
        for row, (first, newest) in enumerate(spans):  # each prompt group its own span
            assert current - first <= 1 and first <= newest <= first + 1  # never older than k = 1
            real = batch["completion_mask"][row].bool()
            old, new = off[first][row][real], off[newest][row][real]
            switch = int((old > 1e-4).nonzero()[0]) if (old > 1e-4).any() else len(old)
            # how many rows span two versions depends on timing (the test above forces one)
            assert switch == len(old) or (new[switch:] <= 1e-4).all(), (row, switch, old, new)


@pytest.mark.slow
def test_a_lora_streaming_run_finishes_each_generation_on_the_adapter_it_started_with(fleet, rl_urls, tmp_path):
    """GRPO with `weight_sync="lora"` and streaming (staleness 1) against real vLLM: a sync loads the next adapter
    under a new name and leaves the previous one loaded, so a generation under way finishes on its adapter. Every
    completion's tokens carry the sampler log-probs of one version's adapter (first == newest, checked against a
    forward of the policy as it was at that sync), never older than one sync, and the run loses no step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = _trainer(
        "grpo",
        fleet.model_path,
        tmp_path,
        [fleet.a.url],
        "lora",
        **_streamed_long_answers(),
        peft_config=lora,
    )
    assert trainer.args.async_rollout_mode == "streaming"
    checkpoints, recorded = _record_run(trainer)
    trainer.train()
    assert trainer.state.global_step == 4 and len(recorded) == 4
    sampler = get_peft_model(AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32), lora)
    for batch, _, spans, current in recorded:
        assert all(first == newest and 0 <= current - first <= 1 for first, newest in spans), spans
        for version in {first for first, _ in spans}:
            drawn = _drawn_logprobs(sampler, checkpoints[version], batch)
            rows = [row for row, (first, _) in enumerate(spans) if first == version]
            mask = batch["completion_mask"][rows].bool()
            off = (drawn[rows] - batch["sampling_per_token_logps"][rows]).abs()[mask]
            assert off.max().item() <= 1e-4, (version, off.max().item())
    assert any(current > first for _, _, spans, current in recorded for first, _ in spans)  # trained a sync later


def test_rloo_async_against_real_vllm_is_corrected_with_the_servers_log_probs(fleet, rl_urls, tmp_path, monkeypatch):
    """RLOO with async rollout (TRL refuses nothing here; it has no correction at all): each prefetched sequence's
    advantage is weighted by exp(old_logps - the sum of real vLLM's log-probs of its tokens), truncated at 3, and
    those log-probs are the weights' it was sampled from (checked against a forward of that checkpoint)."""
    import trl

    seen = []
    score = trl.RLOOTrainer._generate_and_score_completions

    def recording(self, inputs):
        batch = score(self, inputs)
        generation = self.vllm_generation
        seen.append(
            (
                batch["advantages"].clone(),
                list(generation.steps.newest_record().sampler_logprobs),
                list(generation.steps.newest_record().version_spans),
            )
        )
        return batch

    monkeypatch.setattr(trl.RLOOTrainer, "_generate_and_score_completions", recording)
    trainer = _trainer(
        "rloo",
        fleet.model_path,
        tmp_path,
        [fleet.a.url],
        "shared_dir",
        max_steps=4,
        async_rollout_staleness=1,
        vllm_importance_sampling_mode="sequence_truncate",
    )
    checkpoints, recorded = _record_run(trainer)
    trainer.train()
    corrected = [tensors for tensors, *_ in recorded]
    assert len(seen) == len(corrected) == 4

    from transformers import AutoModelForCausalLM

    sampler_model = AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32)
    moved = 0.0
    for (advantages, sampler, spans), batch in zip(seen, corrected):
        mask = batch["completion_mask"]
        sampling = torch.zeros(mask.shape)
        for i, values in enumerate(sampler):
            sampling[i, : len(values)] = torch.tensor(values[: mask.size(1)])
        # streaming: each prompt group its own (first, newest) versions; a keep sync that lands while a group is
        # generating makes its later tokens the newer weights' (the full suite once caught such a row here)
        versions = {v for span in spans for v in span if v in checkpoints}
        off = {v: ((_drawn_logprobs(sampler_model, checkpoints[v], batch) - sampling) * mask).abs() for v in versions}
        for row, (first, newest) in enumerate(spans):
            old, new = off[first][row], off.get(newest, off[first])[row]
            switch = int((old > 1e-4).nonzero()[0]) if (old > 1e-4).any() else old.numel()
            assert (new[switch:] <= 1e-4).all(), (row, first, newest, old, new)  # the servers' log-probs: the weights
        expected = torch.exp(batch["old_logps"] - (sampling * mask).sum(1)).clamp(max=3.0)
        assert torch.allclose(batch["advantages"], advantages * expected, atol=1e-6)
        moved = max(moved, (expected - 1).abs().max().item())
    assert moved > 1e-3  # stale batches got weights other than 1


def _tokens_within_their_spans(sampler, checkpoints: dict, batches: list):
    """For each recorded batch's rows (a multi-turn conversation each): no row is older than k = 1, and every token the
    model drew (not a tool's result) has the sampler log-prob of weights within its row's (first, newest) span, to
    1e-4 (a forward of each checkpoint). Yields (batch, row, the row's drawn-token mask)."""
    for batch, _, spans, current in batches:
        tool_mask, mask = batch["tool_mask"], batch["completion_mask"].bool()
        versions = {v for first, newest in spans for v in range(first, newest + 1) if v in checkpoints}
        sampled = batch["sampling_per_token_logps"]
        off = {v: (_drawn_logprobs(sampler, checkpoints[v], batch) - sampled).abs() for v in versions}
        for row, (first, newest) in enumerate(spans):
            assert current - first <= 1 and first <= newest <= current  # never older than k = 1
            drawn = mask[row] & (tool_mask[row] == 1)
            closest = torch.stack([off[v][row] for v in range(first, newest + 1) if v in off]).min(0).values
            assert (closest[drawn] <= 1e-4).all(), (row, first, newest, closest)  # each token: weights in its span
            yield batch, row, drawn


def _requests_from_the_step(monkeypatch) -> list:
    """One entry per request TRL's generate call makes in the step (`ServerRolloutGeneration._request`): a streamed
    run's turns all come from the stream, so it stays empty."""
    from trl_scale.rollout import ServerRolloutGeneration

    made = []
    request = ServerRolloutGeneration._request
    monkeypatch.setattr(
        ServerRolloutGeneration, "_request", lambda self, *args: made.append(1) or request(self, *args)
    )
    return made


def _streamed_config(out, url: str, **overrides):
    """GRPO streamed at staleness 1 from one real vLLM server, 4 steps of groups of 4, shared-directory syncs, a
    policy that moves visibly between them."""
    import trl_scale

    settings = dict(
        max_steps=4,
        num_generations=4,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=[url],
        weight_sync="shared_dir",
        weight_sync_timeout=60,
        rollout_request_timeout=60,
        learning_rate=3e-3,
        async_rollout_staleness=1,
    )
    return trl_scale.GRPOConfig(**cpu_args(out, **{**settings, **overrides}))


def test_a_tool_using_rollout_streams_each_turn_with_its_weights(fleet, rl_urls, tmp_path, monkeypatch):
    """Multi-turn, tool-using GRPO streamed (staleness 1) against real vLLM: a conversation's turns are all generated
    in the stream (the tool called and the next turn sent as soon as the first is back; the step itself requests
    nothing), and each token's sampler log-prob is the one of weights within its conversation's recorded span
    (checked against a forward of each); tool-result tokens are masked out; no conversation is trained more than
    k = 1 syncs after its first token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl_scale
    from trl_scale.toy.tools import build_tool_calling_model, tick, tool_prompts

    in_step = _requests_from_the_step(monkeypatch)
    model_path = build_tool_calling_model(fleet.model_path, str(tmp_path / "tool-model"))
    config = _streamed_config(
        tmp_path / "run",
        fleet.a.url,
        max_completion_length=80,
        max_tool_calling_iterations=1,
        async_rollout_mode="streaming",
    )
    trainer = trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config,
        train_dataset=tool_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        tools=[tick],
    )
    checkpoints, recorded = _record_run(trainer)
    trainer.train()
    assert trainer.state.global_step == 4 and len(recorded) == 4
    assert not in_step  # every turn came from the stream
    sampler = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    called = 0
    for batch, row, drawn in _tokens_within_their_spans(sampler, checkpoints, recorded):
        holes = (batch["tool_mask"][row] == 0) & batch["completion_mask"][row].bool()
        if holes.any():
            called += 1
            assert drawn[int(holes.nonzero()[-1]) + 1 :].any()  # a turn after the tool's result
    assert called >= 4, called  # most answers called the tool (about 7 in 8 after the warm-up)
    frequencies = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
    assert frequencies and max(frequencies) > 0


def test_an_environment_episode_streams_against_real_vllm_and_a_real_openenv_server(
    fleet, rl_urls, tmp_path, monkeypatch
):
    """`environment_factory` (a client of a real OpenEnv server, `tests/openenv_counter.py`) with streaming GRPO
    against real vLLM: every episode (reset, the tool calls, `get_reward`) runs in the stream and the step requests
    nothing and calls no environment; each group is trained once; each token's sampler log-prob is the one of
    weights within its conversation's span (a forward of each, <= 1e-4); none is older than k = 1."""
    from collections import Counter

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl_scale
    from trl_scale.toy.tools import build_tool_calling_model

    from .openenv_counter import CountingClientEnvironment
    from .test_stream_environments import LEDGER, OpenEnvServer, env_prompts, recorded_openenv

    in_step = _requests_from_the_step(monkeypatch)
    trained = []

    def recorded(completion_ids, id, **kwargs):
        trained.extend(id)
        return [0.0] * len(completion_ids)

    model_path = build_tool_calling_model(fleet.model_path, str(tmp_path / "tool-model"))
    server = OpenEnvServer()
    CountingClientEnvironment.url = server.url
    LEDGER.__init__()
    config = _streamed_config(
        tmp_path / "run", fleet.a.url, max_completion_length=80, max_tool_calling_iterations=1, shuffle_dataset=False
    )
    trainer = trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=recorded,
        args=config,
        train_dataset=env_prompts(64).remove_columns("environment"),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        environment_factory=recorded_openenv(),
    )
    checkpoints, batches = _record_run(trainer)
    try:
        trainer.train()
    finally:
        server.kill()
    assert trainer.state.global_step == 4 and len(batches) == 4
    assert not in_step  # every turn came from the stream
    assert not [c for c in LEDGER.calls if c[1] == "MainThread"], "an environment call in the step"
    assert {"reset", "tick", "get_reward"} <= {name for name, _ in LEDGER.calls}
    counts = Counter(trained)
    assert set(counts.values()) == {4} and len(counts) == 4 * 8 // 4  # each group trained once, whole
    sampler = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    checked = list(_tokens_within_their_spans(sampler, checkpoints, batches))
    assert len(checked) == 4 * 8


def test_a_streamed_rollout_func_draws_each_token_with_weights_in_its_span(fleet, rl_urls, tmp_path, monkeypatch):
    """A two-turn `rollout_func` streamed (staleness 1) against real vLLM: called per prompt group in the stream's
    threads, its generation routed through the stream (the step requests nothing); each token's sampler log-prob is
    the one of weights within its group's recorded span (a forward of each), none older than k = 1; each group trained
    once."""
    from collections import Counter

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trl_scale

    from .test_stream_rollout_func import TwoTurns, hashed_dataset

    in_step = _requests_from_the_step(monkeypatch)
    trained = []

    def recorded(completion_ids, id, **kwargs):
        trained.extend(id)
        return token_parity_reward(completion_ids)

    rollout = TwoTurns(hold=set())
    config = _streamed_config(tmp_path / "run", fleet.a.url, max_completion_length=8, shuffle_dataset=False)
    trainer = trl_scale.GRPOTrainer(
        model=fleet.model_path,
        reward_funcs=recorded,
        args=config,
        train_dataset=hashed_dataset(),
        processing_class=AutoTokenizer.from_pretrained(fleet.model_path),
        rollout_func=rollout,
    )
    checkpoints, batches = _record_run(trainer)
    trainer.train()
    rollout.stop.set()
    assert trainer.state.global_step == 4 and len(batches) == 4
    assert not in_step and {thread.split("_")[0] for thread, _ in rollout.calls} == {"stream"}
    counts = Counter(trained)
    assert set(counts.values()) == {4} and len(counts) == 4 * 8 // 4  # each group trained once, whole
    sampler = AutoModelForCausalLM.from_pretrained(fleet.model_path, dtype=torch.float32)
    assert len(list(_tokens_within_their_spans(sampler, checkpoints, batches))) == 4 * 8


def _hold_requests_until_the_next_sync(trainer, monkeypatch) -> None:
    """The order in which a streaming sync lands inside a running request, forced. Left alone, the stream sends a
    batch's requests right after a sync, and on an idle machine they end before the next sync's pause (generation
    outruns a step). Here a request sent after the second sync waits until the next sync is about to pause the
    servers (after it wrote the weights), and the pause waits until a request it released has begun (its POST under
    way, its start on the timeline): its 160 tokens (half a second or more) take far longer than the few milliseconds
    between. (Waiting for any request out, as before, lost under load: one that was finishing counted, ended before
    the resume, and the released ones began after the pause.)"""
    import threading

    from trl_scale.rollout.weight_sync.base import WeightSyncMode

    generation, paused = trainer.vllm_generation, threading.Condition()
    engine, transport = generation.ahead.engine, generation.client.transport
    send, pause, request = engine.send, WeightSyncMode._pause, transport._request
    pausing, held, begun = [0], [0], [0]  # the sync whose pause was called; sends held now; completions begun

    def held_send(*args, **kwargs):
        sent_at = generation.sync_count  # the first sync's two batches (step 1 waits on them) and the last run freely
        if sent_at in (2, 3):
            with paused:
                held[0] += 1
                paused.wait_for(lambda: pausing[0] > sent_at, timeout=120)
                held[0] -= 1
        return send(*args, **kwargs)

    def begin(method, url, *args, **kwargs):
        if method == "POST" and url.endswith("/v1/completions"):
            with paused:
                begun[0] += 1
                paused.notify_all()
        return request(method, url, *args, **kwargs)

    def pause_inside_a_request(mode, server) -> None:
        with paused:
            pausing[0] = generation.sync_count + 1
            releasing, before = held[0], begun[0]
            paused.notify_all()
            if releasing:  # until a request it released has begun (after this point: a new request)
                paused.wait_for(lambda: begun[0] > before, timeout=60)
        pause(mode, server)

    engine.send = held_send
    monkeypatch.setattr(transport, "_request", begin)
    monkeypatch.setattr(WeightSyncMode, "_pause", pause_inside_a_request)


def test_a_streaming_runs_timeline_shows_syncs_landing_inside_running_requests(fleet, rl_urls, tmp_path, monkeypatch):
    """`rollout_timeline` on GRPO streamed over both real vLLM servers (staleness 1, answers that outlast a step):
    the trace accounts for each step (its trainer lanes sum to the step's wall time, measured apart, within 5 %),
    each server's lane holds its requests and each sync's calls (pause, weight load, resume), and syncs land inside
    requests still running on that server (begun before the pause, ended after the resume); the PNG is drawn. The
    order is forced (`_hold_requests_until_the_next_sync`): on an idle machine every answer ended before the next
    sync's pause, and the test failed."""
    import json

    from .test_timeline import StepEnds, check_trace_accounts_for_steps

    answers = {**_streamed_long_answers(), "max_completion_length": 160}  # outlasts a pause
    trainer = _trainer(
        "grpo", fleet.model_path, tmp_path, rl_urls, "shared_dir", **answers,
        async_rollout_mode="streaming", rollout_timeline=True,
    )  # fmt: skip
    _hold_requests_until_the_next_sync(trainer, monkeypatch)
    ends = StepEnds()
    trainer.add_callback(ends)
    trainer.train()
    recorded = check_trace_accounts_for_steps(tmp_path, ends.ends, 4)
    assert all(step["lanes"].get("weight sync", 0) > 0 for step in recorded)
    events = json.loads((tmp_path / "timeline" / "trace.json").read_text())["traceEvents"]
    servers = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    begun = {e["id"]: e for e in events if e["ph"] == "b"}
    calls: dict[str, dict[str, list[tuple[float, float]]]] = {url: {} for url in rl_urls}
    for end in (e for e in events if e["ph"] == "e"):
        begin = begun[end["id"]]
        calls[servers[begin["pid"]]].setdefault(begin["cat"], []).append((begin["ts"], end["ts"]))
    inside = 0
    for url, by_name in calls.items():
        assert by_name.get("request") and by_name.get("pause") and by_name.get("resume"), (url, list(by_name))
        assert by_name.get("collective_rpc"), (url, list(by_name))  # shared_dir: the reload of the new weights
        pauses, resumes = sorted(by_name["pause"]), sorted(by_name["resume"])
        assert len(pauses) == len(resumes) == 4  # one sync per step
        for (pause, _), (_, resumed) in zip(pauses, resumes):
            assert pause < resumed
            inside += any(start < pause and end > resumed for start, end in by_name["request"])
    assert inside >= 1, calls  # a sync landed inside a running request


@pytest.mark.slow
def test_a_held_adapter_is_read_again_from_its_directory(fleet, rl_urls, tmp_path):
    """What lost server A in a CI run, forced: vLLM holds one adapter in memory (`--max-cpu-loras` defaults to
    `--max-loras`, 1), so loading the next evicts it, and a request naming it reads it again from its directory. A
    streaming LoRA sync keeps the previous adapter loaded for the generations still on it (`keep_adapters`), and
    deleted its directory: the next request naming it killed the engine ("No adapter found"), the server exited.
    Now the directory stays while the adapter is loaded: the request is answered with that adapter's numbers (the
    prompt log-probs read right after its load), and the directory goes with the unload one sync later."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_scale.rollout.client import VERSION_PREFIX
    from trl_scale.rollout.generation import adapter_state_dict
    from trl_scale.rollout.weight_dir import WeightDirectory
    from trl_scale.rollout.weight_sync.base import PolicyWeights, SyncSettings
    from trl_scale.rollout.weight_sync.lora import LoraSync

    url = fleet.a.url
    client = RolloutClient([url], request_timeout=60)
    weight_dir = WeightDirectory(str(tmp_path / "adapters"), "held")
    sync = LoraSync(client, SyncSettings(timeout=60, weight_dir=weight_dir, keep_adapters=1))
    names, right_after_load = [f"{VERSION_PREFIX}held-{i}" for i in (1, 2, 3)], {}
    try:
        for seed, name in enumerate(names):
            torch.manual_seed(seed)
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            model = get_peft_model(AutoModelForCausalLM.from_pretrained(fleet.model_path), lora)
            adapter = (adapter_state_dict(model), model.peft_config["default"])
            sync.sync(PolicyWeights(named_tensors=lambda: iter(()), metadata=list, adapter=lambda a=adapter: a), name)
            right_after_load[name] = prompt_logprobs(url, PROBE, name)
            if name == names[1]:  # names[0] still loaded, evicted from vLLM's memory by names[1]
                assert served_models(url)[1:] == names[:2]
                again = prompt_logprobs(url, PROBE, names[0])  # read again from its directory
                assert max(abs(a - b) for a, b in zip(again, right_after_load[names[0]])) < 1e-4
                assert max(abs(a - b) for a, b in zip(again, right_after_load[names[1]])) > 1e-3
        assert served_models(url)[1:] == names[1:]
        assert sorted(p.name for p in (tmp_path / "adapters").glob("*/*")) == names[1:]  # names[0]'s went with it
        assert requests.get(f"{url}/health", timeout=10).ok
    finally:
        sync.close()
        client.close()


VLLM_ENVIRONMENT_RUN = """
import json, sys
from trl.import_utils import is_vllm_available
import trl_scale
from trl_scale.toy import counting_prompts
from tests.helpers import cpu_args, token_parity_reward

model, url, out = sys.argv[1:4]
assert is_vllm_available()
config = trl_scale.GRPOConfig(**cpu_args(
    out, max_steps=2, num_generations=4, max_completion_length=6, use_vllm=True, vllm_mode="server",
    vllm_server_base_url=url, weight_sync="shared_dir", async_rollout_staleness=1, stream_rewards=True,
    rollout_timeline=True, weight_sync_timeout=60, rollout_request_timeout=60))
trainer = trl_scale.GRPOTrainer(
    model=model, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(32))
trainer.train()
logs = [entry for entry in trainer.state.log_history if "loss" in entry]
print(json.dumps({"client": type(trainer.vllm_generation).__module__, "keys": sorted(logs[-1]), "steps": len(logs)}))
"""


def test_trls_single_url_in_a_trainer_with_vllm_installed_streams_through_trl_scales_client(fleet, rl_urls, tmp_path):
    """The configuration a GPU user runs: the trainer's environment has vLLM (`.venv-vllm`), one server by TRL's own
    `vllm_server_base_url`, and trl-scale's settings (staleness 1, rewards in the stream, the timeline). trl-scale's
    client serves it, a fleet of one (before, TRL's client took it and those settings did nothing)."""
    from .helpers import ROOT
    from .real_vllm import VLLM_PYTHON

    run = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_ENVIRONMENT_RUN, fleet.model_path, rl_urls[0], str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=subprocess_env(),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["client"].startswith("trl_scale.") and result["steps"] == 2, result
    assert "rollout/stream_groups_generating" in result["keys"], " ".join(result["keys"])
    assert (tmp_path / "timeline" / "timeline.png").stat().st_size > 0
