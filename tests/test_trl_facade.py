"""The TRL facade (`trainers/trl_facade.py`) is the only way features reach TRL's trainer: every attribute a feature
reads through it is declared there, nothing outside the facade, the adapter and the trainer classes names the
trainer, and a feature hook is handed the run."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest

from trl_scale.trainers.feature import AROUND_HOOKS, EVENTS, Feature
from trl_scale.trainers.trl_facade import TrlFacade

from .helpers import ROOT

TRAINERS = ROOT / "trl_scale" / "trainers"


def _design_counts():
    """`scripts/design_counts.py`, whose HOLDERS (the modules that may hold the trainer itself) these tests share."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("design_counts", ROOT / "scripts" / "design_counts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the facade, the adapter, the trainer classes and what their constructor runs before the run exists (construction.py:
# TRL's signature, TRL's class)
HOLDERS = _design_counts().HOLDERS
FACADE_NAMES = ("trl", "run.trl", "self.trl")


def _members() -> set[str]:
    return {name for klass in TrlFacade.__mro__ for name in vars(klass)}


def _facade_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """`trl.X`, `run.trl.X`, `self.trl.X` attribute uses: (line, X)."""
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in FACADE_NAMES
    ]


def test_every_attribute_read_through_the_facade_is_declared_on_it():
    members, undeclared = _members(), []
    for path in sorted((ROOT / "trl_scale").rglob("*.py")):
        if path.name == "trl_facade.py":
            continue
        tree = ast.parse(path.read_text())
        undeclared += [f"{path.name}:{line} {name}" for line, name in _facade_uses(tree) if name not in members]
    assert not undeclared, f"declare these on TrlFacade (a Read, or a method): {undeclared}"


def test_no_module_but_the_holders_names_the_trainer():
    """No `trainer.X` (nor a parameter named `trainer`) in `trl_scale/trainers` outside the facade, the adapter and
    the trainer classes: features are handed the run."""
    found = []
    for path in sorted(TRAINERS.glob("*.py")):
        if path.name in HOLDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer":
                found.append(f"{path.name}:{node.lineno} trainer.{node.attr}")
            if isinstance(node, ast.arg) and node.arg == "trainer":
                found.append(f"{path.name}:{node.lineno} parameter trainer")
    assert not found, found


def test_feature_hooks_take_the_run():
    """Every hook and event a trl-scale feature overrides names its first argument `run`."""
    import trl_scale

    kinds = {
        kind
        for trainer in (trl_scale.GRPOTrainer, trl_scale.RLOOTrainer, trl_scale.DPOTrainer, trl_scale.PPOTrainer)
        for kind in trainer.FEATURES
    }
    wrong = []
    for kind in kinds:
        for hook in (*AROUND_HOOKS, *EVENTS):
            method = vars(kind).get(hook)
            if method is not None:
                first = ast.parse(ast.unparse(ast.parse(_source(method)))).body[0].args.args[1].arg
                if first != "run":
                    wrong.append(f"{kind.__name__}.{hook}({first}, ...)")
    assert kinds and not wrong, wrong
    assert list(_params(Feature.setup)) == ["self", "run"]


def _source(method) -> str:
    import inspect
    import textwrap

    return textwrap.dedent(inspect.getsource(method))


def _params(method) -> list[str]:
    import inspect

    return list(inspect.signature(method).parameters)


def test_the_facade_reads_declared_attributes_and_refuses_the_rest():
    """A declared read answers the trainer's value (or, where a family has none, its declared default); an
    undeclared name is an AttributeError, and nothing can be set on the facade."""
    trainer = SimpleNamespace(args="config", _metrics={"train": {"a": [1.0]}}, model=SimpleNamespace(training=True))
    facade = TrlFacade(trainer)
    assert facade.args == "config" and facade.vllm_generation is None
    assert facade.metrics() == {"a": [1.0]}
    with pytest.raises(AttributeError):
        facade.lr_scheduler  # noqa: B018 (not declared)
    with pytest.raises(AttributeError):
        facade.args = "other"
    with pytest.raises(AttributeError):
        facade.anything = 1


def test_a_replaced_reward_list_is_put_back_even_when_the_call_fails():
    trainer = SimpleNamespace(reward_funcs=["mine"])
    with pytest.raises(RuntimeError), TrlFacade(trainer).reward_funcs_replaced(["replayed"]):
        assert trainer.reward_funcs == ["replayed"]
        raise RuntimeError("a reward function failed")
    assert trainer.reward_funcs == ["mine"]
