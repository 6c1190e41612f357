"""Weight sync against vLLM's contract, end to end over real `trl-scale serve` processes: one weight-transfer group
over servers of different world sizes, the shared-directory route, weight versions (a restarted server leaves the
rotation until a sync reaches it), a member dying mid-broadcast, LoRA by vLLM's rules, readiness, and the request
and response shapes vLLM's own protocol models define.

The fixtures below are written from vLLM 0.31.0's source (`pip download --no-deps vllm==0.31.0`, unzipped):
- `entrypoints/serve/dev/rlhf/api_router.py` (pause/resume, init/start/update/finish, weight_info, get_world_size),
- `distributed/weight_transfer/nccl_common.py:71-100` (`NCCLWeightTransferInitInfo`: master_address, master_port,
  rank_offset, world_size, packed) and `nccl_engine.py:85-96` (`NCCLWeightTransferUpdateInfo`: names, dtype_names,
  shapes),
- `entrypoints/serve/dev/rpc/api_router.py` (collective_rpc), `dev/cache/api_router.py` (reset_prefix_cache),
- `entrypoints/serve/lora/protocol.py` and `entrypoints/openai/models/serving.py:167-300` (LoRA load/unload)."""

import json
import os
import re
import threading
import time

import pytest
import requests
import torch
from transformers import TrainerCallback

import trl_scale
from trl_scale.rollout import RolloutClient, RolloutError
from trl_scale.rollout.weight_sync import SharedDirSync, SyncSettings
from trl_scale.serve import weights_digest_of

from .helpers import cpu_args, group_sync, push, server_grpo, start_servers

pytest.importorskip("fastapi")

# Request bodies, as vLLM's routes parse them: route -> {field: type}; nested dicts are nested models.
VLLM_REQUESTS = {
    "/init_weight_transfer_engine": {
        "init_info": {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int, "packed": bool}
    },
    "/start_weight_update": {},
    "/update_weights": {"update_info": {"names": list, "dtype_names": list, "shapes": list}},
    "/finish_weight_update": {"weight_version": str},
    "/update_weight_version": {"new_version": str},
    "/collective_rpc": {"method": str, "kwargs": {"weights_path": str}},
    "/v1/load_lora_adapter": {"lora_name": str, "lora_path": str, "load_inplace": bool},
    "/v1/unload_lora_adapter": {"lora_name": str},
    "/v1/completions": {"model": str, "prompt": list, "n": int, "max_tokens": int, "return_token_ids": bool},
}
# Routes called without a body (query parameters only).
VLLM_BODYLESS = {"/pause", "/resume", "/reset_prefix_cache"}
# Responses: route -> the JSON vLLM returns on success.
VLLM_RESPONSES = {
    "/pause": {"status": "paused"},
    "/resume": {"status": "resumed"},
    "/start_weight_update": {"message": "Weight update started"},
    "/finish_weight_update": {"message": "Weight update finished"},
    "/reset_prefix_cache": {"success": True},
}


def _matches(body, schema) -> list[str]:
    problems = []
    for key, kind in schema.items():
        if key not in body:
            problems.append(f"missing {key}")
        elif isinstance(kind, dict):
            problems += [f"{key}.{p}" for p in _matches(body[key], kind)]
        elif not isinstance(body[key], kind) or (kind is int and isinstance(body[key], bool)):
            problems.append(f"{key} is {type(body[key]).__name__}, vLLM takes {kind.__name__}")
    return problems


class Recorder:
    """Every request a client sends, with its body kind: the contract is checked on what really went out."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = requests.Session.request

        def request(session, method, url, **kwargs):
            response = original(session, method, url, **kwargs)
            self.calls.append((method, url, kwargs.get("json"), kwargs.get("data"), response))
            return response

        monkeypatch.setattr(requests.Session, "request", request)

    def routes(self):
        return [requests.utils.urlparse(url).path for _, url, _, _, _ in self.calls]


def _policy_digest(trainer) -> dict[str, str]:
    return weights_digest_of(list(trainer.vllm_generation._iter_named_params()))


def _server_digest(url) -> dict[str, str]:
    return requests.get(f"{url}/trl_scale/weights_digest", timeout=30).json()["digest"]


def _check_every_sync(trainer, urls, seen):
    """After each sync, every server on the current version holds exactly the policy's weights."""
    generation = trainer.vllm_generation
    sync = generation.sync_weights

    def checked_sync():
        sync()
        policy = _policy_digest(trainer)
        for url in urls:
            server = _server_digest(url)
            assert {name: server[name] for name in policy} == policy, url
        seen.append(generation.syncer.version)

    generation.sync_weights = checked_sync


