"""The run every feature hook and event is handed instead of the trainer (`Run`).

The run's plan (its settings, resolved once), TRL's trainer through its one facade (`trl`), the feature chain below
a feature (`below`), the trainer's phase clock (`clock`, with the rollout timeline where one is recorded: the rollout
client and phase timing are both given it), the hook trace, and the data of the generation batch being built
(`step`, a `StepState`). Built by the adapter before TRL's constructor runs
(DPO's reference scoring is hooked inside it); the facade reads the trainer when asked, so what TRL's constructor
sets is there once it returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..rollout.step_state import StepScope, StepState
from ..timeline import PhaseClock
from .trace import HookTrace

if TYPE_CHECKING:
    from .feature import Feature, FeatureChain
    from .plan import RunPlan
    from .trl_facade import TrlFacade


@dataclass(frozen=True)
class Run:
    """One run, as its features see it (see the module's docstring)."""

    plan: RunPlan
    trl: TrlFacade
    chain: FeatureChain
    trl_hook: Callable[[str], Callable]  # an around hook's name -> TRL's own method, bound to the trainer
    clock: PhaseClock = field(default_factory=PhaseClock)  # the trainer's phases (and the timeline, where recorded)
    trace: HookTrace = field(default_factory=HookTrace)  # which features' hooks ran since the last log
    steps: StepScope = field(default_factory=StepScope)  # the open generation batch's build, its data (`step`)

    @property
    def step(self) -> StepState:
        """The state of the generation batch being built (opened by the outermost `generate_and_score` frame)."""
        state = self.steps.current
        if state is None:
            raise RuntimeError(
                "no generation batch is being built: a step's data is read outside TRL's "
                "_generate_and_score_completions (TRL's hook order is not the one trl-scale was built on: see "
                "trl_scale/seams)"
            )
        return state

    def below(self, feature: Feature, hook: str) -> Callable:
        """`hook` as run under `feature`: the features inside it, then TRL's method (dynamic sampling's rounds
        generate and compute rewards as TRL's step would)."""
        return self.chain.below(feature, hook, self, self.trl_hook(hook))
