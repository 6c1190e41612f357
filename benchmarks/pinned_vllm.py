"""Two real vLLM CPU servers for a benchmark, pinned: the servers share one half of the machine's cores, the trainer
(this process) has the other half. A context manager: yields (model path, server URLs), stops the servers after."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests/real_vllm.py: the harness that starts real vLLM servers


@contextmanager
def pinned_vllm_servers(prefix: str, count: int = 2, **shape):
    """`shape`: the toy model's config beyond vLLM's CPU shape (e.g. `num_layers`)."""
    import torch
    import transformers

    from tests.real_vllm import VLLM_PYTHON, start_vllm_servers, vllm_cpu_available
    from trl_scale.toy import build_tiny_model
    from trl_scale.toy.models import VLLM_CPU_SHAPE

    if not vllm_cpu_available():
        raise SystemExit(f"real vLLM is not installed at {VLLM_PYTHON}: bash scripts/setup_vllm.sh")
    transformers.logging.set_verbosity_error()
    cores = sorted(os.sched_getaffinity(0))
    trainer_cores, server_cores = set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])
    work = tempfile.mkdtemp(prefix=prefix)
    model_path = build_tiny_model(os.path.join(work, "model"), **{**VLLM_CPU_SHAPE, **shape})
    flags = ("--logprobs-mode", "processed_logprobs", "--weight-transfer-config", '{"backend":"trl_scale_gloo"}')
    servers = start_vllm_servers([(model_path, flags, {"max_model_len": 256}) for _ in range(count)])
    try:
        for server in servers:  # every process of each server on the servers' core(s)
            for pid in server.group_pids():
                os.sched_setaffinity(pid, server_cores)
        os.sched_setaffinity(0, trainer_cores)
        torch.set_num_threads(len(trainer_cores))
        yield model_path, [server.url for server in servers], work
    finally:
        for server in servers:
            server.stop()
