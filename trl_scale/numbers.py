"""One check for the numbers of trl-scale's config fields, so the Python API refuses what the command line refuses
(argparse rejects `--async_rollout_staleness 1.5`; a config built in Python got it through), each error naming the
field and what to use. `True` is not a number here, though Python lets it pass for 1."""

from __future__ import annotations


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
    raise ValueError(f"{name}={value!r}: use {allowed}, not a {type(value).__name__}")
