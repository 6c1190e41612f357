"""The house rules, checked: no file in `trl_scale/` over 500 lines, and imports point down the layers (lazy imports
inside functions included). The layers, lowest first, as the README's "Architecture" draws them."""

import ast

from .helpers import ROOT

PACKAGE = ROOT / "trl_scale"
# module (or package) -> layer; a module's layer is that of its longest listed prefix.
LAYERS = {
    "trl_scale.model_paths": 0,
    "trl_scale.checkpoint_names": 0,
    "trl_scale.logs": 0,
    "trl_scale.numbers": 0,
    "trl_scale.net": 0,
    "trl_scale.routing": 0,
    "trl_scale.ranks": 0,
    "trl_scale.errors": 0,
    "trl_scale.seams": 0,
    "trl_scale.ppo_core": 0,
    "trl_scale.scoring": 0,
    "trl_scale.generation": 0,
    "trl_scale.sharding": 0,
    "trl_scale.evaluation": 0,
    "trl_scale.timeline": 0,
    "trl_scale.mismatch": 0,
    "trl_scale.handoff": 0,
    "trl_scale.critic": 2,
    "trl_scale.rollout": 2,
    "trl_scale.distributed": 2,
    "trl_scale.fleet": 2,
    "trl_scale.serve": 2,
    "trl_scale.rewards": 2,
    "trl_scale.trainers": 3,
    "trl_scale.callbacks": 4,
    "trl_scale.toy": 4,
    "trl_scale.cli": 4,
    "trl_scale": 4,  # __init__: the public names
}
MAX_LINES = 500


def _layer(module: str) -> int:
    best = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return LAYERS[best]