@pytest.mark.parametrize("weight_sync", ["nccl", "shared_dir"])
def test_grpo_over_servers_of_world_sizes_1_2_1_gets_exact_weights_at_every_sync(
    tiny_llama, tmp_path, weight_sync, monkeypatch
):
    servers = start_servers(tiny_llama, 3, ("--world-size", "1"), ("--world-size", "2"), ("--world-size", "1"))
    try:
        recorder = Recorder(monkeypatch)
        urls = [s.url for s in servers]
        trainer = server_grpo(tiny_llama, tmp_path, urls, weight_sync=weight_sync, weight_sync_dir=str(tmp_path / "w"))
        seen = []
        _check_every_sync(trainer, urls, seen)
        trainer.train()
        assert len(seen) == 3 and len(set(seen)) == 3  # a new version per step
        for url in urls:  # each server reports the version it took
            assert requests.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": seen[-1]}
        infos = [requests.get(f"{u}/server_info?config_format=json", timeout=10).json()["vllm_config"] for u in urls]
        assert all(i["trl_scale"]["prefix_cache_resets"] == 3 for i in infos)
        if weight_sync == "nccl":  # W = 1 + 1 + 2 + 1, offsets 1, 2, 4; the group formed once; packed, vLLM's buckets
            wire = {"world_size": 5, "packed": True, "packed_buffer_size_bytes": 1024**3}
            assert [i["trl_scale"]["engine"] for i in infos] == [
                {"rank_offset": 1, **wire},
                {"rank_offset": 2, **wire},
                {"rank_offset": 4, **wire},
            ]
            assert recorder.routes().count("/init_weight_transfer_engine") == 3
        # Contract: every request went out as vLLM parses it, nothing was POSTed as bytes, and the order of one
        # sync on one server is vLLM's.
        for method, url, body, data, response in recorder.calls:
            path = requests.utils.urlparse(url).path
            assert data is None, f"{path} was sent a raw body"
            if path in VLLM_REQUESTS and method == "POST":
                assert not _matches(body or {}, VLLM_REQUESTS[path]), (
                    path,
                    body,
                    _matches(body or {}, VLLM_REQUESTS[path]),
                )
            if path in VLLM_BODYLESS:
                assert body is None, path
            if path in VLLM_RESPONSES:
                assert response.json() == VLLM_RESPONSES[path], path
        on_first = [
            requests.utils.urlparse(u).path
            for m, u, *_ in recorder.calls
            if m == "POST" and u.startswith(urls[0]) and "/v1/" not in u
        ]
        expected = {
            "nccl": [
                "/pause",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update",
                "/reset_prefix_cache",
                "/resume",
            ],
            "shared_dir": ["/pause", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"],
        }[weight_sync]
        assert [p for p in on_first if p != "/init_weight_transfer_engine"] == expected * 3
    finally:
        for server in servers:
            server.stop()


def test_a_restarted_server_is_left_out_until_a_sync_reaches_it_then_rejoins(tiny_llama, tmp_path):
    steady, restarted = start_servers(tiny_llama, 2)
    seen_during_gap = {}

    class RestartAfterStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step != 1:
                return
            restarted.restart()  # back on its original weights, out of the group, version None
            client = trainer.vllm_generation.client
            before = {s.url: s.served for s in client.servers}
            client.generate([[432, 375]] * 6, max_tokens=2)
            after = {s.url: s.served for s in client.servers}
            seen_during_gap.update({url: after[url] - before[url] for url in after})

    try:
        urls = [steady.url, restarted.url]
        trainer = server_grpo(tiny_llama, tmp_path, urls, weight_sync="nccl")
        trainer.add_callback(RestartAfterStep1())
        trainer.train()
        assert seen_during_gap == {steady.url: 6, restarted.url: 0}  # excluded while on stale weights
        # The step-2 sync rebuilt the group with it: it holds the policy's weights and serves again.
        trainer.vllm_generation.sync_weights()
        policy = _policy_digest(trainer)
        for url in urls:
            server = _server_digest(url)
            assert {name: server[name] for name in policy} == policy
        client = trainer.vllm_generation.client
        assert all(client.versions.is_current(s) for s in client.servers)
        before = {s.url: s.served for s in client.servers}
        client.generate([[432, 375]] * 40, max_tokens=2)  # more than one server's in-flight cap: both work
        assert {s.url: s.served for s in client.servers}[restarted.url] > before[restarted.url]
    finally:
        steady.stop()
        restarted.stop()


def test_a_server_killed_mid_broadcast_fails_the_sync_within_the_timeout(tiny_llama, monkeypatch):
    from transformers import AutoModelForCausalLM

    from trl_scale.rollout import weight_transfer

    survivor, victim = start_servers(tiny_llama, 2)
    try:
        client = RolloutClient([survivor.url, victim.url], request_timeout=30)
        state = dict(AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict())
        sync = group_sync(client, timeout=20)
        push(sync, state)  # the group forms and a first sync goes through
        send = weight_transfer.GlooSender.send

        def send_then_kill(self, named_tensors):
            def killing():
                for index, item in enumerate(named_tensors):
                    if index == 3:
                        victim.stop()
                    yield item

            return send(self, killing())

        monkeypatch.setattr(weight_transfer.GlooSender, "send", send_then_kill)
        start = time.monotonic()
        with pytest.raises(RolloutError, match="weight broadcast abandoned: .*update_weights failed"):
            push(sync, state)
        assert time.monotonic() - start < 20 + 10
        monkeypatch.setattr(weight_transfer.GlooSender, "send", send)
        version = push(sync, state)  # the group is rebuilt without it
        assert {s.url: s.version == version for s in client.servers} == {survivor.url: True, victim.url: False}
    finally:
        survivor.stop()
        if victim.process.poll() is None:
            victim.stop()


def test_an_abandoned_broadcast_failing_late_leaves_the_rebuilt_group_in_place(tiny_llama):
    """A server's receive from an abandoned group can fail after the trainer has opened the next group on it (fresh-
    clone CI run 17: the group's next sync got "no weight-transfer engine"). The late failure must close its own
    group only. The order is forced: the old group's receive is left waiting, a new group forms and syncs, and only
    then does the old group's sender go."""
    from transformers import AutoModelForCausalLM

    (server,) = start_servers(tiny_llama, 1)
    try:
        client = RolloutClient([server.url], request_timeout=30)
        state = dict(AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict())
        sync = group_sync(client, timeout=20)
        push(sync, state)  # group A forms
        abandoned = sync.group
        update_info = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}
        requests.post(f"{server.url}/start_weight_update", json={}, timeout=10).raise_for_status()
        waiting = threading.Thread(
            target=requests.post,
            args=(f"{server.url}/update_weights",),
            kwargs={"json": {"update_info": update_info}, "timeout": 60},
        )
        waiting.start()  # the server now receives on group A, from a sender that never sends
        time.sleep(1.0)
        sync.group = None  # the trainer gives group A up and opens group B
        push(sync, state)
        abandoned.sender.close()  # group A's receive fails now, after group B formed
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        version = push(sync, state)  # over group B, still in place
        assert client.servers[0].version == version
    finally:
        server.stop()


