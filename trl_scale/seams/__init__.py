"""Every TRL and transformers internal trl-scale relies on, and what it assumes of each: the list to re-check when TRL
moves. trl-scale subclasses TRL's trainers, so a TRL release can change a private method, attribute or rule under it
without any error; this registry makes such a change fail one test (`tests/test_seams.py`) that names the seams to
re-read, instead of a wrong number months later.

Each :class:`Seam` names a target (``module:qualname``), how trl-scale uses it, what it assumes, and a fingerprint of
the installed TRL: the signature for what is called or overridden, a hash of the source for logic trl-scale copies or
wraps. ``python -m trl_scale.seams`` checks them all against the installed packages and prints what moved;
``--update`` prints fresh fingerprints to paste here once the seams it names were re-read. The test also checks that
trl-scale uses no private TRL name missing from this list, and that PPO classifies every GRPO config field.

Upgrading TRL: the procedure is in the README ("The seam registry"): bump the pin, run this check, re-read each seam
it names against its ``assumes``, adapt, refresh the fingerprints, run the whole suite.

The registry: `registry.py` (TRL's trainers and generation, transformers' Trainer, accelerate) and `models.py`
(transformers' models, configs and DeepSpeed integration), each a tuple of `Seam` (`seam.py`).
This package imports nothing from trl-scale and TRL only when checking, so any layer may read it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys

from .models import MODEL_SEAMS
from .registry import TRAINER_SEAMS
from .seam import ATTRIBUTE, CALL, CONFIG, CONSTANT, COPY, OVERRIDE, Seam

SEAMS: tuple[Seam, ...] = TRAINER_SEAMS + MODEL_SEAMS

__all__ = ["ATTRIBUTE", "CALL", "CONFIG", "CONSTANT", "COPY", "OVERRIDE", "SEAMS", "Seam", "check", "main", "resolve"]


def resolve(target: str):
    """The object a ``module:qualname`` target names (ImportError / AttributeError when it is gone)."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else []:
        if isinstance(obj, type) and part in getattr(obj, "__dataclass_fields__", {}):
            return obj.__dataclass_fields__[part]
        obj = getattr(obj, part)
    return obj


def fingerprint_of(seam: Seam, obj) -> str:
    """The installed package's fingerprint for ``seam`` (the form its ``fingerprint`` records)."""
    if seam.kind in (OVERRIDE, CALL) and not seam.fingerprint.startswith("sha:"):
        return str(inspect.signature(obj))
    if seam.kind in (COPY, CALL):
        return "sha:" + hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:12]
    return ""


def _class_sets(cls: type, attribute: str) -> bool:
    pattern = re.compile(r"self\." + re.escape(attribute) + r"\b")
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in ("trl", "transformers"):
            continue
        try:
            if pattern.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):
            continue
    return False


def check(seams: tuple[Seam, ...] = SEAMS) -> list[str]:
    """One line per seam that moved in the installed packages: gone, another signature, changed source."""
    problems = []
    for seam in seams:
        label = seam.target + (f".{seam.attribute}" if seam.attribute else "")
        try:
            obj = resolve(seam.target)
        except (ImportError, AttributeError) as error:
            problems.append(f"{label} ({seam.kind}, {seam.used_in}): gone ({type(error).__name__}: {error})")
            continue
        if seam.kind == ATTRIBUTE and not _class_sets(obj, seam.attribute):
            problems.append(f"{label} ({seam.kind}, {seam.used_in}): no longer set by {seam.target}")
        elif seam.fingerprint:
            found = fingerprint_of(seam, obj)
            if found != seam.fingerprint:
                problems.append(
                    f"{label} ({seam.kind}, {seam.used_in}): was {seam.fingerprint}, now {found}. Assumes: "
                    f"{seam.assumes}"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--update" in argv:
        for seam in SEAMS:
            if seam.fingerprint:
                print(f"{seam.target}: {fingerprint_of(seam, resolve(seam.target))}")
        return 0
    problems = check()
    for line in problems:
        print(line)
    print(f"{len(SEAMS)} seams checked, {len(problems)} moved")
    return 1 if problems else 0
