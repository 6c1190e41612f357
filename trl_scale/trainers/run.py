"""The run every feature hook and event is handed instead of the trainer (`Run`).

The run's plan (its settings, resolved once), TRL's trainer through its one facade (`trl`), the feature chain below
a feature (`below`), the trainer's phase clock (`clock`, with the rollout timeline where one is recorded: the rollout
client and phase timing are both given it), and the hook trace. Built by the adapter before TRL's constructor runs
(DPO's reference scoring is hooked inside it); the facade reads the trainer when asked, so what TRL's constructor
sets is there once it returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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

    def below(self, feature: Feature, hook: str) -> Callable:
        """`hook` as run under `feature`: the features inside it, then TRL's method (dynamic sampling's rounds
        generate and compute rewards as TRL's step would)."""
        return self.chain.below(feature, hook, self, self.trl_hook(hook))
