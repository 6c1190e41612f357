"""Every example does what its header says: the tiny CPU configs learn (the counting reward rises; DPO's margin
grows), run through the CLI as a user runs them, with fewer steps than the full example."""

import json
import re
import subprocess
import sys

import pytest

from trl_scale.cli import main

from .helpers import ROOT

EXAMPLES = ROOT / "examples"
# (steps, metric, least rise from the first logged value to the last): about half of each example's run.
SHORT_RUNS = {
    "grpo": (200, "reward", 0.1),
    "rloo": (200, "reward", 0.05),
    "ppo": (160, "reward", 0.1),
    "dpo": (30, "rewards/margins", 0.3),
}


@pytest.mark.parametrize("method", list(SHORT_RUNS))
def test_tiny_example_learns(method, tmp_path):
    steps, metric, rise = SHORT_RUNS[method]
    output_dir = tmp_path / method
    argv = [method, "--config", str(EXAMPLES / f"{method}_tiny_cpu.yaml"), "--output_dir", str(output_dir)]
    argv += [
        "--max_steps",
        str(steps),
        "--save_strategy",
        "steps",
        "--save_steps",
        str(steps),
        "--disable_tqdm",
        "true",
    ]
    assert main(argv) == 0
    state = json.loads((output_dir / f"checkpoint-{steps}" / "trainer_state.json").read_text())
    values = [entry[metric] for entry in state["log_history"] if metric in entry]
    assert len(values) >= 3, values
    assert values[-1] >= values[0] + rise, (method, values)


def test_ppo_counting_script_learns(tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_counting.py"), "--output-dir", str(tmp_path), "--max-steps", "160"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(
        float, re.search(r"counting reward: ([\d.]+) before PPO, ([\d.]+) after", result.stdout).groups()
    )
    assert after >= before + 0.1, (before, after)
