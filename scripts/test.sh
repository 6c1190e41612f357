#!/usr/bin/env bash
# Set up (if needed) and run the CPU test suite: the README's test command, and what CI runs.
# It also builds .venv-vllm (real vLLM, CPU build) for the real-vLLM tests; TRL_SCALE_SKIP_VLLM=1 skips that (those
# tests then skip, naming the command that installs it).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
if [ "${TRL_SCALE_SKIP_VLLM:-0}" != "1" ]; then
    bash scripts/setup_vllm.sh || { echo "setting up .venv-vllm failed (TRL_SCALE_SKIP_VLLM=1 skips it)" >&2; exit 1; }
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# Two workers (pytest-xdist): most tests hold one core (one torch thread), so two at a time use the machine's two
# (three were slower: 33.7 min against 31). Each module runs whole on one worker, in order (its module-scoped servers
# start once), the slowest modules first (tests/conftest.py; --no-loadscope-reorder keeps that order).
.venv/bin/python -m pytest -m "not gpu and not vllm and not launchers and not learning and not chaos" -p no:cacheprovider -q \
    --durations=15 -n 2 --dist loadfile --no-loadscope-reorder "$@"
