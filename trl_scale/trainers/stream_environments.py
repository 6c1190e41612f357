"""Environments in the stream (TRL's `environment_factory` with streaming rollout).

TRL resets a batch's environments, runs their methods as tools and reads their rewards inside the training step, one
rollout after another (`_generate_and_score_completions`). Streaming runs each prompt group's episode in the stream's
thread instead, as soon as the group is sent: its environments are taken from a pool (`EnvironmentPool`, one instance
per row, never two live conversations on one instance, more made only while all are in use), reset as TRL resets them
(the row as keyword arguments; what `reset()` returns appended to the last message), the prompts tokenized with each
environment's tools (the rows' images put into them as TRL's step puts them), the group generated (with those
images), TRL's tool loop run on the group's own tool tables (its instances' methods), its rewards computed
(`environments=` its instances, `get_reward` included), and the instances given back. The step trains on finished
conversations and calls no environment: while it runs TRL's method, each row's environment is a stand-in whose
`reset()` does nothing (`finished_environments`).

A method call that outlasts `environment_timeout` is abandoned: as a tool, it fails as TRL reports a failing tool (the
conversation goes on with the error as the tool's answer); as `reset()`, it fails the run naming the environment and
the prompt group. The instance it ran on is discarded (a thread may still be inside it) and closed, as every instance
is at the end of `train()` however it ends (`__exit__`, or `close()`: see `_close`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..rollout.images import multimodal_prompts, row_images

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # TRL's prompt for an environment's row that has none


class EnvironmentFailure(RuntimeError):
    """An environment's `reset()` raised or hung: the run stops naming the environment and the group."""


class EnvironmentPool:
    """Instances of each environment (name -> factory, TRL's `environment_factories`), one conversation at a time.

    `close()` (the end of a run) closes the free instances at once; one still in an episode (abandoned with the run,
    its calls bounded by `environment_timeout`) is closed when that episode gives it back, never under a live call."""

    def __init__(self, factories: dict):
        self.factories = factories
        self._free: dict = {}  # name -> instances not in an episode
        self._run: dict[int, int] = {}  # the run each instance is of
        self._current = 0
        self._in_use: set[int] = set()
        self._lock = threading.Lock()
        self.counts = {"timeouts": 0, "discarded": 0, "seconds": 0.0}

    def acquire(self, name):
        with self._lock:
            free = self._free.setdefault(name, [])
            instance = free.pop() if free else None
            if instance is not None:
                self._in_use.add(id(instance))
                return instance
        instance = self.factories[name]()  # outside the lock: a factory may connect to a server
        with self._lock:
            self._run[id(instance)] = self._current
            self._in_use.add(id(instance))
        return instance

    def release(self, name, instance) -> None:
        with self._lock:
            self._in_use.discard(id(instance))
            if self._run.get(id(instance)) == self._current:
                self._free.setdefault(name, []).append(instance)
                return
            self._run.pop(id(instance), None)
        _close(instance)  # of a run that has ended

    def discard(self, instance) -> None:
        """Out of the pool for good (a call into it was abandoned), and closed."""
        with self._lock:
            self._in_use.discard(id(instance))
            self._run.pop(id(instance), None)
            self.counts["discarded"] += 1
        _close(instance)

    def close(self) -> None:
        """The end of a run: the free instances closed now, those still in an episode when it ends; the next run
        makes new ones."""
        with self._lock:
            free = [instance for instances in self._free.values() for instance in instances]
            self._free = {}
            for instance in free:
                self._run.pop(id(instance), None)
            self._current += 1
        if free:  # at once: closing a remote session may wait for its server's goodbye (seconds, each)
            with ThreadPoolExecutor(max_workers=min(32, len(free)), thread_name_prefix="environment-close") as pool:
                list(pool.map(_close, free))

    def count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self.counts[name] += amount

    def metrics(self) -> dict[str, float]:
        """Instances of this run (free or in an episode) and in an episode now; calls abandoned, instances discarded
        and seconds in reset() and tools (summed over groups) so far."""
        with self._lock:
            return {
                "environments/seconds": self.counts["seconds"],
                "environments/pool_size": float(sum(run == self._current for run in self._run.values())),
                "environments/in_use": float(len(self._in_use)),
                "environments/timeouts": float(self.counts["timeouts"]),
                "environments/discarded": float(self.counts["discarded"]),
            }