def _perturbed(state: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator) for k, v in state.items()}


def _holds(url: str, state: dict) -> bool:
    """The server at `url` holds exactly `state` (sha256 of every tensor)."""
    expected, served = weights_digest_of(state), _server_digest(url)
    return {name: served.get(name) for name in expected} == expected


def test_a_server_restarted_right_before_a_group_sync_rejoins_it(tiny_llama):
    """A member restarted at the same URL, with no generation between (nothing else reads its version back): the
    sync must read the versions itself, see the member came back on its original weights without an engine, and
    rebuild the group with it, instead of sending it /start_weight_update on a group it no longer has."""
    from transformers import AutoModelForCausalLM

    steady, restarted = start_servers(tiny_llama, 2)
    try:
        client = RolloutClient([steady.url, restarted.url], request_timeout=30)
        state = dict(AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict())
        sync = group_sync(client, timeout=20)
        push(sync, _perturbed(state, 1))
        members = sync.group.members
        restarted.restart()  # same port, original weights, no weight-transfer engine
        second = _perturbed(state, 2)
        version = push(sync, second)
        assert sync.group.members == members and all(s.version == version for s in client.servers)
        assert _holds(steady.url, second) and _holds(restarted.url, second)
        sync.close()
        client.close()
    finally:
        steady.stop()
        restarted.stop()


def test_a_receiver_failing_while_alive_leaves_the_group_closed_and_the_next_sync_exact(tiny_llama, monkeypatch):
    """One member's /update_weights fails (a 500) while the server stays up: the broadcast is abandoned and its group
    closed, so the next sync forms a new group and the server ends on exactly that sync's weights (reusing the
    abandoned group, the next receive would read what the abandoned broadcast left in it)."""
    from transformers import AutoModelForCausalLM

    (server,) = start_servers(tiny_llama, 1)
    try:
        client = RolloutClient([server.url], request_timeout=30)
        state = dict(AutoModelForCausalLM.from_pretrained(tiny_llama).state_dict())
        sync = group_sync(client, timeout=20)
        push(sync, _perturbed(state, 1))
        post = client.transport.post
        failed = []

        def update_weights_fails_once(target, path, *args, **kwargs):
            if path == "/update_weights" and not failed:
                failed.append(path)
                raise RolloutError(f"{target.url}/update_weights answered 500: receive failed")
            return post(target, path, *args, **kwargs)

        monkeypatch.setattr(client.transport, "post", update_weights_fails_once)
        with pytest.raises(RolloutError, match="weight broadcast abandoned: /update_weights failed"):
            push(sync, _perturbed(state, 2))
        assert failed and sync.group is None and requests.get(f"{server.url}/health", timeout=5).ok
        third = _perturbed(state, 3)
        version = push(sync, third)
        assert client.servers[0].version == version and _holds(server.url, third)
        sync.close()
        client.close()
    finally:
        server.stop()


