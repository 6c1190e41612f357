"""Rollout over real `trl-scale serve` processes on 127.0.0.1: the API, GRPO training with weight sync,
load-aware routing, failover, and bounded failures. Every wait has a timeout."""

import json
import os
import re
import tempfile
import threading
import time

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import trl_scale
from trl_scale.rollout import RolloutClient, RolloutError
from trl_scale.rollout.weight_sync import SharedDirSync, SyncSettings
from trl_scale.routing import LatencyRouting
from trl_scale.toy import build_tiny_model, counting_prompts

from .helpers import (
    black_hole_server,
    cpu_args,
    free_port,
    group_sync,
    push,
    push_weights,
    reload_checkpoint,
    server_grpo,
    server_rloo_or_ppo,
    start_servers,
    token_parity_reward,
)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_server_speaks_vllm_completion_shapes_and_rejects_bad_requests(servers, tiny_llama):
    url = servers[0].url
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": [[432, 375], [380]], "n": 3, "max_tokens": 4, "logprobs": 0}
    body["return_tokens_as_token_ids"] = True  # as TRL sends it
    choices = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    assert len(choices) == 6
    assert [c["prompt_token_ids"] for c in choices[::3]] == [[432, 375], [380]]  # prompt-major
    for choice in choices:
        assert 1 <= len(choice["token_ids"]) <= 4
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    bad = [
        ({"prompt": [[10**6]]}, 400, "outside"),
        ({"prompt": []}, 400, "empty"),
        ({"prompt": [[1, 2]], "n": 0}, 422, "n"),
        ({"prompt": [[1, 2]], "model": "other"}, 404, "not served"),
    ]
    for request, status, message in bad:
        response = requests.post(f"{url}/v1/completions", json=request, timeout=30)
        assert response.status_code == status and message in response.text, (request, response.text)
    # vLLM's default: logprobs.tokens are the decoded tokens (completion/serving.py:668-687)
    body = {"model": model, "prompt": [[432, 375]], "max_tokens": 3, "logprobs": 0, "temperature": 0.0}
    (choice,) = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in choice["token_ids"]]
    # no route takes weights in a body: a binary /update_weights is vLLM's 400 (dev/rlhf/api_router.py:186-201)
    response = requests.post(f"{url}/update_weights", data=b"\x00safetensors", timeout=30)
    assert response.status_code == 400 and "Invalid JSON format" in response.text


