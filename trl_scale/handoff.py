"""A value one hook produces and a later hook consumes, where TRL's own code runs between them and no return value
can carry it (a step's data, `rollout.step_state`; PPO's rewards: `_calculate_rewards` returns into TRL's
`_generate_and_score_completions`; the critic's pending update: `_compute_loss` returns into TRL's `training_step`,
whose backward it overlaps)."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Handoff(Generic[T]):
    """One value, used once. Taking empties it; taking from an empty one, or giving twice without a take, is an
    error naming the hand-off: if TRL's hook order changes (see trl_scale/seams), the run stops instead of training on
    the previous batch's value."""

    def __init__(self, name: str):
        self.name = name
        self._value: T | None = None
        self._full = False

    def give(self, value: T) -> None:
        if self._full:
            raise RuntimeError(
                f"{self.name} was given twice before it was used: TRL's hook order is not the one "
                "trl-scale was built on (see trl_scale/seams)"
            )
        self._value, self._full = value, True

    def take(self) -> T:
        if not self._full:
            raise RuntimeError(
                f"{self.name} was not given before it was needed: TRL's hook order is not the one "
                "trl-scale was built on (see trl_scale/seams)"
            )
        value, self._value, self._full = self._value, None, False
        return value

    def take_if_given(self) -> T | None:
        return self.take() if self._full else None

    def clear(self) -> None:
        """Forget a value a failed step left behind."""
        self._value, self._full = None, False
