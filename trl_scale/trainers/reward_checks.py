"""Reward functions checked where they are called: a function that raises, returns the wrong number of rewards, or
returns something that is not a finite number stops the step with an error that names it, instead of a shape error
deep in TRL or NaN advantages many steps later. `None` (and NaN, which TRL reads the same way) keeps TRL's meaning:
"this function does not apply to this completion"."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable
from contextlib import contextmanager


class RewardFunctionError(RuntimeError):
    """A reward function raised; the original exception is its ``__cause__``."""


def _check(name: str, rewards, num_completions: int | None) -> None:
    if isinstance(rewards, (str, bytes)) or not hasattr(rewards, "__len__"):
        raise ValueError(
            f"reward function {name!r} returned {type(rewards).__name__}; return a list with one float (or None) "
            f"per completion ({num_completions} here)"
        )
    if num_completions is not None and len(rewards) != num_completions:
        raise ValueError(
            f"reward function {name!r} returned {len(rewards)} rewards for {num_completions} completions; return "
            "one float (or None) per completion, in the order of `completions`"
        )
    for index, reward in enumerate(rewards):
        if reward is None:
            continue
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise ValueError(
                f"reward function {name!r} returned {reward!r} ({type(reward).__name__}) for completion {index}; "
                "rewards are floats, or None where the function does not apply"
            )
        if math.isinf(reward):
            raise ValueError(
                f"reward function {name!r} returned {reward} for completion {index}: an infinite reward makes every "
                "advantage of its group NaN. Return a finite float (clip it), or None where the function does not "
                "apply"
            )


@contextmanager
def _reported(name: str):
    """An exception from a reward function, re-raised as a `RewardFunctionError` that names it."""
    try:
        yield
    except Exception as error:
        raise RewardFunctionError(f"reward function {name!r} raised {type(error).__name__}: {error}") from error


def checked_reward_func(func: Callable, name: str) -> Callable:
    """``func`` with its outputs checked; same name (TRL logs rewards under it) and the same sync/async kind."""

    def count(args, kwargs) -> int | None:
        # TRL passes keywords; a direct call may pass (prompts, completions) positionally, as TRL's signature reads.
        completions = kwargs.get("completions", args[1] if len(args) > 1 else None)
        prompts = kwargs.get("prompts", args[0] if args else None)
        batch = completions if completions is not None else prompts
        return len(batch) if hasattr(batch, "__len__") else None

    call = type(func).__call__ if not inspect.isroutine(func) else func  # a callable instance's __call__
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call):

        async def checked(*args, **kwargs):
            with _reported(name):
                rewards = await func(*args, **kwargs)
            _check(name, rewards, count(args, kwargs))
            return rewards

    else:

        def checked(*args, **kwargs):
            with _reported(name):
                rewards = func(*args, **kwargs)
            _check(name, rewards, count(args, kwargs))
            return rewards

    if inspect.isfunction(func) or inspect.ismethod(func):
        functools.update_wrapper(checked, func)
    checked.__name__ = checked.__qualname__ = name
    checked.__trl_scale_checked__ = func
    return checked


def _checked_here(func) -> bool:
    """Whether trl-scale wraps `func` with its checks: a callable not yet checked (models and model paths TRL scores
    itself)."""
    from torch import nn

    return not isinstance(func, (str, nn.Module)) and callable(func) and not hasattr(func, "__trl_scale_checked__")


def checked_reward_funcs(reward_funcs):
    """Each callable in ``reward_funcs`` (one or a list) checked; models and model paths stay as they are (TRL
    scores them itself)."""
    if reward_funcs is None:
        return None
    from trl.trainer.utils import get_callable_name

    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return [checked_reward_func(f, get_callable_name(f)) if _checked_here(f) else f for f in funcs]


def check_added_reward_funcs(trl) -> None:
    """The reward functions TRL adds inside its constructor (an environment's `get_reward`, one per class), checked
    as the user's are: an environment returning `inf` or `"1.0"` stops the step naming it, instead of training on
    zeroed advantages or failing deep in TRL."""
    trl.set_reward_funcs(
        [
            checked_reward_func(f, f"{name}.get_reward" if getattr(f, "__name__", "") == "get_reward" else name)
            if _checked_here(f)
            else f
            for f, name in zip(trl.reward_funcs, trl.reward_func_names)
        ]
    )


def _checked_reset(instance) -> None:
    """`instance.reset` replaced, on the instance, by one that checks what it returns: None, text, or a list of
    content blocks (TRL appends it to the last message). TRL lists an environment's tools from its class, so the
    tools are unchanged."""
    reset = instance.reset
    if getattr(reset, "__trl_scale_checked__", False):
        return

    def checked(*args, **kwargs):
        observation = reset(*args, **kwargs)
        if observation is not None and not isinstance(observation, (str, list)):
            raise TypeError(
                f"{type(instance).__name__}.reset() returned {type(observation).__name__} {str(observation)[:80]!r}: "
                "TRL appends what reset() returns to the prompt's last message, so it must be None, a string, or a "
                "list of content blocks. Fix: return the observation's text (e.g. its 'prompt' field)"
            )
        return observation

    checked.__trl_scale_checked__ = True
    instance.reset = checked


def check_environment_resets(trl) -> None:
    """Every environment TRL makes (its probes, already pooled, and each made later) with `reset` checked."""
    factories = trl.environment_factories
    if not factories:
        return
    for pool in trl.environment_pool.values():
        for instance in pool:
            _checked_reset(instance)

    def checked_factory(factory):
        def make():
            instance = factory()
            _checked_reset(instance)
            return instance

        return make

    trl.set_environment_factories({name: checked_factory(f) for name, f in factories.items()})
