"""The reward functions of a command-line run (`reward_funcs` in the trainer YAML or on the command line): toy names,
import paths (a module in the current directory found, as TRL's scripts find it), and reward classes, made with
their settings from `reward_funcs_kwargs` (CodeExecutionReward, RemoteReward, or a user's)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from .numbers import dict_field


def _imported(name: str):
    from .toy import counting_reward

    registry = {"counting_reward": counting_reward}
    if name in registry:
        return registry[name]
    if "/" in name or os.path.isdir(name):  # a path or a Hub id: a model, which TRL's scripts take elsewhere
        raise ValueError(
            f"reward_funcs entry {name!r} looks like a reward model (a path or a Hub id): reward_funcs takes "
            f"functions ({sorted(registry)} or a dotted import path). Fix: reward_model_name_or_path: {name}"
        )
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise ValueError(f"reward_funcs entry {name!r}: use one of {sorted(registry)} or a dotted import path")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `mymod.fn` beside the YAML the user runs from
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward_funcs entry {name!r} could not be imported: {error}") from error


def resolve_reward_funcs(names: list[str], kwargs_by_name, model_path: str | None = None) -> list:
    """Each entry of `reward_funcs`, resolved; a class is made with `reward_funcs_kwargs[entry]` (and, where its
    constructor takes a `tokenizer` it was not given, the model's), a function is used as it is. Settings for an entry
    that is not listed, or that is a function, are refused: nothing would read them."""
    kwargs_by_name = dict_field(kwargs_by_name, "reward_funcs_kwargs") or {}
    unlisted = sorted(set(kwargs_by_name) - set(names))
    if unlisted:
        raise ValueError(
            f"reward_funcs_kwargs names {unlisted}, which reward_funcs does not list ({names}): nothing would read "
            "them. Fix: key each entry's settings by its name as reward_funcs lists it"
        )
    resolved = []
    for name in names:
        found = _imported(name)
        settings = kwargs_by_name.get(name)
        if inspect.isclass(found):
            resolved.append(
                _made(name, found, dict_field(settings, f"reward_funcs_kwargs[{name!r}]") or {}, model_path)
            )
        elif settings is not None:
            raise ValueError(
                f"reward_funcs_kwargs[{name!r}] sets {sorted(settings)}, but {name} is a function, called as it is. "
                "Fix: drop its settings (they are for reward classes, such as trl_scale.CodeExecutionReward)"
            )
        else:
            resolved.append(found)
    return resolved


def _made(name: str, cls: type, settings: dict, model_path: str | None):
    parameters = inspect.signature(cls).parameters
    if "tokenizer" in parameters and "tokenizer" not in settings and model_path is not None:
        from transformers import AutoTokenizer

        settings = {**settings, "tokenizer": AutoTokenizer.from_pretrained(model_path)}
    try:
        made = cls(**settings)
    except TypeError as error:
        raise ValueError(
            f"reward_funcs entry {name!r} is a class, made with reward_funcs_kwargs[{name!r}]={settings!r}: "
            f"{error}. Fix: give its constructor's arguments there, e.g. {{'urls': [...]}} for RemoteReward"
        ) from None
    if not callable(made):
        raise ValueError(f"reward_funcs entry {name!r}: {cls.__name__}(...) is not callable, so not a reward function")
    return made