def test_lora_sync_follows_vllms_rules_across_resyncs_and_resume(tiny_llama, tmp_path):
    from peft import LoraConfig

    (server,) = start_servers(tiny_llama, 1)
    try:
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        fields = dict(
            weight_sync="lora",
            weight_sync_dir=str(tmp_path / "adapters"),
            max_steps=2,
            save_strategy="steps",
            save_steps=2,
            peft_config=lora,
        )
        trainer = server_grpo(tiny_llama, tmp_path / "run", [server.url], **fields)
        trainer.train()
        generation = trainer.vllm_generation
        first = generation.syncer.lora_name
        generation.sync_weights()  # again at the same step: a new name, never a refused reload of the old one
        assert generation.syncer.lora_name != first

        def adapters():
            return [m["id"] for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][1:]]

        assert adapters() == [generation.syncer.lora_name]  # superseded adapters are unloaded, not piled up
        resumed = server_grpo(tiny_llama, tmp_path / "run", [server.url], **{**fields, "max_steps": 3})
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
        assert resumed.state.global_step == 3
        assert adapters() == [resumed.vllm_generation.syncer.lora_name]
        # vLLM's rule the client follows: a second load under one name is refused unless in place
        body = {"lora_name": adapters()[0], "lora_path": str(tmp_path / "adapters" / adapters()[0])}
        response = requests.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30)
        assert response.status_code == 400 and "has already been loaded" in response.json()["error"]["message"]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def lora_rank_8_server(tiny_llama):
    """One server for the refusal cases below (each refused before it touches the server): one start, not four."""
    (server,) = start_servers(tiny_llama, 1, ("--max-lora-rank", "8"))
    yield server
    server.stop()


@pytest.mark.parametrize(
    "lora_fields, match",
    [
        ({"modules_to_save": ["lm_head"]}, r"peft_config.modules_to_save=\['lm_head'\]"),
        ({"use_dora": True}, r"peft_config.use_dora=True"),
        ({"bias": "lora_only"}, r"peft_config.bias='lora_only'"),
        ({"r": 16}, r"peft_config.r has rank 16, above the server's --max-lora-rank 8"),
    ],
    ids=["modules_to_save", "dora", "bias", "rank"],
)
def test_an_adapter_vllm_would_refuse_is_refused_at_construction(
    lora_rank_8_server, tiny_llama, tmp_path, lora_fields, match
):
    from peft import LoraConfig

    lora = LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **lora_fields})
    with pytest.raises(ValueError, match=match):
        server_grpo(tiny_llama, tmp_path, [lora_rank_8_server.url], weight_sync="lora", peft_config=lora)
    # nothing reached the server: no adapter loaded, its weights untouched
    assert requests.get(f"{lora_rank_8_server.url}/v1/models", timeout=10).json()["data"][1:] == []


def test_serve_answers_like_vllm_to_out_of_order_and_malformed_weight_calls(tiny_llama):
    (server,) = start_servers(tiny_llama, 1)
    url = server.url
    try:
        no_engine = requests.post(f"{url}/update_weights", json={"update_info": {"names": []}}, timeout=10)
        assert no_engine.status_code == 400 and "init_weight_transfer_engine" in no_engine.text
        assert requests.post(f"{url}/init_weight_transfer_engine", json={}, timeout=10).status_code == 400
        assert requests.post(f"{url}/update_weights", json={}, timeout=10).status_code == 400  # no update_info
        assert requests.post(f"{url}/collective_rpc", json={}, timeout=10).status_code == 400  # no method
        assert requests.get(f"{url}/get_world_size", timeout=10).json() == {"world_size": 1}
        assert requests.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": None}
        assert requests.post(f"{url}/update_weight_version", json={"new_version": "7"}, timeout=10).ok
        assert requests.get(f"{url}/weight_info", timeout=10).json() == {"weight_version": "7"}
        assert requests.post(f"{url}/pause?mode=keep", timeout=10).json() == {"status": "paused"}
        assert requests.get(f"{url}/is_paused", timeout=10).json() == {"is_paused": True}
        assert requests.post(f"{url}/resume", timeout=10).json() == {"status": "resumed"}
        missing = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def shared_server(tiny_llama):
    """One server for the tests below that take it as they find it (any weights) and leave it resumed."""
    (server,) = start_servers(tiny_llama, 1)
    yield server
    server.stop()


def test_a_paused_server_holds_new_requests_until_resumed(shared_server):
    server = shared_server
    client = RolloutClient([server.url], request_timeout=30)
    requests.post(f"{server.url}/pause?mode=keep", timeout=10)
    try:
        pending = client.submit(client.generate, [[432]], 1, None, max_tokens=2)
        time.sleep(1.0)
        assert not pending.done()  # held, not refused or dropped (vLLM's mode=keep)
    finally:
        requests.post(f"{server.url}/resume", timeout=10)
    assert pending.result(timeout=30)[0][0]["token_ids"]


def test_a_server_left_paused_by_a_killed_trainer_is_resumed_when_the_next_trainer_starts(
    shared_server, tiny_llama, tmp_path, capsys
):
    """A trainer killed during a weight sync (between its /pause and /resume: the chaos run's kill did this) leaves
    the server paused, and every request to it waits. The next trainer against it resumes it before its first
    request (its checks send one), names it in a warning, and trains; without that its start waited out the
    request timeout on the paused server. `trl-scale check-servers` names it, with the fix."""
    from trl_scale.cli import main

    server = shared_server
    requests.post(f"{server.url}/pause?mode=keep", timeout=10).raise_for_status()
    try:
        began = time.monotonic()
        assert main(["check-servers", server.url]) == 1  # named, with the fix, at once
        named = r"paused \(a trainer that ended during a weight sync.*Fix: POST .*/resume"
        assert re.search(named, capsys.readouterr().err)
        assert time.monotonic() - began < 10
        trainer = server_grpo(tiny_llama, tmp_path, [server.url], max_steps=1, rollout_request_timeout=20)
        assert time.monotonic() - began < 15  # not a request timed out on the paused server
        assert requests.get(f"{server.url}/is_paused", timeout=10).json() == {"is_paused": False}
    finally:
        requests.post(f"{server.url}/resume", timeout=10)  # left resumed for the module's other tests
    trainer.train()
    assert trainer.state.global_step == 1