def _close(instance) -> None:
    """An instance's clean-up: `__exit__` (TRL offers every public method to the model as a tool, so a context
    manager's exit is where a TRL environment can close its client), else a `close()` method if it has one."""
    exit_ = getattr(type(instance), "__exit__", None)
    close = (lambda: exit_(instance, None, None, None)) if exit_ is not None else getattr(instance, "close", None)
    if callable(close):
        try:
            result = close()
            if inspect.iscoroutine(result):
                asyncio.run(result)
        except Exception:  # closing is best effort: a dead server's client may fail to say goodbye
            pass


@dataclass
class EnvironmentEpisode:
    """One prompt group's episode (see `streaming.Episode`): its rows as trained, their prompt ids, each row's
    environment name and instance; closed once the group is scored."""

    rows: list
    prompt_ids: list[list[int]]
    names: list
    instances: list
    pool: EnvironmentPool
    images: list | None = None  # each row's images as its prompt holds them (TRL's tokenization), or None
    broken: set = field(default_factory=set)  # ids of instances a call was abandoned in
    seconds: float = 0.0  # in reset() and tools

    def close(self) -> None:
        self.pool.count("seconds", self.seconds)
        for name, instance in zip(self.names, self.instances):
            if id(instance) in self.broken:
                self.pool.discard(instance)
            else:
                self.pool.release(name, instance)

    def bounded(self, instance, method, timeout: float):
        """`method` of `instance`, abandoned after `timeout` seconds (a TimeoutError, the instance marked broken)."""
        name = f"{type(instance).__name__}.{method.__name__}"

        def timed_out():
            self.broken.add(id(instance))
            self.pool.count("timeouts")
            return TimeoutError(f"environment method {name} took longer than environment_timeout={timeout:g}s")

        if inspect.iscoroutinefunction(method):

            async def call_async(*args, **kwargs):
                started = time.monotonic()
                try:
                    return await asyncio.wait_for(method(*args, **kwargs), timeout)
                except asyncio.TimeoutError:
                    raise timed_out() from None
                finally:
                    self.seconds += time.monotonic() - started

            return functools.update_wrapper(call_async, method)

        def call(*args, **kwargs):
            started, outcome = time.monotonic(), {}

            def run():
                try:
                    outcome["value"] = method(*args, **kwargs)
                except BaseException as error:
                    outcome["error"] = error

            worker = threading.Thread(target=run, name="environment-call", daemon=True)
            worker.start()
            worker.join(timeout)
            self.seconds += time.monotonic() - started
            if worker.is_alive():
                raise timed_out()
            if "error" in outcome:
                raise outcome["error"]
            return outcome["value"]

        return functools.update_wrapper(call, method)

    def tool_methods(self, row: int, timeout: float) -> list:
        """The row's environment's methods TRL makes tools of (public, not `reset` nor `get_reward`), bounded."""
        instance = self.instances[row]
        return [
            self.bounded(instance, getattr(instance, name), timeout)
            for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")
        ]


