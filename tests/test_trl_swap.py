"""The plugin that runs TRL's own test files against trl-scale's classes (`scripts/trl_tests.sh`): loaded, TRL's
names give trl-scale's classes, as TRL's tests import them. Checked in a child process (the swap is global)."""

import subprocess
import sys

from .helpers import ROOT, subprocess_env


def test_the_plugin_swaps_trls_trainers_for_trl_scales():
    code = (
        "import tests.trl_swap, trl, trl_scale\n"
        "from trl import GRPOTrainer, DPOConfig\n"
        "assert GRPOTrainer is trl_scale.GRPOTrainer and DPOConfig is trl_scale.DPOConfig\n"
        "assert all(getattr(trl, n) is getattr(trl_scale, n) for n in tests.trl_swap.SWAPPED)\n"
        "assert issubclass(trl_scale.GRPOTrainer, trl.trainer.grpo_trainer.GRPOTrainer)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