def test_pause_wait_returns_once_started_generations_have_finished(tiny_llama):
    """A sync pauses with vLLM's mode=wait: a generation already admitted finishes with the weights it started
    with before the pause returns (mode=keep would let the update land under it); new requests wait for /resume."""
    (server,) = start_servers(tiny_llama, 1, ("--token-delay", "2"))  # 2 s per token: 4 tokens take 8 s
    try:
        client = RolloutClient([server.url], request_timeout=30, generation_timeout=60)
        started = client.submit(client.generate, [[432]], 1, None, max_tokens=4, temperature=0.0)
        time.sleep(1.5)  # admitted and generating (a request reaches the server in milliseconds, seconds under load)
        before = time.monotonic()
        SharedDirSync(client)._pause(client.servers[0])
        assert time.monotonic() - before > 3.0  # the pause waited for the generation (mode=keep returns at once)
        assert started.result(timeout=10)[0][0]["token_ids"]  # finished while the server stays paused
        held = client.submit(client.generate, [[432]], 1, None, max_tokens=1)
        time.sleep(1.0)
        assert not held.done()  # new requests wait for the resume
        requests.post(f"{server.url}/resume", timeout=10)
        assert held.result(timeout=30)[0][0]["token_ids"]
    finally:
        server.stop()


def test_the_client_waits_for_servers_still_loading_and_names_those_that_never_come(tiny_llama):
    from .helpers import Server, free_port

    loading = Server(tiny_llama)  # not waited on: the client must wait for its /health itself
    try:
        client = RolloutClient([loading.url], request_timeout=30)
        client.wait_until_ready(timeout=90)
        assert client.generate([[432]], max_tokens=2)[0][0]["token_ids"]
    finally:
        loading.stop()
    never = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(RolloutError, match=r"not ready within vllm_server_timeout=2.*" + never.replace(".", r"\.")):
        RolloutClient([never]).wait_until_ready(timeout=2)
    assert time.monotonic() - start < 8


def test_a_prompts_completions_go_as_one_request_with_n(shared_server, tiny_llama, tmp_path, monkeypatch):
    # the mismatch probe's request is another request (tests/test_mismatch.py): only TRL's generation counted here
    trainer = server_grpo(tiny_llama, tmp_path, [shared_server.url], max_steps=1, rollout_mismatch_budget=None)
    recorder = Recorder(monkeypatch)  # generation only (construction's preflight sends a probe)
    trainer.train()
    completions = [body for _, url, body, _, _ in recorder.calls if url.endswith("/v1/completions")]
    assert len(completions) == 8 // 4 and all(body["n"] == 4 for body in completions)
    assert all(body["return_tokens_as_token_ids"] is True for body in completions)  # as TRL sends it


