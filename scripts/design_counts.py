"""The redesign's counts, read from the source (and, with --step, from one traced training step).

    python scripts/design_counts.py [--step]

- probes: `getattr(X, ...)` / `hasattr(X, ...)` whose object is rooted at `trainer` or `self`, or at a name bound to
  one of them in the same function (`view = trainer`: an alias), a setting or a collaborator asked for by duck typing;
- config reads with a default: `getattr(ARGS, "field", default)` where ARGS is a training config by type: `args`,
  `self.args`, `trainer.args`, or a name the function binds to one (`config = arguments.get("args")`, a parameter
  annotated with a trainer config, `config` beside an `arguments` parameter), never a model's or PEFT's config;
- `last_*` reads: loads of a `.last_<name>` attribute that a hook left for another (`last_hidden_state`, a model
  output, is not one);
- trainer attributes assigned outside the constructor: `trainer.X = ...` and `setattr(trainer, ...)`;
- trainer uses outside the holders: `trainer.X` in `trl_scale/trainers` outside the TRL facade, the adapter and the
  trainer classes (features are handed the run, and read TRL through `run.trl`);
- facade reads and writes: the TRL attributes the facade declares (`Read`), and its declared writes
  (`@interception`); a facade read with a default where a family lacks the attribute (`absent=`) is a probe too;
- files the step visits (--step): the `trl_scale` files whose code runs during one GRPO training step of the demo's
  configuration, traced with `sys.setprofile`.
The last line printed is one JSON object.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_scale"
TRAINER_NAMES = {"trainer", "self", "run", "trl"}  # the trainer, and the handles features get for it
NOT_A_MAILBOX = {"last_hidden_state"}
CONFIG_TYPES = ("Config", "TrainingArguments", "Arguments")  # annotations naming a trainer's config
COUNTS = (
    "probes",
    "config_reads_with_default",
    "last_reads",
    "trainer_attributes_assigned",
    "trainer_uses_outside_holders",
    "facade_reads",
    "facade_writes",
)
# the modules of `trl_scale/trainers` that may hold the trainer itself (tests/test_trl_facade.py checks it)
HOLDERS = {
    "construction.py",
    "trl_facade.py",
    "adapter.py",
    "online.py",
    "grpo_trainer.py",
    "rloo_trainer.py",
    "dpo_trainer.py",
    "ppo_trainer.py",
}


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_args_value(node: ast.AST) -> bool:
    """`X.args`, `arguments["args"]`, `arguments.get("args")`: a trainer's config."""
    if isinstance(node, ast.Attribute):
        return node.attr == "args"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "args"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        return isinstance(node.args[0], ast.Constant) and node.args[0].value == "args"
    return False


def _scope_names(function: ast.AST) -> tuple[set[str], set[str]]:
    """The names a function binds to a trainer config, and to the trainer (aliases), from its parameters and plain
    assignments."""
    configs, trainers = {"args"}, set(TRAINER_NAMES)
    if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        parameters = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
        names = {a.arg for a in parameters}
        for parameter in parameters:
            annotation = ast.unparse(parameter.annotation).strip("'\"") if parameter.annotation is not None else ""
            if annotation.endswith(CONFIG_TYPES) and "Model" not in annotation and "Peft" not in annotation:
                configs.add(parameter.arg)
        if "config" in names and "arguments" in names:  # the plan's and the table's (config, arguments)
            configs.add("config")
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            if _is_args_value(value):
                configs.add(name)
            elif (
                isinstance(value, ast.Name)
                and value.id in TRAINER_NAMES
                or (isinstance(value, ast.Attribute) and value.attr in ("trainer", "_trainer"))
            ):
                trainers.add(name)
    return configs, trainers


