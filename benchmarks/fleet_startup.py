"""Start-up of managed vLLM servers: N servers started at once by `ServerFleet` vs one server, and vs N started
one after another (what a user starting them by hand, waiting for each, gets). Real vLLM (the CPU build in
.venv-vllm, `bash scripts/setup_vllm.sh`), a toy model vLLM's CPU attention serves.

Each figure is the time from launch until every server answers `/health`. On a machine with fewer cores than
servers need, parallel start is bounded by the CPU (vLLM's start-up is mostly Python imports and model set-up);
on a GPU node each server has its own GPU and cores, so parallel start should come closer to the time of one.

Usage: python benchmarks/fleet_startup.py [--servers 2] [--vllm-python .venv-vllm/bin/python]. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from trl_scale.fleet import FleetSpec, LocalLauncher, ServerFleet
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import VLLM_CPU_SHAPE

ROOT = Path(__file__).resolve().parents[1]
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start_seconds(model: str, python: str, count: int) -> float:
    spec = FleetSpec(num_servers=count, model=model, server_args=SERVER_ARGS, env=SERVER_ENV, python=python)
    fleet = ServerFleet(spec, LocalLauncher(spec))
    try:
        fleet.start()
        return fleet.start_seconds
    finally:
        fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    args = parser.parse_args()
    if not os.access(args.vllm_python, os.X_OK):
        raise SystemExit(f"no vLLM Python at {args.vllm_python}: bash scripts/setup_vllm.sh")
    model = build_tiny_model(tempfile.mkdtemp(prefix="fleet-bench-"), **VLLM_CPU_SHAPE)
    start_seconds(model, args.vllm_python, 1)  # warm the page cache: the timed runs read vLLM from memory
    one = start_seconds(model, args.vllm_python, 1)
    parallel = start_seconds(model, args.vllm_python, args.servers)
    sequential = args.servers * one  # one after another, each waited for: N starts of one
    print(f"1 server: {one:.1f} s; {args.servers} at once: {parallel:.1f} s ({parallel / one:.2f}x one)")
    print(f"{args.servers} one after another (N x one): {sequential:.1f} s; parallel start saves ", end="")
    print(f"{1 - parallel / sequential:.0%} (cores: {os.cpu_count()})")
    result = {
        "benchmark": "fleet_startup",
        "servers": args.servers,
        "cores": os.cpu_count(),
        "one_server_s": round(one, 2),
        "parallel_s": round(parallel, 2),
        "parallel_vs_one": round(parallel / one, 3),
        "sequential_s": round(sequential, 2),
        "parallel_vs_sequential": round(parallel / sequential, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