def test_server_answers_openai_clients_usage_chat_and_what_it_refuses(servers, tiny_llama):
    """What the official `openai` client reads: `usage`, chat completions; `stream=True` and a request beyond the
    context are a 400 that says why (vLLM answers the latter with 400 too), never a silent empty answer."""
    url = servers[0].url
    body = {"prompt": [[432, 375, 380]], "n": 2, "max_tokens": 3, "temperature": 0.0}
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60).json()
    completion_tokens = sum(len(c["token_ids"]) for c in answer["choices"])
    assert answer["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": completion_tokens,
        "total_tokens": 3 + completion_tokens,
    }
    chat = {"messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4, "temperature": 0.0}
    answer = requests.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    (choice,) = answer["choices"]
    assert answer["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert choice["message"]["content"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert answer["usage"]["completion_tokens"] == len(choice["token_ids"])
    context = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    refused = [
        ({**body, "stream": True}, "/v1/completions", "does not stream"),
        ({**chat, "stream": True}, "/v1/chat/completions", "does not stream"),
        ({"prompt": [[432] * (context - 2)], "max_tokens": 3}, "/v1/completions", "maximum context length"),
    ]
    for request, route, message in refused:
        response = requests.post(f"{url}{route}", json=request, timeout=30)
        assert response.status_code == 400 and message in response.text, (route, response.text)


def test_serving_a_reward_model_checkpoint_is_refused(tmp_path):
    """A sequence-classification checkpoint has no LM head: transformers would make a random one."""
    from trl_scale.serve import create_app
    from trl_scale.toy import build_tiny_model

    path = build_tiny_model(tmp_path / "reward", kind="reward")
    with pytest.raises(ValueError, match=r"is not a causal LM checkpoint.*Fix: serve the policy"):
        create_app(path)


def test_bearer_token_is_enforced(tiny_llama):
    (server,) = start_servers(tiny_llama, 1, ("--api-key", "s3cret"))
    try:
        assert requests.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        ok = requests.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert ok.status_code == 200
        client = RolloutClient([server.url], api_key="s3cret", request_timeout=30)
        assert client.generate([[432]], max_tokens=2)[0][0]["token_ids"]
    finally:
        server.stop()


@pytest.mark.parametrize("weight_sync", ["auto", "shared_dir"])
def test_grpo_trains_on_servers_and_their_weights_follow_the_policy(servers, tiny_llama, tmp_path, weight_sync):
    trainer = server_grpo(
        tiny_llama, tmp_path, [s.url for s in servers], weight_sync=weight_sync, weight_sync_dir=str(tmp_path / "sync")
    )
    trainer.train()
    assert trainer.state.global_step == 3
    assert trainer.vllm_generation.sync_count == 3  # before each step's generation
    assert trainer.vllm_generation.syncer.name == {"auto": "nccl", "shared_dir": "shared_dir"}[weight_sync]
    served = {s.url: s.served for s in trainer.vllm_generation.client.servers}
    assert all(count > 0 for count in served.values()), served  # both servers did work
    trainer.vllm_generation.sync_weights()  # push the final weights, then compare log-probs
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if weight_sync == "shared_dir":  # a directory the user gave is theirs: kept
        assert os.listdir(tmp_path / "sync")
    prompt = [432, 375, 373]
    for server in servers:
        choice = requests.post(
            f"{server.url}/v1/completions",
            json={"prompt": [prompt], "max_tokens": 5, "logprobs": 0, "temperature": 1.0, "seed": 0},
            timeout=60,
        ).json()["choices"][0]
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        ours = logits.log_softmax(-1).gather(1, torch.tensor(choice["token_ids"]).unsqueeze(1)).squeeze(1)
        theirs = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_router_sends_less_work_to_a_slow_server(tiny_llama):
    fast, slow = start_servers(tiny_llama, 2, (), ("--token-delay", "0.05"))
    try:
        client = RolloutClient([fast.url, slow.url], request_timeout=60, max_inflight_per_server=1)
        client.generate([[432, 375]] * 24, max_tokens=4)
        served = {s.url: s.served for s in client.servers}
        assert served[fast.url] > 2 * served[slow.url], served
    finally:
        fast.stop()
        slow.stop()


def test_a_server_measured_slow_is_tried_again_once_its_estimate_is_old():
    """A server measured slow gets no request while a faster one is free, so its estimate would never be renewed: a
    server slow for a while (the chaos run's slow spell) would idle for the rest of the run. After LATENCY_MEMORY
    seconds unrenewed the estimate is forgotten: the next request goes to it first, and what it then takes is its
    new estimate (not averaged with the forgotten one)."""
    client = RolloutClient(["http://127.0.0.1:1", "http://127.0.0.1:2"], request_timeout=1)
    fast, slow = client.servers
    now = time.monotonic()
    fast.latency, fast.measured_at = 0.1, now
    slow.latency, slow.measured_at = 5.0, now
    picked = client._acquire(set(), now + 1)
    client._release(picked, ok=True)
    assert picked is fast  # while its estimate is fresh, the slow server waits
    slow.measured_at = now - LatencyRouting.LATENCY_MEMORY - 1
    picked = client._acquire(set(), now + 1)
    assert picked is slow
    client._release(picked, ok=True, seconds=0.2)
    assert slow.latency == 0.2 and slow.measured_at >= now  # measured anew
    client._release(client._acquire({fast.url}, now + 1), ok=True, seconds=0.4)
    assert abs(slow.latency - (0.7 * 0.2 + 0.3 * 0.4)) < 1e-12  # a fresh estimate is averaged


def test_killing_a_server_mid_run_loses_no_step(tiny_llama, tmp_path):
    survivor, victim = start_servers(tiny_llama, 2)

    class KillAtStep2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                victim.stop()

    try:
        trainer = server_grpo(tiny_llama, tmp_path, [survivor.url, victim.url], max_steps=4)
        trainer.add_callback(KillAtStep2())
        trainer.train()
        assert trainer.state.global_step == 4
        assert len([e for e in trainer.state.log_history if "loss" in e]) == 4
    finally:
        survivor.stop()
        if victim.process.poll() is None:
            victim.stop()


def test_all_servers_down_is_a_clear_error_within_the_timeout():
    client = RolloutClient(
        [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], request_timeout=3, retry_after=0.5
    )
    start = time.monotonic()
    with pytest.raises(
        RolloutError, match="no rollout server answered: none took the request within rollout_request_timeout=3s"
    ):
        client.generate([[1, 2, 3]], max_tokens=2)
    assert time.monotonic() - start < 10


def test_hung_and_dead_servers_are_waited_on_retried_and_give_up_within_the_timeout():
    """One server refuses connections, the other accepts and never answers: the client waits on the hung one (for
    at most the generation timeout), retries, and fails with the clear error, all within a bounded time."""
    with black_hole_server() as (hung, accepted):
        client = RolloutClient(
            [f"http://127.0.0.1:{free_port()}", hung], request_timeout=4, retry_after=0.5, generation_timeout=3
        )
        start = time.monotonic()
        with pytest.raises(RolloutError, match="no rollout server answered: .*rollout_generation_timeout: 3s"):
            client.generate([[1, 2, 3]], max_tokens=2)
        elapsed = time.monotonic() - start
        assert len(accepted) >= 1  # the hung server was really tried (a refused connection is never accepted)
    assert 3 <= elapsed < 12  # waited out the hung server, then gave up within a bounded time


def test_stalled_weight_sync_fails_within_the_timeout(tmp_path):
    # A server that accepts connections and never answers: the classic hung weight sync.
    with black_hole_server() as (hung, accepted):
        client = RolloutClient([hung], request_timeout=5)
        start = time.monotonic()
        with pytest.raises(RolloutError, match="weight_sync_timeout=2"):
            SharedDirSync(client, SyncSettings(timeout=2)).reload(str(tmp_path), "v1")
        assert time.monotonic() - start < 10 and accepted


def test_a_server_that_missed_a_sync_leaves_the_rotation(servers, tiny_llama):
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([servers[0].url, dead], request_timeout=30, retry_after=60)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    sync = group_sync(client, timeout=30)
    version = push(sync, dict(model.state_dict()))  # one server takes it, the dead one cannot
    sync.close()
    assert {s.url: s.version == version for s in client.servers} == {servers[0].url: True, dead: False}
    client.generate([[432]] * 4, max_tokens=2)
    assert {s.url: s.served for s in client.servers}[dead] == 0


@pytest.mark.parametrize("method", ["rloo", "ppo"])
def test_rloo_and_ppo_roll_out_on_the_servers(servers, tiny_llama, tmp_path, method):
    trainer = server_rloo_or_ppo(method, tiny_llama, tmp_path, [s.url for s in servers])
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.vllm_generation.sync_count >= 1
    # RLOO: one request per prompt (its 4 completions batched with n); PPO: one per completion. PPO (4 epochs by
    # default) rolls out once in these 2 steps.
    served = sum(s.served for s in trainer.vllm_generation.client.servers)
    assert served == {"rloo": 2 * 8 // 4, "ppo": 8}[method], served


def test_rejection_sampling_keeps_the_best_per_prompt(servers, tiny_llama, tmp_path):
    from trl_scale.cli import main
    from trl_scale.rollout.modes import evaluate, rejection_sample

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    client = RolloutClient([s.url for s in servers], request_timeout=60)
    dataset = counting_prompts(6, seed=1)

    def first_token_odd(completion_ids, **kwargs):
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    def length_bonus(completion_ids, **kwargs):
        return [len(ids) / 100 for ids in completion_ids]

    kept = rejection_sample(
        client, dataset, [first_token_odd, length_bonus], tokenizer, num_samples=4, keep_top_k=2, max_tokens=4
    )
    assert len(kept) == 12 and set(kept["prompt"]) == set(dataset["prompt"])
    for row in kept:  # the stored reward is the reward functions', recomputed on the kept text
        ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        assert row["reward"] == pytest.approx(row["reward/first_token_odd"] + row["reward/length_bonus"])
        assert row["reward/first_token_odd"] in (0.0, 1.0) and ids
    metrics = evaluate(client, dataset, [first_token_odd], tokenizer, num_samples=4, max_tokens=4)
    assert 0.0 <= metrics["eval/reward"] <= 1.0 and metrics["eval/num_completions"] == 24
    assert metrics["eval/pass@4"] >= metrics["eval/reward"] - 1e-9
    output = tmp_path / "kept.jsonl"
    argv = [
        "rollout",
        "rejection-sample",
        "--servers",
        servers[0].url,
        "--tokenizer",
        tiny_llama,
        "--dataset",
        "toy:counting",
        "--reward-funcs",
        "counting_reward",
        "--num-samples",
        "2",
        "--max-tokens",
        "4",
        "--output",
        str(output),
    ]
    assert main(argv) == 0 and len(output.read_text().splitlines()) == 64


def test_rejection_sampling_selects_the_top_k_and_applies_the_threshold(tiny_llama):
    from datasets import Dataset

    from trl_scale.rollout.modes import rejection_sample

    class FakeClient:  # completions with known token ids: reward = first id / 10
        def generate(self, prompts, n=1, **sampling):
            return [[{"token_ids": [t]} for t in (3, 9, 1, 7)] for _ in prompts]

    def first_id(completion_ids, **kwargs):
        return [ids[0] / 10 for ids in completion_ids]

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    dataset = Dataset.from_list([{"prompt": "one"}, {"prompt": "two"}])
    kept = rejection_sample(FakeClient(), dataset, [first_id], tokenizer, num_samples=4, keep_top_k=2)
    assert kept["reward"] == [0.9, 0.7, 0.9, 0.7]
    kept = rejection_sample(FakeClient(), dataset, [first_id], tokenizer, num_samples=4, keep_top_k=3, min_reward=0.5)
    assert kept["reward"] == [0.9, 0.7, 0.9, 0.7]
    with pytest.raises(ValueError, match="keep_top_k"):
        rejection_sample(FakeClient(), dataset, [first_id], tokenizer, num_samples=4, keep_top_k=5)


def test_lora_weight_sync_serves_the_trained_adapter(servers, tiny_llama, tmp_path):
    from peft import LoraConfig

    # LoRA sync ships only the adapter: the server's base must be the policy's base. Earlier tests may have synced
    # other weights into this shared server, so put the base back first.
    base = AutoModelForCausalLM.from_pretrained(tiny_llama)
    push_weights([servers[0].url], dict(base.state_dict()))

    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(
            **cpu_args(
                tmp_path,
                num_generations=4,
                max_completion_length=6,
                max_steps=2,
                use_vllm=True,
                vllm_mode="server",
                vllm_server_base_urls=[servers[0].url],
                weight_sync="lora",
                weight_sync_dir=str(tmp_path / "adapters"),
                learning_rate=5e-2,
            )
        ),
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    trainer.vllm_generation.sync_weights()
    name = trainer.vllm_generation.syncer.lora_name
    assert name in [m["id"] for m in requests.get(f"{servers[0].url}/v1/models", timeout=10).json()["data"]]
    prompt = [432, 375, 373]
    choice = requests.post(
        f"{servers[0].url}/v1/completions",
        json={"model": name, "prompt": [prompt], "max_tokens": 5, "logprobs": 0, "seed": 0},
        timeout=60,
    ).json()["choices"][0]
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    ours = logits.log_softmax(-1).gather(1, torch.tensor(choice["token_ids"]).unsqueeze(1)).squeeze(1)
    assert (ours - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max().item() <= 1e-4

    # With the adapter loaded, a full-weight update still reaches the base (its layers are now `base_layer`s):
    # the base model's requests then see the new weights.
    def base_logprobs():
        body = {"prompt": [prompt], "max_tokens": 3, "logprobs": 0, "seed": 0, "temperature": 0.0}
        body["model"] = requests.get(f"{servers[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        return requests.post(f"{servers[0].url}/v1/completions", json=body, timeout=60).json()["choices"][0]

    before = base_logprobs()
    changed = {k: v + 0.05 * torch.randn_like(v) for k, v in base.state_dict().items() if "q_proj" in k}
    push_weights([servers[0].url], changed)
    after = base_logprobs()
    assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    push_weights([servers[0].url], dict(base.state_dict()))
    assert base_logprobs() == before


def test_evaluate_reports_exact_metrics(tiny_llama):
    """Known completions, known rewards: every eval metric has one right value."""
    from datasets import Dataset

    from trl_scale.rollout.modes import evaluate

    class FakeClient:  # prompt i gets completions whose first token ids give rewards below
        def generate(self, prompts, n=1, **sampling):
            table = {0: (3, 9, 1, 7), 1: (2, 4, 6, 8)}
            return [[{"token_ids": [t]} for t in table[i]] for i in range(len(prompts))]

    def first_id(completion_ids, **kwargs):
        return [ids[0] / 10 for ids in completion_ids]

    def is_odd(completion_ids, **kwargs):
        return [float(ids[0] % 2) for ids in completion_ids]

    dataset = Dataset.from_list([{"prompt": "one"}, {"prompt": "two"}])
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    metrics = evaluate(FakeClient(), dataset, [first_id, is_odd], tokenizer, num_samples=4, success_threshold=1.5)
    totals = [0.3 + 1, 0.9 + 1, 0.1 + 1, 0.7 + 1, 0.2, 0.4, 0.6, 0.8]
    mean = sum(totals) / 8
    assert metrics["eval/num_completions"] == 8.0
    assert metrics["eval/reward"] == pytest.approx(mean)
    assert metrics["eval/reward_std"] == pytest.approx((sum((t - mean) ** 2 for t in totals) / 8) ** 0.5)
    assert metrics["eval/rewards/first_id"] == pytest.approx(0.5)
    assert metrics["eval/rewards/is_odd"] == pytest.approx(0.5)
    assert metrics["eval/pass@4"] == pytest.approx(0.5)  # prompt 0 reaches 1.9 >= 1.5; prompt 1 tops at 0.8


def test_a_generation_longer_than_the_request_timeout_completes_on_a_healthy_server(tiny_llama):
    """Waiting for a server (rollout_request_timeout) and generating (rollout_generation_timeout) are bounded apart:
    a healthy server that takes 2 s or more to generate is not cut off by a 1.5 s request timeout (the old single
    timeout cut it off, vLLM aborted the request and every failover timed out the same way), and a generation
    timeout shorter than the generation does fail, naming both timeouts."""
    (server,) = start_servers(tiny_llama, 1, ("--token-delay", "1.0"))  # held 1 s x tokens x n per request
    try:
        client = RolloutClient([server.url], request_timeout=1.5, generation_timeout=30)
        start = time.monotonic()
        (choices,) = client.generate([[5, 6, 7]], n=2, max_tokens=2, temperature=1.0)
        assert len(choices) == 2 and all(c["token_ids"] for c in choices)
        assert time.monotonic() - start >= 2.0  # at least 1 token x 2 completions x 1 s: over the request timeout
        hasty = RolloutClient([server.url], request_timeout=1.5, generation_timeout=1.0)
        with pytest.raises(RolloutError, match=r"rollout_request_timeout=1.5s .*rollout_generation_timeout: 1s"):
            hasty.generate([[5, 6, 7]], n=2, max_tokens=2, temperature=1.0)
    finally:
        server.stop()


@pytest.mark.parametrize("weight_sync", ["shared_dir", "lora"])
def test_a_sync_without_a_directory_leaves_no_copy_of_the_weights(servers, tiny_llama, tmp_path, weight_sync):
    """shared_dir writes the model, lora the adapter, into a temporary directory: removed at the end of train()."""
    from peft import LoraConfig

    peft = {"peft_config": LoraConfig(r=4, target_modules=["q_proj", "v_proj"])} if weight_sync == "lora" else {}
    reload_checkpoint([s.url for s in servers], tiny_llama)  # the base a LoRA adapter lands on
    trainer = server_grpo(tiny_llama, tmp_path, [s.url for s in servers], weight_sync=weight_sync, max_steps=2, **peft)
    made = []
    mode = trainer.vllm_generation.syncer.mode
    sync = mode.sync

    def recording(weights, version):
        sync(weights, version)
        made.append(trainer.vllm_generation.syncer.weight_dir.root)

    mode.sync = recording
    trainer.train()
    assert len(made) == 2 and made[0] == made[1] and made[0].startswith(tempfile.gettempdir())
    assert not os.path.exists(made[0])  # removed at the end of train()


def _rollout_cli(*argv) -> tuple[int, float]:
    from trl_scale.cli import main

    began = time.monotonic()
    try:
        code = main(["rollout", *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    return code, time.monotonic() - began


def test_rollout_cli_refuses_another_models_tokenizer_before_generating(servers, tiny_llama, tmp_path, capsys):
    """A tokenizer of another model printed "eval/reward": 0.0 without a word; now the servers' encoding of a probe
    text is compared with the tokenizer's first."""
    other = build_tiny_model(tmp_path / "other", words=["one", "two", "three"])
    common = ["--servers", servers[0].url, "--dataset", "toy:counting", "--reward-funcs", "counting_reward"]
    common += ["--num-samples", "2", "--max-tokens", "4"]
    code, _ = _rollout_cli("eval", "--tokenizer", other, *common)
    out, err = capsys.readouterr()
    assert code == 1 and "eval/reward" not in out, (out, err)
    assert re.search(r"whose tokenizer encodes .* as \[.*\], this tokenizer as \[.*\].*Fix: pass the tokenizer", err)
    code, _ = _rollout_cli("eval", "--tokenizer", tiny_llama, *common)
    assert code == 0 and json.loads(capsys.readouterr().out)["eval/num_completions"] == 128


@pytest.mark.parametrize(
    "argv, code, match",
    [
        (["--num-samples", "0"], 2, r"--num-samples 0: use a whole number >= 1"),
        (["--num-samples", "2", "--keep-top-k", "3"], 2, r"--keep-top-k 3: use 1 to --num-samples \(2\)"),
        (["--no-output"], 2, r"rejection-sample needs --output FILE.jsonl"),
        (["--request-timeout", "0"], 2, r"--request-timeout 0: use a positive number of seconds"),
        (["--servers", "127.0.0.1:{port}"], 2, r"--servers entry '127.0.0.1:\d+' is not a server URL. Fix: use http"),
        (["--servers", "http://127.0.0.1:{port}"], 1, r"connection refused: nothing listens there"),
    ],
    ids=["num-samples", "keep-top-k", "no-output", "timeout", "no-scheme", "refused"],
)
def test_rollout_cli_answers_bad_flags_and_dead_servers_at_once(argv, code, match, tiny_llama, tmp_path, capsys):
    """Each was a traceback blaming the server's 422, 64 completions written nowhere, or a wait of 124-184 s."""
    from .helpers import free_port

    flags = ["--tokenizer", tiny_llama, "--dataset", "toy:counting", "--reward-funcs", "counting_reward"]
    flags += ["--servers", "http://127.0.0.1:9"] if "--servers" not in argv else []
    flags += ["--output", str(tmp_path / "kept.jsonl")] if "--no-output" not in argv else []
    argv = [a.format(port=free_port()) for a in argv if a != "--no-output"]
    got, seconds = _rollout_cli("rejection-sample", *flags, *argv)
    err = capsys.readouterr().err
    assert got == code and re.search(match, err), err[-800:]
    assert seconds < 30 and "Traceback" not in err and "left the rotation" not in err
    assert not (tmp_path / "kept.jsonl").exists()


MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 256}]}).encode()


@pytest.mark.parametrize("status", [500, 502, 503, 408, 429])
def test_a_server_answering_a_retryable_status_is_failed_over(status, servers):
    """5xx (a server fault) and 408/429 ("try again") send the request to another server; the one that answered
    leaves the rotation for a while."""
    from .helpers import hits, plain_http_server

    with plain_http_server(
        routes={"/v1/models": (200, MODELS), "/v1/completions": (status, b'{"error": "busy"}')}
    ) as bad:
        client = RolloutClient([bad, servers[0].url], request_timeout=30, max_inflight_per_server=4)
        results = client.generate([[432, 375]] * 6, max_tokens=2)
        client.close()
    assert len(results) == 6 and all(choice["token_ids"] for choices in results for choice in choices)
    assert hits(bad).count("/v1/completions") >= 1  # it was asked, and its answer was not final
    assert {s.url: s.served for s in client.servers}[servers[0].url] == 6


def test_a_generation_the_server_aborted_is_sent_again_not_trained_on(servers):
    """vLLM answers an aborted generation (`/pause?mode=abort`, its default pause; `/abort_requests`) with 200, the
    tokens so far and finish_reason 'abort': a cut-off answer. The client sends the request again (here to the other
    server) and returns whole answers only."""
    from .helpers import hits, plain_http_server

    cut = {"index": 0, "text": "a", "token_ids": [7], "finish_reason": "abort", "logprobs": None}
    aborted = json.dumps({"choices": [cut, {**cut, "index": 1, "finish_reason": "length"}]}).encode()
    with plain_http_server(routes={"/v1/models": (200, MODELS), "/v1/completions": (200, aborted)}) as bad:
        client = RolloutClient([bad, servers[0].url], request_timeout=30)
        choices = client.complete([432, 375], n=2, max_tokens=3)
        client.close()
    assert hits(bad).count("/v1/completions") >= 1
    # whole: the 3 tokens asked for, or fewer ended by the model's EOS (a sampled answer may end early)
    whole = [len(c["token_ids"]) == 3 or c["finish_reason"] == "stop" for c in choices]
    assert len(choices) == 2 and all(c["finish_reason"] != "abort" for c in choices) and all(whole), choices


def test_with_continue_cut_a_cut_answer_is_continued_from_where_it_stopped(servers):
    """Partial rollout (`continue_cut`, what `async_rollout_interrupt="partial"` sends with): a choice the server
    cut is not sent again whole but continued — its tokens so far become the next request's prompt, within what is
    left of `max_tokens`, and the parts are joined with their own log-probs. Here a stand-in cuts every answer after
    one token (7, log-prob -0.5); continued on it or on the `trl-scale serve` beside it, each answer starts with that
    token and its log-prob and ends whole (3 tokens, one log-prob each), and the continuation's prompt held the cut
    token (the server's tokens follow it). Red when cut answers are re-sent whole (their first token would be the
    server's) or returned cut."""
    from .helpers import plain_http_server

    logprobs = {"tokens": ["token_id:7"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]}
    cut = {"index": 0, "text": "a", "token_ids": [7], "finish_reason": "abort", "logprobs": logprobs}
    aborted = json.dumps({"choices": [cut, {**cut, "index": 1}]}).encode()
    with plain_http_server(routes={"/v1/models": (200, MODELS), "/v1/completions": (200, aborted)}) as bad:
        client = RolloutClient([bad, servers[0].url], request_timeout=30)
        choices = client.complete([432, 375], n=2, continue_cut=True, max_tokens=3, logprobs=0)
        client.close()
    assert client.answers_continued >= 2
    for index, choice in enumerate(choices):
        assert choice["index"] == index and choice["finish_reason"] != "abort"
        assert choice["token_ids"][0] == 7 and len(choice["token_ids"]) == 3
        values = choice["logprobs"]["token_logprobs"]
        assert values[0] == -0.5 and len(values) == 3 and all(v is not None for v in values)


def test_a_request_the_server_rejects_as_bad_is_not_retried_elsewhere(servers):
    """400: the request itself is wrong (too long, a bad parameter); another server would reject it too."""
    from .helpers import hits, plain_http_server

    rejection = (400, b'{"error": {"message": "This model\'s maximum context length is 256 tokens"}}')
    with plain_http_server(routes={"/v1/models": (200, MODELS), "/v1/completions": rejection}) as bad:
        client = RolloutClient([bad], request_timeout=30)
        with pytest.raises(RolloutError, match=r"rejected the request \(400\).*maximum context length"):
            client.generate([[432, 375]], max_tokens=2)
        client.close()
    assert hits(bad).count("/v1/completions") == 1


def test_step_delay_charges_each_request_its_decoding_steps_and_overlaps_requests(tiny_llama):
    """`--step-delay` (benchmarks' continuous batching): a request lasts step x its longest answer, whatever its n,
    and two requests' steps overlap (`--token-delay` charges every token in turn: a batch costs the sum)."""
    from concurrent.futures import ThreadPoolExecutor

    (server,) = start_servers(tiny_llama, 1, ("--step-delay", "0.5"))
    try:
        client = RolloutClient([server.url], request_timeout=30, generation_timeout=60)
        start = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(client.generate, [[5, 6, 7]], n=4, max_tokens=4, temperature=1.0) for _ in range(2)]
            results = [future.result() for future in futures]
        elapsed = time.monotonic() - start
        longest = max(len(c["token_ids"]) for result in results for choices in result for c in choices)
        assert elapsed >= 0.5 * longest  # each request its steps ...
        assert elapsed < 0.5 * longest * 1.8  # ... at once (in turn: 2x; per token: 8x)
    finally:
        server.stop()


def test_a_seed_in_generation_kwargs_is_warned_about_only_where_it_can_fail(tmp_path, caplog):
    """Each request draws its own numbers from a seed (`rollout/seeds.py`), so a synchronous run is told nothing (the
    warning said every request drew the same numbers: false since per-request seeds); with streaming, vLLM 0.32's
    CPU worker has died resuming seeded requests: said, with the fix. A seed that is not a whole number is refused
    naming generation_kwargs (it failed in int() inside the client)."""
    import logging

    from trl_scale.rollout.settings import RolloutSettings

    def settings(**overrides):
        args = trl_scale.GRPOConfig(
            **cpu_args(tmp_path, num_generations=4), use_vllm=True, vllm_mode="server", **overrides
        )
        with caplog.at_level(logging.WARNING, logger="trl_scale"):
            caplog.clear()
            RolloutSettings.from_config(args, logprobs=True, require_logprobs=False, run_id="x")
        return [r.getMessage() for r in caplog.records if "generation_kwargs sets seed" in r.getMessage()]

    assert settings() == []
    assert settings(generation_kwargs={"seed": 3}) == []
    (said,) = settings(generation_kwargs={"seed": 3}, async_rollout_staleness=1, async_rollout_mode="streaming",
                       vllm_server_base_urls=["http://127.0.0.1:1"])  # fmt: skip
    assert "resuming seeded requests" in said and "each request draws its own numbers" in said
    assert "same random numbers" not in said
    with pytest.raises(ValueError, match=r"generation_kwargs=\{'seed': 'three'\}: a request seed is a whole number"):
        settings(generation_kwargs={"seed": "three"})


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"seed": "three"}, r"seed='three': use a whole number"),
        ({"seed": 1.5}, r"seed=1.5: use a whole number"),
        ({"eval_strategy": "steps", "eval_steps": 0}, r"eval_steps=0: transformers replaces it with logging_steps"),
    ],
)
def test_trainer_arguments_transformers_takes_silently_are_refused_naming_them(settings, match, tmp_path):
    for config in (trl_scale.GRPOConfig, trl_scale.DPOConfig):
        with pytest.raises(ValueError, match=match):
            config(**cpu_args(tmp_path, **settings))