def _is_args(node: ast.AST, configs: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in configs
    return isinstance(node, ast.Attribute) and node.attr == "args" and _root(node) in TRAINER_NAMES


def _count_scope(scope: ast.AST, counts: dict[str, int], where: list[int] | None = None) -> None:
    """The counts of `scope`'s own statements (a nested function is a scope of its own); `where` collects the
    lines of its config reads with a default."""
    configs, trainers = _scope_names(scope)
    for node in _own_nodes(scope):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Read":
            counts["facade_reads"] += 1
            counts["probes"] += any(keyword.arg == "absent" for keyword in node.keywords)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "interception":
            counts["facade_writes"] += 1
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            name, first = node.func.id, node.args[0]
            if name == "getattr" and len(node.args) == 3 and _is_args(first, configs):
                counts["config_reads_with_default"] += 1
                if where is not None:
                    where.append(node.lineno)
            elif name in ("getattr", "hasattr") and _root(first) in trainers:
                counts["probes"] += 1
            if name == "setattr" and _root(first) == "trainer":
                counts["trainer_attributes_assigned"] += 1
            field = node.args[1] if len(node.args) > 1 else None
            if name == "getattr" and isinstance(field, ast.Constant) and str(field.value).startswith("last_"):
                counts["last_reads"] += 1  # read by name: getattr(generation, "last_version_spans", None)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("last_") and node.attr not in NOT_A_MAILBOX:
            if isinstance(node.ctx, ast.Load):
                counts["last_reads"] += 1
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id == "trainer":
                        counts["trainer_attributes_assigned"] += 1


def _own_nodes(scope: ast.AST):
    """`scope`'s nodes, not descending into nested functions or classes (their own scopes)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def count_source(source: str, where: list[int] | None = None) -> dict[str, int]:
    """The counts of one module's source (`where`: see `_count_scope`)."""
    counts = dict.fromkeys(COUNTS, 0)
    tree = ast.parse(source)
    for scope in [
        tree,
        *(
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
        ),
    ]:
        _count_scope(scope, counts, where)
    return counts


def config_reads_with_default() -> list[str]:
    """Where a training config is read with a default (`path:line`): a family lacking the field, resolved once by
    the run plan (`trainers/plan.py`) and nowhere else."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines: list[int] = []
        count_source(path.read_text(), lines)
        found += [f"{path.relative_to(ROOT)}:{line}" for line in sorted(lines)]
    return found


def trainer_uses(source: str) -> int:
    """`trainer.X` attribute uses in one module's source."""
    return sum(
        isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trainer"
        for node in ast.walk(ast.parse(source))
    )


def static_counts() -> dict[str, int]:
    counts = dict.fromkeys(COUNTS, 0)
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        for name, value in count_source(source).items():
            counts[name] += value
        if path.parent == PACKAGE / "trainers" and path.name not in HOLDERS:
            counts["trainer_uses_outside_holders"] += trainer_uses(source)
    return counts


def step_files() -> list[str]:
    """The trl_scale files whose code runs in one training step (the second: the first also sets things up) of the
    demo's GRPO configuration, on a tiny model."""
    import tempfile

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer, TrainerCallback

    from trl_scale import GRPOConfig, GRPOTrainer
    from trl_scale.toy import build_tiny_model, counting_prompts, counting_reward
    from trl_scale.toy.demo import demo_config

    seen: set[str] = set()
    package = str(PACKAGE)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            seen.add(frame.f_code.co_filename)

    class Trace(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                sys.setprofile(profile)

        def on_step_end(self, args, state, control, **kwargs):
            sys.setprofile(None)

    with tempfile.TemporaryDirectory() as out:
        model = build_tiny_model(f"{out}/model", family="llama")
        config = GRPOConfig(**demo_config(out, max_steps=2, batch_size=8, num_generations=4), disable_tqdm=True)
        trainer = GRPOTrainer(
            model,
            counting_reward,
            config,
            counting_prompts(64, seed=0),
            processing_class=AutoTokenizer.from_pretrained(model),
        )
        trainer.add_callback(Trace())
        trainer.train()
    return sorted(str(Path(path).relative_to(ROOT)) for path in seen)


def main() -> None:
    counts = static_counts()
    if "--step" in sys.argv:
        files = step_files()
        print("\n".join(files))
        counts["files_the_step_visits"] = len(files)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
