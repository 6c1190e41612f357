"""Rewards in the stream (`stream_rewards=True`): a prompt group's rewards are computed as soon as it finishes, in the
stream's thread, while the servers generate on and the trainer trains; the step then reads them.

TRL computes every reward function inside the training step, after the batch is generated (`_calculate_rewards`), so a
verifier that takes as long as generation doubles the step while streaming servers wait. Here `StreamRewarder` is the
stream's `score`: for one finished group it builds the reward functions' arguments as TRL's `_calculate_rewards` does
(the rows' columns, `prompts`, the completions TRL's `_generate` would decode, `completion_ids`, `trainer_state`,
`log_extra`, `log_metric`) and calls each function on them: synchronous ones (and reward models served by Ray groups)
on a bounded pool of threads, async ones on TRL's event loop. A reward model in the trainer (an `nn.Module`) is left
to the step: it would race the trainer for its device.

In the step, `StreamRewards` answers TRL's `_calculate_rewards` call for a streamed batch by running TRL's own method
with each function scored in the stream replaced by its computed values (checked to belong to the very rows and
completions asked about), so the weights, NaN rules, per-function logs, warnings and gathers are TRL's. The values
calls to `log_extra` and `log_metric` made in the stream are replayed there, in the batch's order.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..rollout.ahead import CONVERSATION_KEY
from .feature import Feature
from .reward_checks import RewardFunctionError
from .streamed_tools import decoded_completions, first_turn_messages


@dataclass
class GroupRewards:
    """One prompt group's rewards, computed in the stream: `values[row][k]` is the reward of function
    `columns[k]` (its index in the trainer's `reward_funcs`) for that row, None where it returned None. Kept with
    what was scored, so the step can check it reads the rewards of its own rows."""

    rows: list
    completion_ids: list[list[int]]
    completions: list
    columns: tuple[int, ...]
    values: list[list]
    extra_logs: list[tuple[str, list]] = field(default_factory=list)
    metrics: list[tuple[str, float]] = field(default_factory=list)


class _Calls:
    """`log_extra` / `log_metric` as a reward function gets them in the stream: recorded, replayed in the step."""

    def __init__(self):
        self.extra_logs: list[tuple[str, list]] = []
        self.metrics: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # async functions of a group may log at once

    def log_extra(self, column: str, values: list) -> None:
        with self._lock:
            self.extra_logs.append((column, list(values)))

    def log_metric(self, name: str, value: float) -> None:
        with self._lock:
            self.metrics.append((name, value))


def trl_completions(trl, prompts: list, prompt_ids: list, completion_ids: list[list[int]], episode=None) -> list:
    """What TRL's `_generate` hands the reward functions for these first-turn completions: GRPO (and PPO) parse
    them as their `_generate` does; RLOO decodes them (its `_generate` never parses tool calls)."""
    if trl.has_trl_method("_tool_call_loop"):
        if episode is not None:  # each row its own prompt, rendered with its environment's tools
            return first_turn_messages(trl, prompts, prompt_ids, completion_ids, episode.names)
        return first_turn_messages(trl, prompts, [list(prompt_ids) for _ in completion_ids], completion_ids)
    return decoded_completions(trl, prompts, completion_ids)


class StreamRewarder:
    """The stream's `score`: one finished prompt group's rewards (see the module's docstring)."""

    def __init__(self, trl, workers: int):
        from torch import nn
        from trl.trainer.utils import is_async_callable

        self.trl = trl
        functions = list(trl.reward_funcs)  # the step swaps the trainer's list while it replays: kept here
        names = list(trl.reward_func_names)
        self.columns = tuple(i for i, f in enumerate(functions) if not isinstance(f, nn.Module))
        self.functions = [(functions[i], names[i], is_async_callable(functions[i])) for i in self.columns]
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self._lock = threading.Lock()
        self._seconds, self._groups = 0.0, 0

    def __call__(self, rows: list, prompt_ids: list, choices: list[dict], episode=None) -> GroupRewards:
        started = time.monotonic()
        prompts = [row["prompt"] for row in rows]  # what TRL passes (its `_generate` works on a copy)
        conversations = [choice.get(CONVERSATION_KEY) for choice in choices]
        if conversations and all(c is not None for c in conversations):  # tool-using: whole conversations
            completion_ids = [list(c.completion_ids) for c in conversations]
            completions = [copy.deepcopy(c.messages) for c in conversations]
        else:
            completion_ids = [list(choice["token_ids"]) for choice in choices]
            completions = trl_completions(self.trl, prompts, prompt_ids, completion_ids, episode)
        calls = _Calls()
        keys = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")]
        arguments = {key: [row[key] for row in rows] for key in keys}  # as TRL's _calculate_rewards builds them
        arguments.update(trainer_state=self.trl.state, log_extra=calls.log_extra, log_metric=calls.log_metric)
        if episode is not None:  # the group's live instances, as TRL passes the batch's (get_reward reads them)
            arguments["environments"] = list(episode.instances)
        arguments.update(prompts=prompts, completions=completions, completion_ids=completion_ids)
        try:
            outputs = self._call_all(arguments)
        except (RewardFunctionError, ValueError) as error:
            where = f"computed in the stream, for the prompt group of {_short(prompts[0])}"
            raise type(error)(f"{error} ({where})") from error
        values = [[output[row] for output in outputs] for row in range(len(rows))]
        with self._lock:
            self._seconds += time.monotonic() - started
            self._groups += 1
        return GroupRewards(rows, completion_ids, completions, self.columns, values, calls.extra_logs, calls.metrics)

    def _call_all(self, arguments: dict) -> list[list]:
        """Every function's rewards for the group: the synchronous ones on the pool, the async ones gathered on TRL's
        event loop meanwhile; each checked as TRL checks them."""
        pending = {
            index: self._pool.submit(function, **arguments)
            for index, (function, _, is_async) in enumerate(self.functions)
            if not is_async
        }
        asynchronous = [(index, f) for index, (f, _, is_async) in enumerate(self.functions) if is_async]
        outputs: dict[int, list] = {}
        if asynchronous:

            async def gathered():
                return await asyncio.gather(*(function(**arguments) for _, function in asynchronous))

            results = asyncio.run_coroutine_threadsafe(gathered(), self.trl.async_loop).result()
            outputs.update((index, result) for (index, _), result in zip(asynchronous, results))
        outputs.update((index, future.result()) for index, future in pending.items())
        count = len(arguments["completion_ids"])
        for index, (_, name, _) in enumerate(self.functions):
            if len(outputs[index]) != count:  # TRL's own check, on the group
                raise ValueError(
                    f"The reward function '{name}' returned {len(outputs[index])} rewards, but {count} were expected "
                    "(one per prompt-completion pair). Make sure the reward function returns exactly one reward per "
                    "completion."
                )
        return [list(outputs[index]) for index in range(len(self.functions))]

    def metrics(self) -> dict[str, float]:
        """Seconds spent computing rewards in the stream (summed over groups) and groups scored, since the run
        started (counts, as the stream's others: a reader never resets them)."""
        with self._lock:
            return {"rewards/stream_seconds": self._seconds, "rewards/stream_groups_scored": float(self._groups)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _short(prompt) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", prompt))
    return repr(text if len(text) <= 80 else text[:77] + "...")


def _replay(values: list):
    """A reward function that returns `values` (computed in the stream) whatever it is asked."""

    def replay(**_) -> list:
        return values

    return replay


class StreamRewards(Feature):
    """TRL's `_calculate_rewards` for a streamed batch, answered from the rewards computed in the stream."""

    name = "stream_rewards"
    STEPS_ASIDE = {"rewards": "on a batch not streamed (an evaluation's): TRL computes its rewards"}

    @classmethod
    def build(cls, plan) -> StreamRewards | None:
        return cls() if plan.rollout.rewards_in_stream else None

    def rewards(self, run, proceed, inputs, prompts, completions, completion_ids_list):
        scored = run.step.streamed_rewards.take_if_given()
        if not scored:  # a batch not streamed (an evaluation's): TRL computes its rewards
            run.trace.stepped_aside(self.name, "rewards")
            return proceed(inputs, prompts, completions, completion_ids_list)
        _check_pairing(scored, inputs, completions, completion_ids_list)
        columns = scored[0].columns
        for group in scored:
            for column, values in group.extra_logs:
                run.trl.log_completion_extra(column, values)
            for name, value in group.metrics:
                run.trl.log_metric(name, value)
        functions = list(run.trl.reward_funcs)
        replayed = list(functions)
        for k, index in enumerate(columns):
            column = [row[k] for group in scored for row in group.values]
            replayed[index] = _replay([math.nan if value is None else value for value in column])
        with run.trl.reward_funcs_replaced(replayed):  # TRL's own method assembles them (a reward model scores here)
            return proceed(inputs, prompts, completions, completion_ids_list)


def _check_pairing(scored: list[GroupRewards], inputs, completions, completion_ids_list) -> None:
    """The rewards are those of these very rows and completions, in this order: anything else is a seam broken
    (trl_scale/seams), never a batch trained on another batch's rewards."""
    rows = [row for group in scored for row in group.rows]
    ids = [list(c) for group in scored for c in group.completion_ids]
    scored_completions = [c for group in scored for c in group.completions]
    paired = (
        len(rows) == len(inputs)
        and all(a is b for a, b in zip(rows, inputs))
        and ids == [list(c) for c in completion_ids_list]
        and scored_completions == list(completions)
    )
    if not paired:
        raise RuntimeError(
            "rewards in the stream: the step's rows and completions are not the ones whose rewards were computed "
            "in the stream: TRL's hook order is not the one trl-scale was built on (see trl_scale/seams)"
        )
