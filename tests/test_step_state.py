"""A step's data has one owner (`rollout.step_state`): every write and read of a `StepState` field in the package is
one its declaration (`STEP_FIELDS`) names, and nothing else holds a batch's parcel (the read-ahead and generation
objects keep no streamed batch, rewards or records)."""

from __future__ import annotations

import ast
from pathlib import Path

from trl_scale.rollout.step_state import SERVE_CALLERS, STEP_FIELDS, StepState

PACKAGE = Path(__file__).resolve().parent.parent / "trl_scale"
FIELDS = {field.name for field in STEP_FIELDS}
WRITES = {"give", "add", "replace_newest", "clear"}
READS = {"take", "take_if_given", "newest", "all"}


def _holder(node: ast.expr, cls: str | None) -> bool:
    """`run.step`, a `state` or `step` name, or `self` inside StepState: an expression that is a step's state."""
    if isinstance(node, ast.Attribute) and node.attr == "step":
        return True
    if isinstance(node, ast.Name):
        return node.id in ("state", "step") or (node.id == "self" and cls == "StepState")
    return False


def step_field_uses(sources: dict[str, str]) -> dict[tuple[str, str], set[str]]:
    """(field, "write" | "read" | "other") -> the functions (`module.Class.function`) that use it so."""
    uses: dict[tuple[str, str], set[str]] = {}

    def visit(node: ast.AST, module: str, scope: list[str], cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, module, [*scope, child.name], child.name)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                if len(scope) and scope[-1][0].islower():  # a nested function counts as its enclosing one
                    visit(child, module, scope, cls)
                else:
                    visit(child, module, [*scope, child.name], cls)
            else:
                if isinstance(child, ast.Attribute) and child.attr in FIELDS and _holder(child.value, cls):
                    parent = getattr(child, "parent", None)
                    kind = "other"
                    if isinstance(parent, ast.Attribute) and parent.attr in WRITES:
                        kind = "write"
                    elif isinstance(parent, ast.Attribute) and parent.attr in READS:
                        kind = "read"
                    uses.setdefault((child.attr, kind), set()).add(".".join([module, *scope]))
                visit(child, module, scope, cls)

    for name, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node
        visit(tree, name, [], None)
    return uses


def _sources() -> dict[str, str]:
    return {
        ".".join(path.relative_to(PACKAGE).with_suffix("").parts): path.read_text() for path in PACKAGE.rglob("*.py")
    }


def test_every_use_of_a_step_field_is_declared():
    uses = step_field_uses(_sources())
    for field in STEP_FIELDS:
        assert uses.get((field.name, "write"), set()) == set(field.writers), field.name
        assert uses.get((field.name, "read"), set()) == set(field.readers), field.name
        others = uses.get((field.name, "other"), set()) - {"rollout.step_state.StepState.__init__"}  # made there
        assert not others, f"{field.name} used other than written or read (handed on, aliased): {others}"
    assert {name for name, _ in uses} <= FIELDS


def test_serve_has_the_declared_callers():
    callers = set()
    for module, text in _sources().items():
        tree = ast.parse(text)
        for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
            body = tree.body if cls is None else cls.body
            for function in [n for n in body if isinstance(n, ast.FunctionDef)]:
                calls = [
                    n
                    for n in ast.walk(function)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "serve"
                ]
                if any(_holder(call.func.value, None) for call in calls):
                    callers.add(".".join([module, *([cls.name] if cls else []), function.name]))
    assert callers == set(SERVE_CALLERS)


def test_the_check_sees_an_undeclared_write():
    """Red check of the checker: a feature that keeps a streamed batch for itself is found."""
    planted = "class Planted:\n    def hook(self, run, proceed):\n        run.step.records.add(1)\n"
    uses = step_field_uses({"trainers.planted": planted})
    assert uses[("records", "write")] == {"trainers.planted.Planted.hook"}


def test_no_parcel_is_left_on_the_read_ahead_or_generation_objects():
    """The read-ahead rollout and the generation interface hold no batch's data between TRL's calls."""
    from trl_scale.rollout.ahead import ReadAheadRollout
    from trl_scale.rollout.generation import ServerRolloutGeneration

    for cls in (ReadAheadRollout, ServerRolloutGeneration):
        for name in ("serving", "served", "streamed_rewards", "serves_now", "records"):
            assert not hasattr(cls, name), (cls.__name__, name)
    assert set(StepState.__slots__) == FIELDS
