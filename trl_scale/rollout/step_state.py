"""A step's data with one owner: `StepState`, one generation batch's build.

TRL's `_generate_and_score_completions` builds a generation batch by calling its own methods (`_generate`,
`_calculate_rewards`, the tool loop), and trl-scale answers some of those calls from data an outer frame produced: a
streamed batch and its rewards, dynamic sampling's chosen rows, the rollout's record of what was generated. That data
lives here, for one build: the outermost `generate_and_score` frame opens a `StepState` (`StepScope.opened`) and it is
closed when that frame returns, so no value outlives the batch it belongs to. Each field is declared in `STEP_FIELDS`
with the functions that write and read it (`trl-scale step` prints them; tests/test_step_state.py checks them against
the code).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..handoff import Handoff
from .record import BatchRecords


class StepState:
    """One generation batch's build (see the module's docstring); its fields are `STEP_FIELDS`."""

    __slots__ = ("streamed", "streamed_rewards", "records", "chosen_completions", "chosen_rewards", "rewards_per_func")

    def __init__(self) -> None:
        # a streamed batch, answering TRL's one generate call (`serve`)
        self.streamed = Handoff("the streamed batch (for TRL's generate call)")
        # ... and its groups' rewards (computed in the stream), answering the reward call
        self.streamed_rewards = Handoff("the streamed batch's rewards (for TRL's reward call)")
        # one record per batch generated in this build, newest last (dynamic sampling's rounds generate several)
        self.records = BatchRecords()
        # dynamic sampling's chosen rows, answering TRL's `_generate` and `_calculate_rewards` (each once)
        self.chosen_completions = Handoff("dynamic sampling's chosen completions (for TRL's _generate)")
        self.chosen_rewards = Handoff("dynamic sampling's chosen rewards (for TRL's _calculate_rewards)")
        # PPO: each reward function's rewards, which TRL's step drops before PPO shapes them with the KL
        self.rewards_per_func = Handoff("PPOTrainer's rewards_per_func (from _calculate_rewards)")

    def serve(self, streamed) -> None:
        """TRL's next generate call is answered from `streamed` (a `StreamedBatch`), its reward call from the
        rewards computed in the stream, where there are any."""
        self.streamed.give(streamed)
        if streamed.rewards is not None:
            self.streamed_rewards.give(streamed.rewards)


class StepScope:
    """The run's current `StepState` (`current`, None between builds) and the last one closed (`last`: its records
    are read after the build by tests and chaos runs)."""

    def __init__(self) -> None:
        self.current: StepState | None = None
        self.last: StepState | None = None

    @contextmanager
    def opened(self) -> Iterator[StepState]:
        """The outermost frame opens a state; a frame inside it (an evaluation inside a training step never
        happens, but a nested call must not lose the outer state) gets the open one."""
        if self.current is not None:
            yield self.current
            return
        state = self.current = StepState()
        try:
            yield state
        finally:
            self.current, self.last = None, state

    def newest_record(self):
        """The newest record of the open build, else of the last one closed (for tests and chaos runs)."""
        state = self.current or self.last
        return state.records.newest() if state is not None else None


@dataclass(frozen=True)
class StepField:
    """A `StepState` field: what it holds, the one function (or the one method the writers share) that writes it,
    and the functions that read it (`module.Class.function`)."""

    name: str
    holds: str
    writers: tuple[str, ...]
    readers: tuple[str, ...]


STEP_FIELDS = (
    StepField(
        "streamed",
        "the streamed batch TRL's generate call answers from",
        ("rollout.step_state.StepState.serve",),
        ("rollout.generation.ServerRolloutGeneration.generate",),
    ),
    StepField(
        "streamed_rewards",
        "its rewards, computed in the stream",
        ("rollout.step_state.StepState.serve",),
        ("trainers.stream_rewards.StreamRewards.rewards",),
    ),
    StepField(
        "records",
        "the rollout's record of each batch generated (versions, sampler log-probs, servers, routes)",
        (
            "rollout.generation.ServerRolloutGeneration.generate",
            "trainers.stream_rollout_func.replayed_rollouts",
            "trainers.dynamic_sampling.DynamicSampling.generate",
            "trainers.server_rollout.ServerRollout.tool_call_loop",
        ),
        (
            "trainers.server_rollout.ServerRollout.generate_and_score",
            "trainers.server_rollout.ServerRollout.tool_call_loop",
            "trainers.dynamic_sampling.DynamicSampling.candidate_round",
            "trainers.routing_replay.RoutingReplay._book",
            "rollout.step_state.StepScope.newest_record",
        ),
    ),
    StepField(
        "chosen_completions",
        "dynamic sampling's chosen rows, for TRL's _generate",
        ("trainers.dynamic_sampling.DynamicSampling.generate_and_score",),
        ("trainers.dynamic_sampling.DynamicSampling.generate",),
    ),
    StepField(
        "chosen_rewards",
        "dynamic sampling's chosen rows' rewards, for TRL's _calculate_rewards",
        ("trainers.dynamic_sampling.DynamicSampling.generate_and_score",),
        ("trainers.dynamic_sampling.DynamicSampling.rewards",),
    ),
    StepField(
        "rewards_per_func",
        "PPO: each reward function's rewards, shaped with the KL after TRL's step returns",
        ("trainers.ppo_trainer.PPOTrainer._calculate_rewards",),
        ("trainers.ppo_trainer.PPOTrainer._generate_and_score_completions",),
    ),
)
# The callers of `StepState.serve` (its writers, one call each: the step's streamed batch, a top-up round's).
SERVE_CALLERS = (
    "trainers.server_rollout.ServerRollout._built",
    "trainers.dynamic_sampling.DynamicSampling.top_up_round",
)
