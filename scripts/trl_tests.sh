#!/usr/bin/env bash
# TRL 1.16's own GRPO, RLOO and DPO test files with trl-scale's classes swapped in (tests/trl_swap.py), outside CI:
# they need a checkout of huggingface/trl at v1.16.0 (its PyPI sdist carries no tests) and the Hub's tiny models.
# Usage: bash scripts/trl_tests.sh /path/to/trl [pytest args]   (after scripts/setup.sh test)
set -uo pipefail
cd "$(dirname "$0")/.."
TRL="${1:?the path of a huggingface/trl checkout at v1.16.0}"
shift
.venv/bin/python -m pytest -p tests.trl_swap --rootdir "$TRL" -q \
    "$TRL/tests/test_grpo_trainer.py" "$TRL/tests/test_rloo_trainer.py" "$TRL/tests/test_dpo_trainer.py" "$@"