def _module_name(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ours(module: str) -> bool:
    return module == "trl_scale" or module.startswith("trl_scale.")  # not trl_scale_vllm_plugin


def _imports(path, module: str):
    """Every trl_scale module `path` imports, at any depth (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if _ours(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not _ours(target):
                continue
            if node.module is None:  # `from . import ppo_core`: the names are modules
                yield from (f"{target}.{alias.name}" for alias in node.names)
            else:
                yield target


# The three products of rollout, each its own package: the trainer's client, the fleet that runs servers, and
# `trl-scale serve`. None imports another; the trainers wire them together (the fleet's callbacks, the URLs).
INDEPENDENT = ("trl_scale.rollout", "trl_scale.fleet", "trl_scale.serve")


def import_graph() -> dict[str, set[str]]:
    """Every trl_scale module -> the trl_scale modules it imports (lazy imports included), each target resolved to
    the module that defines it (a package's `__init__` when a name comes from the package)."""
    raw = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        raw[module] = set(_imports(path, module))

    def resolve(target: str) -> str:
        while target not in raw and "." in target:
            target = target.rpartition(".")[0]
        return target

    return {module: {resolve(t) for t in targets} - {module} for module, targets in raw.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in graph.items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles (strongly connected groups of more than one module, or a module importing itself)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1 or module in graph.get(module, ()):
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return found


def crossings(graph: dict[str, set[str]], packages=INDEPENDENT) -> list[str]:
    """Imports from one of `packages` into another."""

    def owner(module: str) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    return [
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in sorted(targets)
        if owner(module) and owner(target) and owner(module) != owner(target)
    ]


def _package(module: str) -> str:
    """The package of a module (`trl_scale.critic.ray` -> `trl_scale.critic`); a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def two_way_imports(graph: dict[str, set[str]]) -> list[str]:
    """Pairs of packages each importing the other (by any of their modules, lazily or not): a cycle between
    packages, which the module-level cycle check does not see when the modules involved differ."""
    edges = {(_package(m), _package(t)) for m, targets in graph.items() for t in targets if _package(m) != _package(t)}
    return sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b and a != "trl_scale")


def private_reach_ins(sources: dict[str, str]) -> list[str]:
    """`x._name` where `x` is not `self`, `cls` or `super()`: a reach into another object's private state."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"


MAX_FUNCTION_LINES = 60
MAX_METHODS = 20


def function_lengths(root) -> list[tuple[int, str]]:
    """(lines, "path:name") of every function under `root`, longest first."""
    return _function_lengths({str(path.relative_to(ROOT)): path.read_text() for path in root.rglob("*.py")})


def _function_lengths(sources: dict[str, str]) -> list[tuple[int, str]]:
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return sorted(found, reverse=True)


def class_sizes(sources: dict[str, str]) -> list[tuple[int, str]]:
    """(methods, "path:name") of every class, largest first."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                found.append((methods, f"{name}:{node.name}"))
    return sorted(found, reverse=True)


def _sources() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_no_function_is_over_60_lines_and_no_class_over_20_methods():
    """Small functions and classes: a limit about to be hit is a signal to split, not to squeeze."""
    long = [entry for entry in _function_lengths(_sources()) if entry[0] > MAX_FUNCTION_LINES]
    assert not long, f"split these functions: {long}"
    large = [entry for entry in class_sizes(_sources()) if entry[0] > MAX_METHODS]
    assert not large, f"split these classes by concern: {large}"
    planted = {"big.py": "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES}
    assert _function_lengths(planted)[0][0] > MAX_FUNCTION_LINES
    planted = {"wide.py": "class C:\n" + "".join(f"    def m{i}(self): ...\n" for i in range(MAX_METHODS + 1))}
    assert class_sizes(planted)[0][0] > MAX_METHODS


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


def test_no_two_packages_import_each_other():
    """Packages, like modules, import one way: `critic` may build on `distributed`'s Ray plumbing, not be imported
    back by it. The package `trl_scale` (its `__init__`, the public names) is the top and imports everything."""
    graph = import_graph()
    found = two_way_imports(graph)
    assert not found, found
    planted = {
        **graph,
        "trl_scale.distributed.role_workers": graph["trl_scale.distributed.role_workers"] | {"trl_scale.critic.base"},
    }
    assert two_way_imports(planted) == ["trl_scale.critic <-> trl_scale.distributed"]  # the one this test ended
    size, function = function_lengths(PACKAGE)[0]
    methods, largest = class_sizes(_sources())[0]
    print(f"layers: longest function {function} ({size} lines), largest class {largest} ({methods} methods)")


def test_no_import_cycle_anywhere():
    found = cycles(import_graph())
    assert not found, found


def test_client_fleet_and_serve_import_nothing_of_each_other():
    found = crossings(import_graph())
    assert not found, "\n".join(found)


def test_the_rollout_client_reaches_into_no_object_s_private_state():
    """The weight-sync modes use the router's public API (`each`, `live`, `post`, `record_sync`, ...), not its
    `_pool`, `_lock` or `_post`; the generation interface hands them callables, not itself."""
    found = private_reach_ins({str(p.relative_to(ROOT)): p.read_text() for p in (PACKAGE / "rollout").rglob("*.py")})
    assert not found, "\n".join(found)


# Data objects the generation interface fills in (a preflight report), not collaborators.
DATA_OBJECTS = {"report"}


def collaborator_writes(sources: dict[str, str]) -> list[str]:
    """Attribute assignments on another object (`self.syncer.mode = ...`, `fleet.on_moved = ...`): a collaborator
    wired from outside after its construction, where its constructor or one of its methods should take it."""
    found = []
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                continue
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if not isinstance(element, ast.Attribute):
                        continue
                    owner = element.value
                    if isinstance(owner, ast.Name) and owner.id in ("self", *DATA_OBJECTS):
                        continue
                    found.append(f"{name}:{node.lineno}: {ast.unparse(element)}")
    return found


def test_the_generation_interface_wires_its_collaborators_when_it_builds_them():
    """The rollout's generation interface and its read-ahead set nothing on their collaborators (the syncer, its
    mode, the fleet, the client, the read-ahead): the syncer's mode is chosen by its own method, the fleet's callbacks
    given through `listen`, the sequence-parallel group through the read-ahead's constructor."""
    files = [PACKAGE / "rollout" / "generation.py", PACKAGE / "rollout" / "ahead.py"]
    found = collaborator_writes({str(p.relative_to(ROOT)): p.read_text() for p in files})
    assert not found, "\n".join(found)
    assert collaborator_writes({"planted.py": "def f(self, fleet):\n    fleet.on_moved = self.move\n"})


def test_each_rule_goes_red_on_a_planted_violation():
    """The rules above, on small graphs with one violation planted each: they must see it."""
    assert upward_imports({"trl_scale.scoring.engine": {"trl_scale.trainers.wiring"}})
    assert cycles({"trl_scale.a": {"trl_scale.b"}, "trl_scale.b": {"trl_scale.c"}, "trl_scale.c": {"trl_scale.a"}})
    assert cycles({"trl_scale.a": {"trl_scale.a"}})
    assert crossings({"trl_scale.fleet.supervisor": {"trl_scale.rollout.client"}})
    assert crossings({"trl_scale.serve.app": {"trl_scale.fleet"}})
    assert private_reach_ins({"sync.py": "def sync(client):\n    return client._pool.submit(print)\n"})
    assert not private_reach_ins({"ok.py": "class A(B):\n    def f(self):\n        return self._x, super()._y()\n"})
    clean = {
        "trl_scale.rollout.client": {"trl_scale.errors", "trl_scale.net"},
        "trl_scale.fleet.local": {"trl_scale.net"},
    }
    assert not (upward_imports(clean) or cycles(clean) or crossings(clean))


# ---- the house rules in benchmarks/ ---------------------------------------------------------------------------------

BENCHMARKS = ROOT / "benchmarks"
# Functions over the limit when the rules reached benchmarks/ (issue 60), each to be split when next touched: the list
# may shrink, never grow (a new long function, or one grown, fails).
BENCHMARK_LONG_FUNCTIONS = {
    "benchmarks/agents.py:run": 71,
    "benchmarks/agents.py:main": 74,
    "benchmarks/async.py:main": 70,
    "benchmarks/chaos.py:run_trainer": 83,
    "benchmarks/gpu_train.py:shape_figures": 118,
    "benchmarks/rollout.py:main": 69,
    "benchmarks/streaming.py:run": 84,
}


def benchmark_imports() -> dict[str, set[str]]:
    """Each benchmark script -> the sibling scripts it imports (they run with benchmarks/ on the path), lazily too."""
    siblings = {path.stem for path in BENCHMARKS.glob("*.py")}
    graph = {}
    for path in BENCHMARKS.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module or "")
        graph[path.stem] = {name.removeprefix("benchmarks.") for name in found} & siblings - {path.stem}
    return graph


def test_benchmarks_keep_the_house_rules():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in BENCHMARKS.glob("*.py")}
    long_files = {name: n for name, text in sources.items() if (n := len(text.splitlines())) > MAX_LINES}
    assert not long_files, f"split these by job: {long_files}"
    assert not cycles(benchmark_imports()), f"benchmark scripts import each other: {cycles(benchmark_imports())}"
    over = {name: size for size, name in _function_lengths(sources) if size > MAX_FUNCTION_LINES}
    allowed = BENCHMARK_LONG_FUNCTIONS
    grown = {name: size for name, size in over.items() if size > allowed.get(name, MAX_FUNCTION_LINES)}
    assert not grown, f"split these functions (benchmarks/ keeps the limit of {MAX_FUNCTION_LINES} lines): {grown}"
    large = [entry for entry in class_sizes(sources) if entry[0] > MAX_METHODS]
    assert not large, f"split these classes by concern: {large}"
    into_package = [m for m, targets in import_graph().items() for t in targets if t.startswith("benchmarks")]
    assert not into_package, into_package
    # the check sees a cycle, as the one gpu.py and gpu_train.py had
    assert cycles({"gpu": {"gpu_train"}, "gpu_train": {"gpu"}})
