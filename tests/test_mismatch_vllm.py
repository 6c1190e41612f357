"""The mismatch gate against real vLLM (CPU build): a vLLM server of the policy in fp32 measures nothing, a vLLM
server of another revision (the same shape and names, a config value a weight sync does not carry) is caught and
named, and the policy served in bfloat16 gives its measured figure, within the default budget (by `trl-scale serve`:
vLLM's CPU build cannot run bfloat16 on this CPU), all in one run's probe (`rollout_mismatch_action="warn"`)."""

from __future__ import annotations

import logging

import pytest

from trl_scale.mismatch.arguments import DEFAULT_BUDGET
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import VLLM_CPU_SHAPE

from .helpers import server_grpo, start_servers
from .real_vllm import DEV_FLAGS, start_vllm_servers

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
    started = start_vllm_servers([(policy, FLAGS, {}), (other, FLAGS, {})])
    yield started[0], bf16, started[1]
    for server in (*started, bf16):
        server.stop()


def test_each_real_servers_figure_is_measured_and_the_wrong_one_named(servers, policy, tmp_path, caplog):
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
