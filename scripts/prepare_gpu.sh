#!/usr/bin/env bash
# Prepare the carry folder for the GPU figures (benchmarks/gpu.py) on a lent GPU machine: the wheels that machine
# lacks (trl, datasets and its dill/multiprocess; transformers and peft at this checkout's versions, so the GPU runs
# the code the CPU tests run), for Python 3.12 on x86-64, into .gpu-carry/ (git-ignored, checked under 64 MiB).
# trl-scale itself needs no wheel: the working tree travels, and PYTHONPATH points at it. Prints the command to run
# there. Usage: bash scripts/prepare_gpu.sh   (after scripts/setup.sh, whose .venv gives the versions)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${DEST:-.gpu-carry}"
PYTHON="${PYTHON:-.venv/bin/python}"
version() { "$PYTHON" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" \
    "trl==$(version trl)" "transformers==$(version transformers)" "peft==$(version peft)" \
    "datasets==$(version datasets)" "dill==$(version dill)" "multiprocess==$(version multiprocess)"
size_kib=$(du -sk "$DEST" | cut -f1)
if [ "$size_kib" -ge $((64 * 1024)) ]; then
    echo "$DEST is ${size_kib} KiB: over the 64 MiB a device call carries" >&2
    exit 1
fi
ls -1 "$DEST"
echo "$DEST: ${size_kib} KiB"
# The GPU tests (tests/test_gpu.py: the head on TRL's kernel, packed scoring, the checkpointed layers planned by real
# CUDA memory), then the training-step figures (benchmarks/gpu.py --parts train; --parts head,scoring,e2e,train for all).
cat <<CMD
Run on the GPU machine (device tool: carry ["$DEST"], timeout 480):
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $DEST/*.whl && export PYTHONPATH=/tmp/site:\$PWD:\$PWD/vllm_plugin PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 && nvidia-smi --query-gpu=name,memory.total --format=csv; timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -25 | tee \$OUT/gpu_tests.txt; python3 benchmarks/gpu.py --parts train --out \$OUT --budget-s 330
CMD