def test_the_routing_policy_is_chosen_by_name_or_given_as_an_object():
    """'latency' (the default) sends a request to the faster free server; 'least_outstanding' to the one with the
    fewest requests in flight, blind to speed; a policy object of the user's is asked; an unknown name is refused."""
    from trl_scale.routing import LeastOutstandingRouting

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for routing, expected in (("latency", 0), ("least_outstanding", 1)):
        client = RolloutClient(urls, request_timeout=1, routing=routing)
        fast, slow = client.servers
        now = time.monotonic()
        fast.latency, fast.measured_at, fast.outstanding = 0.1, now, 1
        slow.latency, slow.measured_at = 5.0, now
        assert client._acquire(set(), now + 1) is client.servers[expected], routing

    class Last:
        def pick(self, usable, cap, backlog, now):
            return usable[-1]

        def observe(self, server, seconds, now):
            self.seen = (server.url, seconds)

    policy = Last()
    client = RolloutClient(urls, request_timeout=1, routing=policy)
    picked = client._acquire(set(), time.monotonic() + 1)
    client._release(picked, ok=True, seconds=0.5)
    assert picked.url == urls[1] and policy.seen == (urls[1], 0.5)
    assert isinstance(RolloutClient(urls, routing="least_outstanding").routing, LeastOutstandingRouting)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        RolloutClient(urls, routing="fastest")


