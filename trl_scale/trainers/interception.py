"""An interception: something outside TRL's hooks that trl-scale replaces, declared where it is made (a feature's
`PATCHES`, a TRL facade method's `@interception`), so that the printed step (`trl-scale step`) shows each in force."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import RunPlan


@dataclass(frozen=True)
class Patch:
    """Something outside TRL's hooks that a feature replaces: declared by the feature that makes it, so that the
    printed step (`trl-scale step`) shows every interception in force. `where` names the module that makes it (a
    test checks that every module making one is named by a declaration)."""

    target: str  # what is replaced, e.g. "model.forward"
    when: str  # when it is put in place
    undone: str  # when it is undone ("never": for the run)
    where: str  # the module (path under trl_scale/) that makes it
    in_force: Callable[[RunPlan, Any], bool] | None = None  # given the plan and config: made at all (None: always)

    def made_in(self, plan: RunPlan, config) -> bool:
        return self.in_force is None or config is None or self.in_force(plan, config)
