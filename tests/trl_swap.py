"""A pytest plugin for TRL's own test files: trl-scale's trainers and configs in place of TRL's, so that TRL 1.16's
tests (tests/test_grpo_trainer.py, test_rloo_trainer.py, test_dpo_trainer.py of a checkout of huggingface/trl at
v1.16.0) run against them. `bash scripts/trl_tests.sh /path/to/trl` runs them (outside CI: they need the Hub's tiny
test models and a TRL checkout, neither of which this repository carries)."""

import trl

import trl_scale

SWAPPED = ("GRPOTrainer", "GRPOConfig", "RLOOTrainer", "RLOOConfig", "DPOTrainer", "DPOConfig")


def swap() -> None:
    """`from trl import GRPOTrainer` (and the rest), as TRL's tests write it, gives trl-scale's class."""
    for name in SWAPPED:
        setattr(trl, name, getattr(trl_scale, name))


swap()  # at plugin load, before pytest imports any test module