def with_observation(prompt: list, observation) -> list:
    """The prompt with what `reset()` returned appended to its last message, as TRL's step does."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


class EpisodeOpener:
    """The stream's `open_episode`: a group's environments taken from the pool and reset, its prompts tokenized."""

    def __init__(
        self,
        factories: dict,
        multi_environment: bool,
        tokenize: Callable,
        timeout: float,
        lock: threading.Lock,
        group_size: int = 1,
    ):
        """`tokenize(names, prompts)`: TRL's prompt rendering, each prompt with its row's environment's tools
        (`names`), as TRL's `_tokenize_prompts` returns it; `of(trl, ...)` makes one from the TRL facade."""
        self.timeout = timeout
        self.lock = lock  # the tokenizer's: shared with the streamed tool loops
        self.group_size = group_size  # completions per prompt: the stream's episodes are whole groups
        self.multi_environment = multi_environment
        # taken now: a streamed batch's step replaces TRL's factories while the stream opens the next episodes
        self.factory_names = list(factories)
        # TRL's probe instances stay TRL's (an evaluation in the step uses them): the stream makes its own
        self.pool = EnvironmentPool(factories)
        self._tokenize = tokenize

    @classmethod
    def of(cls, trl, timeout: float, lock: threading.Lock) -> EpisodeOpener:
        """The opener of a run, from the TRL facade: its factories, and TRL's rendering on a view of the trainer."""
        render = trl.trl_method("_tokenize_prompts")

        def tokenize(names: list, prompts: list):
            return render(trl.view(_batch_environments=names), prompts)

        return cls(trl.environment_factories, trl.multi_environment, tokenize, timeout, lock, trl.num_generations)

    def __call__(self, rows: list) -> EnvironmentEpisode:
        names = [row.get("environment") if self.multi_environment else None for row in rows]
        unknown = {name for name in names if name not in self.factory_names}
        if unknown:  # TRL's check, on the group
            raise ValueError(
                f"Example has `environment={sorted(unknown, key=str)[0]!r}`, which is not among the environments "
                f"passed to `environment_factory`. Expected one of: {self.factory_names}."
            )
        episode = EnvironmentEpisode([], [], names, [], self.pool)
        prompts = [row.get("prompt", EMPTY_PROMPT) for row in rows]
        try:
            for name in names:
                with _named(name, None, "its factory", prompts[0]):
                    episode.instances.append(self.pool.acquire(name))
            for i, (row, instance) in enumerate(zip(rows, episode.instances)):
                kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row
                with _named(names[i], instance, "reset()", prompts[i]):
                    observation = episode.bounded(instance, instance.reset, self.timeout)(**kwargs)
                prompts[i] = with_observation(prompts[i], observation)
            reset_rows = [{**row, "prompt": prompt} for row, prompt in zip(rows, prompts)]
            # the image columns' images put into the prompts as TRL's step puts them (after the reset)
            multimodal = multimodal_prompts(reset_rows, row_images(rows))
            with self.lock:
                prompt_ids, images, _ = self._tokenize(names, multimodal)  # each prompt rendered with its tools
            episode.prompt_ids, episode.images = [list(ids) for ids in prompt_ids], images
        except BaseException:
            episode.close()
            raise
        episode.rows = reset_rows  # the step makes them multimodal again, as it does every batch's
        return episode

    def close(self) -> None:
        self.pool.close()

    def metrics(self) -> dict[str, float]:
        return self.pool.metrics()


@contextmanager
def _named(name, instance, what: str, prompt):
    """An error from an environment's factory or reset(), re-raised naming the environment and the group."""
    try:
        yield
    except Exception as error:
        kind = "" if instance is None else type(instance).__name__
        label = kind if name is None else f"{name!r}" + (f" ({kind})" if kind else "")
        raise EnvironmentFailure(
            f"environment {label or 'factory'}: {what} failed for the prompt group of {str(prompt)[:80]!r}: "
            f"{type(error).__name__}: {error}"
        ) from error


class _Finished:
    """A streamed row's environment as TRL's step sees it: its episode ran in the stream, so nothing is reset."""

    def reset(self, **kwargs) -> None:
        return None


@contextmanager
def finished_environments(trl):
    """Within the block (a streamed batch's step), TRL draws stand-ins for the rows' environments, not instances."""
    factories = trl.environment_factories
    if factories is None:
        yield
        return
    with trl.environments_replaced({name: _Finished for name in factories}, {name: [] for name in factories}):
        yield
