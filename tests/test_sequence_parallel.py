"""Ulysses sequence parallelism in the packed scoring engine (DeepSpeed's ALST), on 2 CPU processes (gloo): the
same batch scored sharded over the 2 ranks equals one process's TRL padded forward — per-token log-probs and
entropies, the loss, and the gradients after data-parallel averaging — for batches with unequal lengths, several
sequences per packed row, a sequence longer than half the token budget and an odd total length, per model family;
each mutation the issue names goes red; and the refusals name their fix."""

import json
import subprocess
import sys

import pytest
from transformers import AutoConfig

from trl_scale.scoring.sequence_parallel import check_sequence_parallel, core_attention_for
from trl_scale.toy import build_tiny_model, tiny_config

from .helpers import ROOT, free_port, subprocess_env

TOLERANCE = 1e-5


def sharded_vs_one_process(model_path: str, out, *extra: str) -> list[dict]:
    """Run the 2-rank worker; returns each rank's largest differences."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port()), "-m", "tests.sequence_parallel_worker"]
    command += ["--model", model_path, "--out", str(out), *extra]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out.parent / f"{out.name}.{rank}").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp-models")
    return {
        family: build_tiny_model(root / family, family=family)
        for family in ("llama", "qwen2", "qwen3", "mistral", "gemma2")
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, token_budget",
    [("llama", None), ("llama", 30), ("qwen2", 30), ("qwen3", None), ("mistral", 30), ("gemma2", 30)],
)
def test_two_ranks_score_like_one_process(family_models, tmp_path, family, token_budget):
    """Lengths 9, 23, 12, 5 (49 tokens: odd); without a budget one packed row of 4 sequences, with 30 a row of the
    23-token sequence alone (over half the budget) and a row of 3. Mistral: sliding window 8; Gemma 2: sliding
    window and attention soft-capping."""
    extra = ["--token-budget", str(token_budget)] if token_budget else []
    for result in sharded_vs_one_process(family_models[family], tmp_path / "r", *extra):
        assert result["group"] == 2 and result["same_grad_names"] and result["scored_tokens"] == 37
        for key in ("log_probs", "entropy", "loss", "grads"):
            assert result[key] <= TOLERANCE, (family, token_budget, key, result)


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["shift", "twice", "rank0"])
def test_each_mutation_breaks_the_parity(family_models, tmp_path, mutation):
    """Shard offsets shifted by one; a token at a slice boundary counted on both ranks; the gathered values taken
    from rank 0 only: each moves the log-probs, the loss and the gradients far past the tolerance."""
    (result, _) = sharded_vs_one_process(family_models["llama"], tmp_path / "r", "--mutation", mutation)
    assert result["log_probs"] > 1e-2 and result["loss"] > 1e-3 and result["grads"] > 1e-3, result


@pytest.mark.parametrize(
    "overrides, world, sp, match",
    [
        ({}, 3, 2, "does not divide the 3 processes"),
        ({"num_heads": 4, "num_kv_heads": 2}, 3, 3, "does not divide this model's 4 attention heads"),
        ({"hidden_size": 48, "num_heads": 6, "num_kv_heads": 3}, 4, 2, "3 key/value heads"),
    ],
)
def test_refusals_name_the_fix(overrides, world, sp, match):
    with pytest.raises(ValueError, match=f"{match}.*Fix:"):
        check_sequence_parallel(tiny_config("llama", **overrides), sp, world)


@pytest.mark.parametrize("family", ["lfm2", "nemotron_h", "qwen3_next"])
def test_stateful_hybrids_are_refused(family):
    """Convolution, Mamba and linear-attention layers carry state along the sequence: a shard boundary cuts it."""
    with pytest.raises(ValueError, match="state runs along the sequence.*Fix: sp_size=1"):
        check_sequence_parallel(tiny_config(family), 2, 2)


def test_the_core_attention_per_kernel_and_an_unknown_kernel_is_refused():
    assert core_attention_for("flash_attention_2") == "flash_attention_2"  # its varlen path keeps packing exact
    assert {core_attention_for(k) for k in ("sdpa", "eager", "flex_attention")} == {"trl_scale_packed_sp"}
    with pytest.raises(ValueError, match="kernels-community/foo.*Fix: attn_implementation='sdpa'"):
        check_sequence_parallel(tiny_config("llama"), 2, 2, "kernels-community/foo")


def test_a_saved_config_is_checked_as_loaded(family_models):
    check_sequence_parallel(AutoConfig.from_pretrained(family_models["mistral"]), 2, 4, "sdpa")  # no refusal


def test_trainers_refuse_sp_size_until_they_take_it(tmp_path):
    """TRL refuses it for GRPO and RLOO; TRL's DPO would hand it to accelerate's ALST, which would see trl-scale's
    packed rows without their boundaries: refused too, naming the fix."""
    from accelerate.utils import ParallelismConfig

    import trl_scale

    with pytest.raises(ValueError, match="sp_size=2.*Fix: sp_size=1"):
        trl_scale.DPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"),
        )
