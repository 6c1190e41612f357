"""One check for the numbers of trl-scale's config fields, so the Python API refuses what the command line refuses
(argparse rejects `--async_rollout_staleness 1.5`; a config built in Python got it through), each error naming the
field and what to use. `True` is not a number here, though Python lets it pass for 1."""

from __future__ import annotations

import math
import types
import typing


def _is_whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_whole(name: str, value, minimum: int = 0, optional: bool = False, fix: str = "") -> None:
    """`value` must be an int >= `minimum` (or None when `optional`); else a ValueError naming `name`."""
    if (value is None and optional) or (_is_whole(value) and value >= minimum):
        return
    allowed = f"use a whole number >= {minimum}" + (" or None" if optional else "")
    raise ValueError(f"{name}={value!r}: {fix or allowed}")


def check_positive(name: str, value, optional: bool = False, fix: str = "use a positive number of seconds") -> None:
    """`value` must be an int or float > 0 (or None when `optional`); else a ValueError naming `name`."""
    if (value is None and optional) or (_is_real(value) and value > 0):
        return
    raise ValueError(f"{name}={value!r}: {fix}")


def check_training_arguments(config) -> None:
    """Fields of transformers' `TrainingArguments` it takes without a word and fails on (or replaces) later, checked
    as given (before its `__post_init__`): `seed` (a str reached `set_seed` deep in the run), `eval_steps=0`
    (replaced by `logging_steps`: evaluation every logged step, silently)."""
    if not _is_whole(config.seed):
        raise ValueError(f"seed={config.seed!r}: use a whole number (it seeds the data order and the initialisation)")
    if _is_real(config.eval_steps) and config.eval_steps <= 0:
        raise ValueError(
            f"eval_steps={config.eval_steps!r}: transformers replaces it with logging_steps, so evaluation would run "
            "every logged step. Fix: eval_steps >= 1 (or a fraction of the run in (0, 1)), or leave it unset to "
            "follow logging_steps"
        )


def check_non_negative(name: str, value, fix: str = "use a number >= 0") -> None:
    if _is_real(value) and value >= 0:
        return
    raise ValueError(f"{name}={value!r}: {fix}")


def check_bool(name: str, value, optional: bool = False) -> None:
    """`value` must be True or False (or None when `optional`): a string such as "false" is truthy in Python and
    would switch a feature on."""
    if isinstance(value, bool) or (value is None and optional):
        return
    allowed = "True or False" + (" (or None)" if optional else "")
    raise ValueError(f"{name}={value!r}: use {allowed}, not {_what(value)}")


def check_field_types(config, cls: type) -> None:
    """Every field `cls` itself declares holds a value of its declared kind, checked at construction: a bool is
    True or False (a string "false" would be truthy), a whole number is an int, a float is a finite number (an
    int is fine; NaN and infinities are not); `| None` allows None. Choices (`Literal`), strings, dicts and lists
    are left to each field's own check, and so are ranges, and `True` or `1.5` for a whole number (the field's own
    check names its fix)."""
    hints = typing.get_type_hints(cls)
    for name in cls.__dict__.get("__annotations__", {}):
        if name not in hints or not hasattr(config, name):
            continue
        kind, value = hints[name], getattr(config, name)
        arguments = typing.get_args(kind)
        optional = typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in arguments
        if optional:
            rest = [a for a in arguments if a is not type(None)]
            if value is None or len(rest) != 1:
                continue
            kind = rest[0]
        if kind is bool:
            check_bool(name, value)
        elif kind is int:
            if not _is_real(value) and not isinstance(value, bool):  # True and 1.5: the field's own check, its fix
                raise ValueError(f"{name}={value!r}: use a whole number, not {_what(value)}")
        elif kind is float:
            if not _is_real(value) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r}: use a finite number, not {_what(value)}")


def _what(value) -> str:
    if _is_real(value):
        return repr(value)
    kind = type(value).__name__
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def check_number(name: str, value, minimum: float | None = None, fix: str = "") -> None:
    """`value` must be a finite int or float (not a bool), at least `minimum` when given; else a ValueError naming
    `name` and `fix`."""
    if _is_real(value) and math.isfinite(value) and (minimum is None or value >= minimum):
        return
    allowed = "use a finite number" + (f" >= {minimum}" if minimum is not None else "")
    raise ValueError(f"{name}={value!r}: {fix or allowed}")


def dict_field(value, name: str) -> dict | None:
    """A dict config field: a dict, or a JSON object as text (the command line gives text, as transformers reads its
    own dict fields); anything else is a ValueError naming the field."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        import json

        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(
        f"{name}={value!r}: use a dict (in YAML, a mapping; on the command line, a JSON object such as "
        '\'{"KEY": "value"}\')'
    )
