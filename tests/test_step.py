"""The run plan (`trainers/plan.py`), the chain built from it, and the printed step (`trl-scale step`,
`docs/step.md`): every interception declared by the feature that makes it."""

import ast

import pytest

import trl_scale
from trl_scale.cli import main
from trl_scale.cli_step import EXAMPLES, CountingEnvironment, example_step
from trl_scale.trainers.plan import RunPlan
from trl_scale.trainers.step import TRAINER_PATCHES, chain_for
from trl_scale.trainers.trl_facade import TrlFacade

from .helpers import ROOT, cpu_args

SERVERS = ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]


def _plan(tmp_path, trainer=trl_scale.GRPOTrainer, config_class=trl_scale.GRPOConfig, **arguments):
    passed = ("environment_factory", "rollout_func", "tools")  # the trainer's arguments, not the config's
    fields = {k: arguments.pop(k) for k in list(arguments) if k not in passed}
    config = config_class(**cpu_args(tmp_path, **fields))
    arguments = {"model": "toy:llama", "args": config, **arguments}
    plan = RunPlan.from_arguments(trainer.__name__, arguments)
    return plan, chain_for(trainer, plan)


def _server(**fields):
    return dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=SERVERS, **fields)


# ---- the plan: each tri-state resolved once, the chain only of features that act ----------------------------------


def test_a_run_without_trl_scale_features_has_only_the_features_that_always_act(tmp_path):
    plan, chain = _plan(tmp_path)
    assert plan.rollout.client == "trainer" and plan.rollout.asynchronous.staleness == 0
    names = chain.names()
    for absent in ("server_rollout", "dynamic_sampling", "stream_rewards", "remote_reference"):
        assert absent not in names, f"{absent} is in the chain of a run it does not act in"
    assert names[:2] == ["ratio_metrics", "context_length"]


@pytest.mark.parametrize(
    ("fields", "environments", "in_stream"),
    [
        ({}, False, False),  # streaming, no environment: rewards in the step (None resolves to False)
        ({}, True, True),  # an environment's rewards read its instance: in the stream
        ({"stream_rewards": True}, False, True),
        ({"async_rollout_mode": "ordered"}, True, True),  # ordered episodes stream too
        ({"async_rollout_mode": "ordered"}, False, False),
    ],
)
def test_stream_rewards_none_is_resolved_once_by_the_plan(tmp_path, fields, environments, in_stream):
    extra = {"environment_factory": CountingEnvironment} if environments else {}
    plan, chain = _plan(tmp_path, **_server(async_rollout_staleness=1, **fields), **extra)
    assert plan.rollout.client == "trl_scale"
    assert plan.rollout.rewards_in_stream is in_stream
    assert ("stream_rewards" in chain.names()) is in_stream


def test_a_setting_no_feature_acts_on_is_refused_by_the_plan(tmp_path):
    with pytest.raises(ValueError, match="environment_timeout=60 bounds"):
        _plan(tmp_path, environment_timeout=60.0)
    with pytest.raises(ValueError, match="stream_reward_workers=8"):
        _plan(tmp_path, **_server(async_rollout_staleness=1, stream_reward_workers=8))


def test_trl_scales_client_serves_a_server_run_with_images_in_every_rollout_mode(tmp_path, monkeypatch):
    from trl_scale.trainers import plan as plan_module

    monkeypatch.setattr(plan_module, "image_columns", lambda *datasets: ["image"])
    monkeypatch.setattr(plan_module, "check_image_inputs", lambda *args: None)  # no real images: test_image_inputs
    plan, chain = _plan(tmp_path, use_vllm=True, vllm_mode="server")
    assert plan.rollout.client == "trl_scale" and plan.images == ("image",)
    assert "server_rollout" in chain.names() and not plan.rollout.asynchronous.staleness
    ordered, _ = _plan(tmp_path, **_server(async_rollout_staleness=1, async_rollout_mode="ordered"))
    assert ordered.rollout.asynchronous.mode == "ordered" and ordered.images == ("image",)
    streaming, _ = _plan(tmp_path, **_server(async_rollout_staleness=1))
    assert streaming.rollout.asynchronous.mode == "streaming" and streaming.images == ("image",)
    # a streamed tool conversation, a streamed rollout_func and an episode in the stream send their images
    # (test_serve_images.py)
    agents = (
        {"tools": [len]},
        {"rollout_func": lambda prompts, trainer: None},
        {"environment_factory": CountingEnvironment},
    )
    for agent in agents:
        streamed, _ = _plan(tmp_path, **agent, **_server(async_rollout_staleness=1))
        assert streamed.rollout.asynchronous.mode == "streaming" and streamed.images == ("image",)
    # sequence parallelism shards token rows: refused before any step, naming the fix (set after the config's own
    # checks, which need as many processes as the group)
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path))
    config.sequence_parallel_size = 2
    with pytest.raises(ValueError, match="sequence_parallel_size=2: sequence parallel.*Fix: sequence_parallel_size=1"):
        RunPlan.from_arguments("GRPOTrainer", {"model": "toy:llama", "args": config})


# ---- the printed step ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_docs_page_holds_the_printed_step_of_each_example(name):
    page = (ROOT / "docs" / "step.md").read_text()
    printed = example_step(name)
    assert f"```text\n{printed}\n```" in page, f"docs/step.md is stale: run `trl-scale step --example {name}`"


def test_the_printed_step_of_a_streaming_run_with_environments():
    printed = example_step("streaming-environments")
    assert "rollout client: trl_scale; async: staleness 1, streaming, rewards in the stream" in printed
    rewards = next(line for line in printed.splitlines() if line.strip().startswith("rewards:"))
    assert rewards.strip().startswith("rewards: empty_rewards_warning > evaluation > phase_timing > stream_rewards >")
    assert "trainer.environment_factories" in printed and "trainer.rollout_func" not in printed


