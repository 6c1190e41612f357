#!/usr/bin/env bash
# Create .venv and install trl-scale into it. torch is installed first, pinned, so that pip never
# resolves an unpinned torch (on a CPU machine that would pull several GB of CUDA wheels).
# Usage: bash scripts/setup.sh [extras]   e.g. bash scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-demo}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
.venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
if [[ ",${EXTRAS}," == *",test,"* || ",${EXTRAS}," == *",deepspeed,"* ]]; then
    # DeepSpeed builds from source; DS_BUILD_OPS=0 skips its CUDA ops (its CPU op JIT-builds at first use), and no
    # build isolation keeps pip from resolving a torch of its own.
    .venv/bin/python -c "import deepspeed" 2>/dev/null || DS_BUILD_OPS=0 .venv/bin/python -m pip install -q \
        --no-build-isolation "deepspeed==0.19.8" "torch==${TORCH_VERSION}"
    # Its CPU op (shared-memory collectives), which every DeepSpeed process on a CPU machine loads, built now, once:
    # otherwise the first DeepSpeed run compiles it (1-3 min on 2 cores) inside whatever it is running. Cached in
    # ~/.cache/torch_extensions per interpreter and paths; a second setup finds it built.
    .venv/bin/python - <<'PY' 2>/dev/null || echo "could not prebuild DeepSpeed's CPU op: its first use builds it" >&2
import sys
from deepspeed.accelerator import get_accelerator
if sys.platform == "linux" and get_accelerator().device_name() == "cpu":
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        builder.load(verbose=False)
PY
fi
if [[ ",${EXTRAS}," == *",test,"* ]] && ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null; then
    # the docs' browser test (tests/test_docs.py) opens the built site in Debian's chromium; it skips without one
    apt-get install -y -q chromium >/dev/null 2>&1 || echo "could not install chromium: the docs' browser test will skip" >&2
fi
