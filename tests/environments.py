"""Environments as users install them, made in seconds from the test environment's own packages.

`bash scripts/setup.sh demo` gives a user the core dependencies and the `demo` extra; `pip install
'trl-scale[serve]'` the core and `serve`. CI's environment has every extra, so a module that imports a package only
an extra declares passes there and fails for those users (as `requests` did). An environment here is a fresh
virtual environment (no pip, no packages) whose site-packages holds links to the files of exactly the distributions
a set of requirements reaches (`closure`: trl-scale's core requirements, an extra's, and theirs, resolved against
what this environment has installed, markers evaluated), metadata included: what a fresh install of the same
versions would hold, without the install.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "trl-scale"
ROOT = Path(__file__).resolve().parents[1]


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _applies(requirement: Requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**default_environment(), "extra": e}) for e in extras | {""})


def declared(extras: set[str] = frozenset()) -> list[Requirement]:
    """trl-scale's requirements as pyproject.toml declares them (the checkout's, not an older install's metadata):
    the core's, and each of `extras`'."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def closure(extras: set[str] = frozenset()) -> dict[str, metadata.Distribution]:
    """Every installed distribution trl-scale's core requirements (and `extras`') reach, by canonical name. A
    requirement not installed here is left out (the caller checks what it needs is there)."""
    found: dict[str, metadata.Distribution] = {}
    queue = [(r.name, set(r.extras)) for r in declared(extras) if _applies(r, set())]
    while queue:
        name, wanted = queue.pop()
        distribution = _installed(name)
        key = canonicalize_name(name)
        if distribution is None or (key in found and not wanted):
            continue
        found[key] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            if _applies(requirement, wanted):
                queue.append((requirement.name, set(requirement.extras)))
    return found


def _top_level_entries(distribution: metadata.Distribution) -> set[str]:
    """The names a distribution puts directly in site-packages (packages, modules, its .dist-info, .pth files)."""
    entries = set()
    for file in distribution.files or []:
        parts = Path(file).parts
        if parts and parts[0] != "..":  # scripts in bin/ are outside site-packages
            entries.add(parts[0])
    return entries


def make_environment(directory: Path, extras: set[str] = frozenset()) -> Path:
    """A virtual environment at `directory` holding exactly `closure(extras)` and this checkout's trl-scale (as an
    editable install has it: a .pth naming its two package roots); returns its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    here = Path(sysconfig.get_paths()["purelib"])
    (site / "trl_scale_checkout.pth").write_text(f"{ROOT}\n{ROOT / 'vllm_plugin'}\n")
    allowed = closure(extras)
    owners: dict[str, set[str]] = {}  # top-level entry -> the distributions (of all installed) that put files in it
    for distribution in metadata.distributions():
        for entry in _top_level_entries(distribution):
            owners.setdefault(entry, set()).add(canonicalize_name(distribution.metadata["Name"]))
    for key, distribution in allowed.items():
        for entry in _top_level_entries(distribution):
            source = here / entry
            if not source.exists():
                continue
            if owners.get(entry, {key}) <= set(allowed):
                _link(source, site / entry)
            else:  # a namespace shared with a distribution left out: only this one's files, one level down
                (site / entry).mkdir(exist_ok=True)
                for file in distribution.files or []:
                    parts = Path(file).parts
                    if len(parts) > 1 and parts[0] == entry:
                        _link(here / entry / parts[1], site / entry / parts[1])
    return python


def _link(source: Path, target: Path) -> None:
    if not target.exists() and not target.is_symlink():
        os.symlink(source, target)


def run_in(python: Path, code: str, *args: str, timeout: float = 300, cwd: Path | None = None):
    """`code` run by `python` (offline, one thread) in `cwd` (its environment's directory by default: not the
    checkout, whose folders would shadow what is installed); the completed process."""
    environment = {
        key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    environment.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [str(python), "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd or python.parent.parent,
    )