def test_a_request_whose_connection_closes_unanswered_is_sent_once_more():
    """The order a loaded suite once hit against real vLLM, forced: a request goes out on a pooled keep-alive
    connection the server is closing (uvicorn closes idle ones after 5 s), so the connection ends with no answer
    (`RemoteDisconnected`) though the server is up. With one server that failed the request at once ("no rollout
    server answered"); the client now sends it once more on a fresh connection, calling `on_dispatch` again (the
    weight version it is tagged with is read for the send that answers). A server that closes every connection
    unanswered is tried twice, no more, and named. Every call over the pooled session is (a sync's control calls
    too)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answer = json.dumps({"choices": [{"index": 0, "text": "a", "token_ids": [7, 8], "finish_reason": "length"}]})
    drops = {"left": 1, "seen": 0}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            drops["seen"] += 1
            if drops["left"]:
                drops["left"] -= 1
                self.close_connection = True  # closed with no status line: the client sees RemoteDisconnected
                return
            body = answer.encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        client = RolloutClient([url], request_timeout=30)
        dispatched = []
        choices = client.complete([1, 2], 1, "m", on_dispatch=lambda: dispatched.append(1), max_tokens=2)
        assert choices[0]["token_ids"] == [7, 8] and drops["seen"] == 2 and len(dispatched) == 2
        drops.update(left=10**6, seen=0)  # now it drops every request: failed, after two sends
        with pytest.raises(RolloutError, match="RemoteDisconnected"):
            client.complete([1, 2], 1, "m", max_tokens=2)
        assert drops["seen"] == 2
        drops.update(left=1, seen=0)  # a control call (a sync's pause) over the same pooled session: sent again too
        assert client.transport.post(client.servers[0], "/pause?mode=keep", timeout=10).status_code == 200
        assert drops["seen"] == 2
        client.close()
    finally:
        server.shutdown()
