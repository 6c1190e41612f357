"""trl-scale's warnings print once per run, not once per rank: a 2-process GRPO run on a model packing is not
exact for (OPT), where every rank finds the same and used to say so."""

import pytest

from trl_scale.toy import build_tiny_model

from ..helpers import ROOT, accelerate_launch, run_to_completion


@pytest.fixture(scope="module")
def tiny_opt(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-opt"), "opt")


def test_a_warning_prints_once_in_a_two_process_run(tiny_opt, tmp_path):
    example = (ROOT / "examples" / "grpo_tiny_cpu.yaml").read_text().splitlines()
    config = tmp_path / "grpo.yaml"  # the example with padding_free at its default (None: fall back with a warning)
    config.write_text("\n".join(line for line in example if not line.startswith(("padding_free", "token_budget"))))
    command = accelerate_launch(2) + ["-m", "trl_scale.cli", "grpo", "--config", str(config)]
    command += ["--output_dir", str(tmp_path / "out"), "--model_name_or_path", tiny_opt, "--max_steps", "1"]
    command += ["--per_device_train_batch_size", "8", "--disable_tqdm", "true"]
    output = run_to_completion(command)
    assert "training on 2 process(es)" in output
    assert output.count("packed scoring is not exact for model type 'opt'") == 1, output[-3000:]
