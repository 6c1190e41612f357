import json
import os
import pathlib

# Nothing downloads, nothing phones home; set before transformers/trl are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from trl_scale.toy import build_tiny_model, build_tiny_vlm  # noqa: E402
from trl_scale.toy.models import VLLM_CPU_SHAPE  # noqa: E402

# Measured seconds per test file (scripts/module_seconds.py writes it from a run): the slowest files are handed to
# pytest-xdist first (with --no-loadscope-reorder, which keeps this order), so the two workers end together; a file
# not measured yet counts as UNMEASURED_SECONDS.
MODULE_SECONDS = json.loads((pathlib.Path(__file__).parent / "module_seconds.json").read_text())
UNMEASURED_SECONDS = 60.0


def _module_seconds(item) -> float:
    return MODULE_SECONDS.get(item.nodeid.split("::")[0], UNMEASURED_SECONDS)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -_module_seconds(item))  # stable: a file's tests keep their order, together
    has_cuda = torch.cuda.is_available()
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except ImportError:
        has_vllm = False
    real_vllm = None
    for item in items:
        if "vllm_cpu" in item.keywords:
            from .real_vllm import INSTALL_HINT, vllm_cpu_available

            real_vllm = vllm_cpu_available() if real_vllm is None else real_vllm
            if not real_vllm:
                item.add_marker(pytest.mark.skip(reason=f"needs real vLLM in .venv-vllm: {INSTALL_HINT}"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM"))


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """A tiny model of each family, built on first use and loaded back with `from_pretrained`: ``zoo("qwen3")``
    (Gemma 2 and GPT-OSS with eager attention, which they need; sdpa otherwise)."""
    paths = {}

    def build(family: str) -> str:
        if family not in paths:
            attn = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"  # neither has sdpa
            paths[family] = build_tiny_model(tmp_path_factory.mktemp(family), family, attn_implementation=attn)
        return paths[family]

    return build


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama")


@pytest.fixture(scope="session")
def tiny_llama_hd64(tmp_path_factory) -> str:
    """The tiny Llama with head_dim 64, which vLLM's CPU attention takes (it refuses head_dim 16)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hd64"), **VLLM_CPU_SHAPE)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), family="qwen2")


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> str:
    """A tiny Gemma 3 vision-language model and its processor."""
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-reward"), family="llama", kind="reward", seed=1)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model_path(request, tiny_llama, tiny_qwen2) -> str:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """Two `trl-scale serve` processes on the tiny Llama, shared by a test module."""
    from .helpers import start_servers

    running = start_servers(tiny_llama, 2)
    yield running
    for server in running:
        server.stop()
