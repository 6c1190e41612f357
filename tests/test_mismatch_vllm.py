"""The mismatch gate against real vLLM (CPU build): a vLLM server of the policy in fp32 measures nothing, a vLLM
server of another revision (the same shape and names, a config value a weight sync does not carry) is caught and
named, and the policy served in bfloat16 gives its measured figure, within the default budget (by `trl-scale serve`:
vLLM's CPU build cannot run bfloat16 on this CPU), all in one run's probe (`rollout_mismatch_action="warn"`). Then
the same fp32 server with its later weight syncs skipped (caught at the step after the first it missed), and with a
LoRA run's adapter not loaded (named at the probe, though no server is left to generate the first batch)."""

from __future__ import annotations

import logging

import pytest
import requests

from trl_scale.mismatch.arguments import DEFAULT_BUDGET
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import VLLM_CPU_SHAPE

from .helpers import server_grpo, start_servers
from .real_vllm import DEV_FLAGS, LORA_FLAGS, served_models, start_vllm_servers

pytestmark = pytest.mark.vllm_cpu

FLAGS = ("--logprobs-mode", "processed_logprobs", *DEV_FLAGS[2:])


# peaked next-token distributions, as a trained model's (a tiny random model's are nearly uniform: tests/test_mismatch)
SHAPE = {**VLLM_CPU_SHAPE, "initializer_range": 0.2}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("policy"), **SHAPE)


@pytest.fixture(scope="module")
def servers(policy, tmp_path_factory):
    # a config value no weight sync carries (the sync before step 1 overwrites the weights)
    other = build_tiny_model(tmp_path_factory.mktemp("other-revision"), seed=11, rms_norm_eps=0.5, **SHAPE)
    # vLLM 0.32's CPU build dies on bfloat16 on this machine's CPU (its worker exits -4, SIGILL: no AVX512-BF16), so
    # the bfloat16 server is `trl-scale serve` (vLLM's API, transformers' bfloat16 forward)
    (bf16,) = start_servers(policy, 1, ("--dtype", "bfloat16"))
    started = start_vllm_servers([(policy, (*FLAGS, *LORA_FLAGS), {}), (other, FLAGS, {})])
    yield started[0], bf16, started[1]
    for server in (*started, bf16):
        server.stop()


def test_each_real_servers_figure_is_measured_and_the_wrong_one_named(servers, fp32_url, policy, tmp_path, caplog):
    fp32, bf16, other = (server.url for server in servers)
    trainer = server_grpo(policy, tmp_path, [fp32, bf16, other], max_steps=1, rollout_mismatch_action="warn")
    with caplog.at_level(logging.INFO, logger="trl_scale"):
        trainer.train()
    first = next(log for log in trainer.state.log_history if "loss" in log)
    kl = [first[f"rollout/mismatch_probe/server{index}/kl"] for index in range(3)]
    print({"fp32": kl[0], "bf16": kl[1], "other_model": kl[2]})  # the figures docs/mismatch.md quotes
    assert kl[0] < 1e-6, kl  # the policy at the trainer's precision
    assert 1e-7 < kl[1] < DEFAULT_BUDGET, kl  # bfloat16: measurable, within the default budget
    assert kl[2] > DEFAULT_BUDGET, kl
    warned = [r.getMessage() for r in caplog.records if "past rollout_mismatch_budget" in r.getMessage()]
    assert len(warned) == 1 and other in warned[0] and fp32 not in warned[0] and bf16 not in warned[0]
    assert "another model or revision" in warned[0]


@pytest.fixture
def fp32_url(servers, policy) -> str:
    """The fp32 vLLM server serving the policy's starting weights again, no adapter loaded (a test before synced)."""
    from trl_scale.rollout import RolloutClient
    from trl_scale.rollout.weight_sync import SharedDirSync

    url = servers[0].url
    client = RolloutClient([url])
    try:
        SharedDirSync(client).reload(policy, "base")
    finally:
        client.close()
    for adapter in served_models(url)[1:]:
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": adapter}, timeout=30).raise_for_status()
    return url


def test_a_real_server_a_sync_did_not_reach_is_caught_at_the_step_after_it(fp32_url, policy, tmp_path, monkeypatch):
    """Real vLLM takes the first sync, then is told each later version without loading its weights (a sync that did
    not reach it): the step after the missed sync names it, from the tokens it drew; the step before trained clean."""
    from trl_scale.rollout.weight_sync.shared_dir import SharedDirSync

    reload, loads = SharedDirSync._reload, []

    def missing_later_syncs(self, server, path, version):
        loads.append(version)
        if len(loads) > 1:  # the version is claimed, the weights never loaded
            self.client.transport.post(server, "/update_weight_version", 30, json={"new_version": version})
            return
        reload(self, server, path, version)

    monkeypatch.setattr(SharedDirSync, "_reload", missing_later_syncs)
    trainer = server_grpo(policy, tmp_path, [fp32_url], max_steps=3, weight_sync="shared_dir", learning_rate=0.05)
    with pytest.raises(ValueError) as raised:
        trainer.train()
    message = str(raised.value)
    assert fp32_url in message and "at step 1, weights of sync 2" in message, message
    (log,) = [log for log in trainer.state.log_history if "loss" in log]
    assert log["rollout/mismatch_probe/server0/kl"] < 1e-6 and log["rollout/mismatch/server0/kl"] < 1e-6, log


def test_a_real_server_without_the_lora_runs_adapter_is_named(fp32_url, policy, tmp_path, monkeypatch):
    """LoRA on real vLLM: a server that did not load the adapter just synced is named at the probe (vLLM answers the
    adapter's name with 404), though no server is left to generate the first batch."""
    from peft import LoraConfig

    from trl_scale.errors import RolloutError
    from trl_scale.rollout.weight_sync.lora import LoraSync

    monkeypatch.setattr(LoraSync, "_load", lambda self, server, *args: None)
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    fields = dict(weight_sync="lora", max_steps=1, peft_config=lora)
    trainer = server_grpo(policy, tmp_path / "skipped", [fp32_url], weight_sync_dir=str(tmp_path / "a"), **fields)
    with pytest.raises(RolloutError, match=rf"{fp32_url}: .*the LoRA adapter is not loaded there"):
        trainer.train()
    # (a server that loaded it is measured against the policy and its base: tests/test_mismatch.py, over serve)
