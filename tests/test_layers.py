"""The house rules, checked: no file in `trl_scale/` over 500 lines, and imports point down the layers (lazy imports
inside functions included). The layers, lowest first, as the README's "Architecture" draws them."""

import ast

from .helpers import ROOT

PACKAGE = ROOT / "trl_scale"
# module (or package) -> layer; a module's layer is that of its longest listed prefix.
LAYERS = {
    "trl_scale.model_paths": 0,
    "trl_scale.logs": 0,
    "trl_scale.numbers": 0,
    "trl_scale.net": 0,
    "trl_scale.errors": 0,
    "trl_scale.seams": 0,
    "trl_scale.ppo_core": 0,
    "trl_scale.scoring": 0,
    "trl_scale.sharding": 0,
    "trl_scale.critic": 1,
    "trl_scale.rollout": 2,
    "trl_scale.distributed": 2,
    "trl_scale.fleet": 2,
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


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"


def test_imports_point_down_the_layers():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for target in _imports(path, module):
            if _layer(target) > _layer(module):
                upward.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    assert not upward, "\n".join(upward)
