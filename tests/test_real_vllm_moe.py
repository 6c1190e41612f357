"""A mixture-of-experts policy's weight syncs against real vLLM (the CPU build in .venv-vllm): a tiny Qwen3-MoE (8
experts, top-2) served by one dev-mode server with trl-scale's gloo weight-transfer engine. Not with `--enable-lora`:
vLLM's LoRA layers for fused experts run Triton kernels, which its CPU build lacks (the engine dies at the first
request), so the LoRA sync mode on an MoE policy is not run here.

transformers 5 keeps a block's experts fused (`mlp.experts.gate_up_proj`); vLLM's loader reads the checkpoint's
per-expert names and skips the others silently, so a sync under the model's own names left the server's experts as
they were loaded (0.135 nats off after three steps). Syncs now send checkpoint names (`trl_scale.checkpoint_names`)."""

from __future__ import annotations

import pytest

from trl_scale.rollout import RolloutClient
from trl_scale.rollout.weight_sync import SharedDirSync
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import VLLM_CPU_SHAPE

from .real_vllm import DEV_FLAGS, start_vllm_servers
from .test_real_vllm import SYNC_TOLERANCE, _check_every_sync, _trainer

pytestmark = pytest.mark.vllm_cpu


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), family="qwen3_moe", **VLLM_CPU_SHAPE)
    (server,) = start_vllm_servers([(path, DEV_FLAGS, {})])
    yield path, server
    server.stop()
    assert not server.group_pids(), "vLLM processes left running"


@pytest.fixture
def moe_url(moe_server) -> str:
    """The server on the initial weights again (an earlier test synced its policy)."""
    path, server = moe_server
    if server.why_dead():
        pytest.fail(server.why_dead())
    client = RolloutClient([server.url])
    try:
        SharedDirSync(client).reload(path, "base")
    finally:
        client.close()
    return server.url


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["shared_dir", "nccl"])
def test_a_moe_policys_every_weight_reaches_real_vllm_after_every_sync(moe_server, moe_url, tmp_path, weight_sync):
    """GRPO, 3 steps at a high learning rate: after each sync the server's prompt log-probs equal the policy's
    (<= 1e-4; the experts' own gradient moves them), through a shared directory and the weight-transfer group."""
    trainer = _trainer("grpo", moe_server[0], tmp_path, [moe_url], weight_sync)
    assert trainer.vllm_generation.syncer.name == weight_sync
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    before = dict(trainer.model.named_parameters())[experts].detach().clone()
    records = _check_every_sync(trainer, [moe_url])
    trainer.train()
    assert len(records) == 3
    for record in records:
        assert record["diff"][moe_url] <= SYNC_TOLERANCE, record["diff"]
    moved = max(abs(a - b) for a, b in zip(records[0]["policy"], records[-1]["policy"]))
    assert moved > 100 * SYNC_TOLERANCE, moved
    after = dict(trainer.model.named_parameters())[experts].detach()
    assert (after - before).abs().max() > 1e-3  # the experts themselves trained
