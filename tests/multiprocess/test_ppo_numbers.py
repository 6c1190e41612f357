"""PPO's multi-process numbers, fast, in CI: 2 processes (gloo) × 2 accumulation steps × 2 rows take the steps of
one process with the 8 rows at once.

Greedy sampling makes the rollouts the same however the batch is split; a model whose EOS often wins makes the
completions 1 to 6 tokens long, so processes and micro-batches hold unequal token counts. With `loss_type="dapo"`
(the default) every token weighs the same wherever it lies, so the policy's and the critic's gradient norms agree
to round-off. Each of these, applied alone, turns this test red: advantages whitened per process, rewards of one
process used by all, the critic's loss not divided by the accumulation steps, a replicated critic summing its
gradients over processes instead of averaging, the losses averaged per micro-batch (`bnpo`)."""

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_scale.toy import build_tiny_model

from ..helpers import ROOT, accelerate_launch, run_to_completion

STEPS = 3
KEYS = ("grad_norm", "critic/grad_norm", "objective/scores", "objective/kl")


@pytest.fixture(scope="module")
def early_eos_model(tmp_path_factory) -> str:
    """A tiny Llama whose EOS logit often wins: greedy completions of 1 to 6 tokens."""
    path = build_tiny_model(tmp_path_factory.mktemp("early-eos"), "llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight = model.lm_head.weight
        weight[eos] = weight.mean(0) + torch.randn(weight.size(1), generator=generator)
    model.save_pretrained(path)
    return path


def _command(model: str, output_dir, per_device: int, accumulation: int, *extra: str) -> list[str]:
    command = ["-m", "trl_scale.cli", "ppo", "--config", str(ROOT / "examples" / "ppo_tiny_cpu.yaml")]
    command += ["--model_name_or_path", model, "--output_dir", str(output_dir), "--max_steps", str(STEPS)]
    command += ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation)]
    command += ["--top_k", "1", "--max_completion_length", "6", "--learning_rate", "1e-2", "--logging_steps", "1"]
    command += ["--reward_funcs", "tests.helpers.token_parity_reward", "--num_toy_examples", "64"]
    command += ["--disable_tqdm", "true", "--save_strategy", "steps", "--save_steps", str(STEPS), *extra]
    return command


def _logged(output_dir) -> list[dict]:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [entry for entry in state["log_history"] if "loss" in entry]


@pytest.fixture(scope="module")
def one_process(early_eos_model, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("ppo-one-process")
    run_to_completion([sys.executable, *_command(early_eos_model, output_dir, per_device=8, accumulation=1)])
    return output_dir


def test_two_processes_with_accumulation_take_the_steps_of_one_process(early_eos_model, one_process, tmp_path):
    output_dir = tmp_path / "two-processes"
    run_to_completion(accelerate_launch(2) + _command(early_eos_model, output_dir, per_device=2, accumulation=2))
    expected, got = _logged(one_process), _logged(output_dir)
    assert len(expected) == len(got) == STEPS
    lengths = [entry["completions/mean_length"] for entry in expected]
    assert any(length < 6 for length in lengths), lengths  # unequal lengths, or the test cannot tell dapo from bnpo
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        for key in KEYS:
            assert g[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), (step, key, g[key], e[key])
