"""TRL's default vLLM mode, `vllm_mode="colocate"` (vLLM inside the trainer), against real vLLM: its CPU build with
trl-scale installed beside it in `.venv-vllm` (`bash scripts/setup_vllm.sh`). Stock TRL 1.16 fails there at the first
weight sync (the CPU backend repacks each linear layer's weight, so TRL's direct `load_weights` finds no
`weight_loader`); trl-scale's GRPO, RLOO and PPO run 3 steps each with packing on, the engine in the policy's dtype,
and after every sync the engine's log-probs equal the policy's, also for a prompt whose blocks it cached before the
sync."""

from __future__ import annotations

import json
import subprocess

import pytest

import trl_scale

from .helpers import ROOT, subprocess_env
from .real_vllm import INSTALL_HINT, VLLM_PYTHON, vllm_cpu_available
from .test_evaluation import plain_pass_rates

SYNC_TOLERANCE = 1e-4  # |engine - policy| prompt log-prob after a sync, fp32 both sides (measured 5e-7)


def _trl_scale_beside_vllm() -> bool:
    if not vllm_cpu_available():
        return False
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import trl, trl_scale"], capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_grpo_rloo_and_ppo_train_in_trls_default_colocate_mode_with_exact_syncs(tiny_llama_hd64, tmp_path):
    if not _trl_scale_beside_vllm():
        pytest.skip(f"needs trl-scale installed beside vLLM in .venv-vllm: {INSTALL_HINT}")
    command = [str(VLLM_PYTHON), "-m", "tests.colocate_worker", str(tmp_path), tiny_llama_hd64, "grpo", "rloo", "ppo"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=500)
    lines = [json.loads(line[len("RESULT ") :]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and len(lines) == 3, (result.stdout + result.stderr)[-4000:]
    for run in lines:
        method = run["method"]
        assert run["steps"] == 3 and run["packed"], run
        assert run["engine_dtype"] == "torch.float32", run  # the policy's, not vLLM's pick from the config
        assert run["direct_load"] is False, run  # the CPU backend repacks: the layerwise reload ran
        # one per step, and GRPO's evaluation after the last step syncs its weights (the one after step 2 gives the
        # third step its weights)
        assert len(run["syncs"]) == 3 + (method == "grpo"), run
        assert all(sync["diff"] <= SYNC_TOLERANCE for sync in run["syncs"]), (method, run["syncs"])
        # a prompt whose blocks were cached before the sync: served with the new weights (the layerwise reload
        # resets the prefix cache; without the reset its old keys and values would be reused)
        assert all(sync["cached_diff"] <= SYNC_TOLERANCE for sync in run["syncs"]), (method, run["syncs"])
        # the policy moved between syncs, so an engine left on older weights could not pass the check above
        moved = [
            max(abs(a - b) for a, b in zip(s["policy"], t["policy"])) for s, t in zip(run["syncs"], run["syncs"][1:])
        ]
        assert all(m > 10 * SYNC_TOLERANCE for m in moved), (method, moved)
        if method in ("grpo", "ppo"):  # the sampler's own log-probs of its completions (TRL's metric)
            assert all(d is not None and d <= SYNC_TOLERANCE for d in run["sampler_logp_difference_max"]), run
        if method == "grpo":  # evaluation during training: at the weights just trained, pass@k as computed plainly
            assert len(run["evaluations"]) == len(run["evaluated_rewards"]) == 2, run
            for log, rewards in zip(run["evaluations"], run["evaluated_rewards"]):
                assert log["eval_sampling/sampling_logp_difference/max"] <= SYNC_TOLERANCE, log
                for k in (1, 4):
                    expected = plain_pass_rates(rewards, 4, k, 0.5)
                    assert log[f"eval_rewards/parity_reward/pass@{k}"] == pytest.approx(expected, abs=1e-6), (k, log)


def test_vllm_llm_kwargs_refuse_trls_own_settings_and_what_is_not_a_dict(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="colocate")
    assert trl_scale.GRPOConfig(**base, vllm_llm_kwargs='{"dtype": "bfloat16"}').vllm_llm_kwargs == {
        "dtype": "bfloat16"
    }
    with pytest.raises(ValueError, match=r"vllm_llm_kwargs sets \['seed'\], which TRL sets itself"):
        trl_scale.RLOOConfig(**base, vllm_llm_kwargs={"seed": 3, "enforce_eager": True})
    with pytest.raises(ValueError, match=r"vllm_llm_kwargs='dtype=bf16': use a dict"):
        trl_scale.GRPOConfig(**base, vllm_llm_kwargs="dtype=bf16")


@pytest.mark.vllm_cpu
@pytest.mark.slow
def test_a_mixture_of_experts_policy_colocated_syncs_every_expert(tmp_path):
    """A tiny Qwen3-MoE (8 experts, top-2) in TRL's colocate mode: the walk under checkpoint names reaches vLLM's
    layerwise reload (its loader's per-expert names), and the plugin re-packs the CPU experts after it; after every
    sync the engine's log-probs equal the policy's (the experts moved between syncs)."""
    if not _trl_scale_beside_vllm():
        pytest.skip(f"needs trl-scale installed beside vLLM in .venv-vllm: {INSTALL_HINT}")
    from trl_scale.toy import build_tiny_model
    from trl_scale.toy.models import VLLM_CPU_SHAPE

    model = build_tiny_model(tmp_path / "moe", family="qwen3_moe", **VLLM_CPU_SHAPE)
    command = [str(VLLM_PYTHON), "-m", "tests.colocate_worker", str(tmp_path / "out"), model, "grpo"]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=500)
    lines = [json.loads(line[len("RESULT ") :]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and len(lines) == 1, (result.stdout + result.stderr)[-4000:]
    (run,) = lines
    assert run["steps"] == 3 and run["direct_load"] is False, run
    assert all(sync["diff"] <= SYNC_TOLERANCE for sync in run["syncs"]), run["syncs"]
    moved = [max(abs(a - b) for a, b in zip(s["policy"], t["policy"])) for s, t in zip(run["syncs"], run["syncs"][1:])]
    assert all(m > 10 * SYNC_TOLERANCE for m in moved), moved
