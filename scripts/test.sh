#!/usr/bin/env bash
# Set up (if needed) and run the CPU test suite: the README's test command, and what CI runs.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
.venv/bin/python -m pytest -m "not gpu and not vllm and not launchers" -p no:cacheprovider -q "$@"