@pytest.mark.gpu
@pytest.mark.vllm
def test_nccl_weight_sync_to_real_vllm_servers(tiny_llama, tmp_path):  # pragma: no cover - needs vLLM and CUDA
    """The same orchestration against `vllm serve` (VLLM_SERVER_DEV_MODE=1, --weight-transfer-config
    '{"backend":"nccl"}'): the trainer joins the NCCL group through vLLM's own helpers."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.skip("start vLLM servers with the flags in README's 'Weight sync with real vLLM' to run this check")


def test_group_layout_puts_the_trainer_at_rank_0_and_each_server_after_the_previous():
    from trl_scale.rollout.weight_transfer import group_layout

    assert group_layout([1, 2, 1]) == (5, [1, 2, 4])
    assert group_layout([4]) == (5, [1])  # TRL's one-server case: rank_offset 1, world_size TP x DP + 1
    with pytest.raises(ValueError, match="world_size=0"):
        group_layout([1, 0])


def test_removed_and_unusable_sync_modes_are_clear_errors(tmp_path):
    from trl_scale.rollout.weight_transfer import check_nccl_sender

    with pytest.raises(ValueError, match=r"weight_sync='http' is gone.*Fix: weight_sync='auto'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), weight_sync="http")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"needs vLLM and CUDA in the trainer: no CUDA device.*shared_dir"):
            check_nccl_sender()


def _walk(walked: list, count: int = 20):
    for index in range(count):
        walked.append(index)  # under ZeRO-3/FSDP each step is a gather the other ranks are in
        yield f"p{index}", torch.full((2,), float(index))


class _StuckSender:
    """A sender whose broadcast never returns from its 4th tensor (NCCL's broadcast has no timeout)."""

    def __init__(self):
        self.release = threading.Event()
        self.received = []

    def send(self, named_tensors):
        for index, (name, tensor) in enumerate(named_tensors):
            if index == 3:
                self.release.wait(60)
            self.received.append((name, tensor.clone()))


def test_a_broadcast_is_abandoned_on_a_failed_receiver_or_a_stall_and_every_parameter_is_still_walked():
    from concurrent.futures import Future, ThreadPoolExecutor

    from trl_scale.rollout.weight_sync.group import _broadcast

    pool = ThreadPoolExecutor(4)
    # a server dies mid-broadcast while the trainer's sender is stuck
    walked, sender, receiving = [], _StuckSender(), Future()
    threading.Timer(0.3, lambda: receiving.set_exception(ConnectionError("server died"))).start()
    start = time.monotonic()
    failure = _broadcast(sender, _walk(walked), {"http://a": receiving}, pool, time.monotonic() + 60)
    assert "update_weights failed" in failure and "server died" in failure
    assert walked == list(range(20)) and time.monotonic() - start < 5
    sender.release.set()
    # healthy receivers, a broadcast that stalls: the deadline ends it
    walked, sender = [], _StuckSender()
    failure = _broadcast(sender, _walk(walked), {"http://a": Future()}, pool, time.monotonic() + 1)
    assert "did not finish within weight_load_timeout" in failure and walked == list(range(20))
    sender.release.set()
    # all well: every tensor reaches the sender in order, each while its gather is open
    walked, sender, receiving = [], _StuckSender(), Future()
    sender.release.set()
    threading.Timer(0.2, lambda: receiving.set_result("ok")).start()
    assert _broadcast(sender, _walk(walked), {"http://a": receiving}, pool, time.monotonic() + 30) is None
    assert [name for name, _ in sender.received] == [f"p{i}" for i in range(20)]
    assert all(tensor[0].item() == i for i, (_, tensor) in enumerate(sender.received))


def test_a_sync_that_fails_before_its_broadcast_still_walks_every_parameter():
    """Rank 0 raising before the walk (no server answers, the group does not form) must not leave the other
    ranks waiting in their ZeRO-3/FSDP gathers: the walk is finished in any case."""
    from trl_scale.rollout.weight_sync import GroupSync, PolicyWeights

    walked = []

    class NoServerAnswers(GroupSync):
        def broadcast(self, metadata, named_tensors, version):
            raise RolloutError("weight sync: no server answers /health")

    weights = PolicyWeights(named_tensors=lambda: _walk(walked), metadata=lambda: [], is_main=True)
    with pytest.raises(RolloutError, match="no server answers"):
        NoServerAnswers(client=None).sync(weights, "v1")
    assert walked == list(range(20))


@pytest.mark.slow
def test_a_sharded_adapter_is_gathered_before_it_is_written_for_vllm(tiny_llama, tmp_path):
    """Under FSDP2 each rank holds a shard of every LoRA tensor: the LoRA sync gathers them on every rank, so rank
    0 writes the whole adapter (equal to one process's), not its shard. (DeepSpeed ZeRO-3 goes through
    GatheredParameters in the same function.)"""
    import sys

    from .helpers import free_port, run_to_completion

    outputs = {}
    for processes in (1, 2):
        outputs[processes] = tmp_path / f"adapter-{processes}.pt"
        command = [sys.executable]
        if processes > 1:
            command += ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
        command += ["-m", "tests.adapter_gather_worker", tiny_llama, str(outputs[processes])]
        run_to_completion(command, timeout=300)
    whole, gathered = (torch.load(outputs[p]) for p in (1, 2))
    assert whole.keys() == gathered.keys() and any("lora_B" in key for key in whole)
    for key in whole:
        assert gathered[key].shape == whole[key].shape, key
        assert torch.equal(gathered[key], whole[key]), key


def test_a_server_a_sync_misses_is_reported_once_then_back_when_a_sync_reaches_it(tiny_llama, caplog):
    """A server down across several syncs is warned about once (not at every step), and said to be back once a sync
    reaches it again: it then serves the new version."""
    import logging

    from trl_scale.rollout import RolloutClient

    steady, flaky = start_servers(tiny_llama, 2)
    client = RolloutClient([steady.url, flaky.url], request_timeout=30)
    sync = SharedDirSync(client, SyncSettings(timeout=30))
    try:
        with caplog.at_level(logging.INFO, logger="trl_scale.rollout.weight_sync.base"):
            sync.reload(tiny_llama, "v1")
            flaky.stop()
            sync.reload(tiny_llama, "v2")
            sync.reload(tiny_llama, "v3")
            flaky.restart()
            sync.reload(tiny_llama, "v4")
        messages = [record.getMessage() for record in caplog.records]
        missed = [m for m in messages if "did not reach" in m]
        assert len(missed) == 1 and flaky.url in missed[0], messages
        back = [m for m in messages if "again" in m]
        assert len(back) == 1 and flaky.url in back[0], messages
        assert [s.version for s in client.servers] == ["v4", "v4"]
    finally:
        client.close()
        steady.stop()
        flaky.stop()


def test_a_lora_sync_unloads_every_other_runs_adapter_and_keeps_this_runs_newest():
    from trl_scale.rollout.client import VERSION_PREFIX
    from trl_scale.rollout.weight_sync.lora import superseded

    run, other = f"{VERSION_PREFIX}aaaa", f"{VERSION_PREFIX}bbbb"
    listed = [f"{run}-1", f"{run}-2", f"{run}-10", f"{other}-11", "someone-elses", f"{run}-11"]
    assert superseded(listed, f"{run}-11", 0) == [f"{run}-1", f"{run}-2", f"{run}-10", f"{other}-11"]
    # versions compared as numbers (10 after 2), this run's only
    assert superseded(listed, f"{run}-11", 2) == [f"{run}-1", f"{other}-11"]
    assert superseded(listed, f"{run}-11", 5) == [f"{other}-11"]


@pytest.mark.parametrize(
    "mode, status, expected",
    [
        ("keep", 422, r"/pause\?mode=keep answered 422: .*Fix: async_rollout_interrupt='partial'"),
        ("wait", 500, r"/pause\?mode=wait answered 500: \{\"detail\": \"boom\"\}"),
    ],
)
def test_a_server_refusing_the_pause_is_named_with_its_route_and_status(mode, status, expected, tmp_path):
    """A server that is up but refuses `/pause` (a 500, or a 422 for mode=keep from a vLLM without it): the sync's
    error names the route, the status and, for keep, the fix. Before: "reached no server within
    weight_sync_timeout=...: all servers down", for a server that answers /health."""
    from .helpers import plain_http_server

    routes = {"/health": (200, b"{}"), f"/pause?mode={mode}": (status, b'{"detail": "boom"}')}
    with plain_http_server(status=200, body=b"{}", routes=routes) as url:
        client = RolloutClient([url], request_timeout=5)
        sync = SharedDirSync(client, SyncSettings(timeout=5, pause_mode=mode))
        try:
            started = time.monotonic()
            with pytest.raises(RolloutError, match=expected) as raised:
                sync.reload(str(tmp_path), "v1")
            assert time.monotonic() - started < 5  # at once, not after a timeout
            assert "all servers down" not in str(raised.value) and url in str(raised.value)
        finally:
            client.close()


def test_a_group_broadcast_is_done_only_when_every_receiver_has_returned():
    """The trainer's side of a broadcast can finish before a server's `/update_weights` returns (it is still
    loading what it received): the sync must not go on to `/finish_weight_update` until every receiver has."""
    from concurrent.futures import Future, ThreadPoolExecutor
    from types import SimpleNamespace

    from trl_scale.rollout.weight_sync.group import _broadcast

    sent_all = threading.Event()

    def send(tensors):
        for _ in tensors:
            pass
        sent_all.set()

    pool = ThreadPoolExecutor(2)
    client = SimpleNamespace(submit=pool.submit)
    quick, slow = Future(), Future()
    quick.set_result(None)
    outcome = {}
    broadcast = threading.Thread(
        target=lambda: outcome.update(
            failure=_broadcast(
                SimpleNamespace(send=send),
                [("w", torch.zeros(2))],
                {"http://a": quick, "http://b": slow},
                client,
                time.monotonic() + 30,
            )
        )
    )
    broadcast.start()
    assert sent_all.wait(timeout=10)
    broadcast.join(timeout=0.5)
    assert broadcast.is_alive(), "the broadcast returned while a receiver was still loading"
    slow.set_result(None)
    broadcast.join(timeout=10)
    assert outcome == {"failure": None}
    pool.shutdown()


class _OneSlotLoraServer:
    """vLLM's rules for runtime LoRA adapters, as `vllm/lora/worker_manager.py` (0.32) has them, over HTTP: one
    adapter held in memory (`--max-cpu-loras` defaults to `--max-loras`, 1); loading another evicts it, and a request
    naming an evicted adapter reads it again from its directory, a missing one failing the engine (every later
    request answered 500). Unload only forgets the name. A completion naming an adapter in `hold` waits for
    `release`; `arrived` is set once it is in."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.paths: dict[str, str] = {}  # registered name -> directory
        self.cached, self.dead = None, None
        self.hold, self.arrived, self.release = set(), threading.Event(), threading.Event()
        lock, outer = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                names = ["base", *outer.paths]
                self._answer(200, {"data": [{"id": n} for n in names]} if self.path == "/v1/models" else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with lock:
                    status, answer = outer.handle(self.path, body)
                if status == "hold":
                    outer.arrived.set()
                    outer.release.wait(60)
                    status, answer = 200, {"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}
                self._answer(status, answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _read(self, name: str) -> bool:
        if not os.path.exists(os.path.join(self.paths[name], "adapter_config.json")):
            self.dead = f"Loading lora {name} failed: No adapter found for {self.paths[name]}"
            return False
        self.cached = name
        return True

    def handle(self, path: str, body: dict):
        if self.dead:
            return 500, {"error": self.dead}
        if path == "/v1/load_lora_adapter":
            self.paths[body["lora_name"]] = body["lora_path"]
            return (200, "ok") if self._read(body["lora_name"]) else (500, {"error": self.dead})
        if path == "/v1/unload_lora_adapter":
            self.paths.pop(body["lora_name"], None)
            return 200, "ok"
        name = body.get("model")
        if name not in self.paths:
            return 404, {"error": f"model {name} does not exist"}
        if self.cached != name and not self._read(name):
            return 500, {"error": self.dead}
        if name in self.hold:
            return "hold", None
        return 200, {"choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()


def test_a_lora_adapters_directory_stays_while_a_server_may_read_it_again(tmp_path):
    """vLLM reads an adapter it evicted again from its directory, and a missing one kills its engine (a CI run lost
    a real vLLM server so: test_real_vllm.py's held-adapter test). So a sync deletes an adapter's directory only once
    the adapter is unloaded (not among the newest `keep_adapters` and the current one) and no request out names it;
    the end of the run waits for requests still out. Red with the directories deleted at each sync as before (the
    held adapter's request answered 500), or with requests out not counted, here or on another rank (the adapter
    they name deleted)."""
    from peft import LoraConfig

    from trl_scale.rollout.client import VERSION_PREFIX
    from trl_scale.rollout.weight_dir import WeightDirectory
    from trl_scale.rollout.weight_sync.base import PolicyWeights
    from trl_scale.rollout.weight_sync.lora import LoraSync

    server = _OneSlotLoraServer()
    client = RolloutClient([server.url], request_timeout=10)
    config = LoraConfig(r=4, target_modules=["q_proj"])
    elsewhere: set[str] = set()  # what another data-parallel rank's requests out name
    weights = PolicyWeights(
        named_tensors=lambda: iter(()),
        metadata=list,
        adapter=lambda: ({"w": torch.zeros(2)}, config),
        models_in_use=lambda: set(elsewhere),
    )
    weight_dir = WeightDirectory(str(tmp_path / "adapters"), "run")
    sync = LoraSync(client, SyncSettings(timeout=30, weight_dir=weight_dir, keep_adapters=1))
    names = [f"{VERSION_PREFIX}run-{i}" for i in range(1, 8)]

    def ask(name: str) -> list[dict]:
        return client.complete([1, 2], 1, name, max_tokens=1)

    def has_directory(name: str) -> bool:
        return os.path.exists(os.path.join(weight_dir.root, name))

    try:
        for name in names[:3]:
            sync.sync(weights, name)
        # names[1] is still held (keep_adapters=1), evicted by names[2]'s load: read again from its directory
        assert [has_directory(n) for n in names[:3]] == [False, True, True]
        assert ask(names[1])[0]["token_ids"] == [7], server.dead
        server.hold.add(names[1])
        out = threading.Thread(target=ask, args=(names[1],))
        out.start()
        assert server.arrived.wait(30)
        sync.sync(weights, names[3])  # unloads names[1]; a request out still names it
        assert names[1] not in server.paths and has_directory(names[1])
        server.release.set()
        out.join(30)
        elsewhere.add(names[2])  # another rank's request out names names[2], which this sync unloads
        sync.sync(weights, names[4])
        assert [has_directory(n) for n in names[:5]] == [False, False, True, True, True]
        elsewhere.clear()
        sync.sync(weights, names[5])  # nothing names them now
        assert [has_directory(n) for n in names[:6]] == [False, False, False, False, True, True]
        # the end of the run waits for a request still out naming one of its adapters
        server.hold.add(names[5])
        server.arrived.clear(), server.release.clear()
        out = threading.Thread(target=ask, args=(names[5],))
        out.start()
        assert server.arrived.wait(30)
        closing = threading.Thread(target=sync.close)
        closing.start()
        closing.join(2)
        assert closing.is_alive() and has_directory(names[5])
        server.release.set()
        out.join(30)
        closing.join(30)
        assert not closing.is_alive() and weight_dir.root is None and server.dead is None
    finally:
        server.stop()
        client.close()


@pytest.mark.parametrize("weight_sync", ["nccl", "shared_dir"])
def test_a_moe_policy_over_trl_scale_serve_gets_every_expert_at_every_sync(tmp_path, weight_sync):
    """A tiny Qwen3-MoE: the syncs send checkpoint names (one tensor per expert and projection), and `trl-scale serve`
    writes each into its fused expert parameters: after every sync it holds exactly the policy's weights."""
    from trl_scale.toy import build_tiny_model

    model_path = build_tiny_model(tmp_path / "moe", family="qwen3_moe")
    (server,) = start_servers(model_path, 1)
    try:
        trainer = server_grpo(
            model_path, tmp_path, [server.url], weight_sync=weight_sync, learning_rate=3e-3,
            weight_sync_dir=str(tmp_path / "w"),
        )  # fmt: skip
        model = trainer.accelerator.unwrap_model(trainer.model)
        experts = "model.layers.0.mlp.experts.down_proj"
        initial = dict(model.named_parameters())[experts].detach().clone()
        generation, synced = trainer.vllm_generation, []
        sync = generation.sync_weights

        def checked_sync():
            sync()
            policy = weights_digest_of(list(model.named_parameters()))
            assert _server_digest(server.url) == policy
            synced.append(generation.syncer.version)

        generation.sync_weights = checked_sync
        trainer.train()
        assert len(synced) == 3
        assert (dict(model.named_parameters())[experts] - initial).abs().max() > 1e-4  # the experts moved
    finally:
        server.stop()