def test_trl_scale_step_prints_a_config_s_step(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path / 'out'}\nmodel_name_or_path: toy:llama\ndataset_name: toy:counting\n"
        "bf16: false\nreport_to: none\ndynamic_sampling: true\nnum_generations: 4\nper_device_train_batch_size: 4\n"
    )
    assert main(["step", "grpo", "--config", str(config), "--sequence_parallel_size", "1"]) == 0
    printed = capsys.readouterr().out
    assert "generate_and_score: ratio_metrics > packed_scoring > dynamic_sampling > TRL" in printed
    assert main(["step", "nonsense"]) == 2


# ---- every interception declared ----------------------------------------------------------------------------------

# Names whose replacement on an object other than `self` is an interception (TRL's, the model's, the accelerator's,
# a module's), and the calls that make one for a block.
PATCHED_ATTRIBUTES = {
    "forward",
    "backward",
    "__class__",
    "_compiled_call_impl",
    "VLLMGeneration",
    "reward_funcs",
    "rollout_func",
    "environment_factories",
    "_environment_pool",
    "vllm_generation",
}


def _modules_making_interceptions() -> set[str]:
    found = set()
    for path in (ROOT / "trl_scale").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            patched = any(
                isinstance(t, ast.Attribute)
                and t.attr in PATCHED_ATTRIBUTES
                and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                for t in targets
            )
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if patched or (call and node.func.id in ("overridden", "setattr") and _on_another(node)):
                found.add(str(path.relative_to(ROOT / "trl_scale")))
    return found


def _on_another(call: ast.Call) -> bool:
    """`overridden(config, ...)` / `setattr(module, ...)`: not the definition's own object."""
    first = call.args[0] if call.args else None
    return call.func.id == "overridden" or (isinstance(first, ast.Name) and first.id == "module")


def _declared_modules() -> set[str]:
    kinds = {
        kind
        for trainer in (trl_scale.GRPOTrainer, trl_scale.RLOOTrainer, trl_scale.DPOTrainer, trl_scale.PPOTrainer)
        for kind in trainer.FEATURES
    }
    patches = [patch for kind in kinds for patch in kind.PATCHES]
    patches += [patch for declared in TRAINER_PATCHES.values() for patch in declared]
    patches += [patch for _, patch in TrlFacade.interceptions()]
    return {patch.where for patch in patches}


def _writes_the_trainer(function: ast.FunctionDef) -> bool:
    """`trainer.X = ...` / `self._trainer.X = ...` (tuple targets too) in `function`'s body, nested ones included,
    or `overridden(self._trainer, X=...)` (construction's swap, restored on exit)."""

    def on_trainer(target) -> bool:
        if isinstance(target, ast.Tuple):
            return any(on_trainer(element) for element in target.elts)
        return isinstance(target, ast.Attribute) and ast.unparse(target.value) in ("trainer", "self._trainer")

    def swaps_trainer(node) -> bool:
        return (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "overridden"
            and bool(node.args)
            and ast.unparse(node.args[0]) == "self._trainer"
        )

    nodes = list(ast.walk(function))
    assigned = any(on_trainer(t) for node in nodes if isinstance(node, ast.Assign) for t in node.targets)
    return assigned or any(swaps_trainer(node) for node in nodes)


def test_every_write_of_the_trl_facade_is_a_declared_interception():
    """A method of `TrlFacade` that assigns an attribute of TRL's trainer carries its `interception` declaration
    (so `trl-scale step` lists it); a declared one writes."""
    tree = ast.parse((ROOT / "trl_scale" / "trainers" / "trl_facade.py").read_text())
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrlFacade")
    writing = {f.name for f in facade.body if isinstance(f, ast.FunctionDef) and _writes_the_trainer(f)}
    declared = {name for name, _ in TrlFacade.interceptions()}
    assert writing and writing == declared, (writing - declared, declared - writing)
    others = [
        f.name
        for c in tree.body
        if isinstance(c, ast.ClassDef) and c.name in ("TrlReads", "TrlCalls")
        for f in c.body
        if isinstance(f, ast.FunctionDef) and _writes_the_trainer(f)
    ]
    assert not others, f"writes outside TrlFacade's declared methods: {others}"


def test_every_module_that_makes_an_interception_is_named_by_a_declaration():
    undeclared = _modules_making_interceptions() - _declared_modules()
    assert not undeclared, f"interceptions no feature declares (add a Patch to the feature's PATCHES): {undeclared}"


def test_the_page_names_exactly_the_features_built_only_where_they_act(tmp_path):
    """docs/step.md's list of the features left out of a chain where they would not act is the code's: those of
    GRPO's features absent from the demo's chain (a run using none of trl-scale's options)."""
    import re

    from trl_scale.cli_step import example_arguments
    from trl_scale.trainers.plan import RunPlan
    from trl_scale.trainers.step import chain_for

    page = " ".join((ROOT / "docs" / "step.md").read_text().split())
    listed = re.search(r"absent from the chain otherwise: ([a-z_, ]+)\.", page).group(1)
    trainer_class, arguments = example_arguments("demo", str(tmp_path))
    chain = chain_for(trainer_class, RunPlan.from_arguments(trainer_class.__name__, arguments))
    absent = {kind.name for kind in trainer_class.FEATURES} - set(chain.names())
    assert set(listed.split(", ")) == absent, (listed, absent)
    assert "`trl`:" not in page  # the client TRL's own vLLM client was is gone: trl-scale's serves server mode
