"""A trl-scale feature on TRL's trainer hooks, and the ordered chain the trainers' adapters run them in.

Every feature is one object with one small interface: events (`check`, `setup`, `log`, `save_state`, `load_state`,
`card_tags`) it is told of, and "around" hooks, each given `proceed` (what runs inside it: the next feature, then
TRL's own method) and the hook's arguments. Hooks and events are handed the `Run` (`trainers/run.py`), never the
trainer: TRL's attributes are read and written through `run.trl` (`trainers/trl_facade.py`). A feature overrides
only the hooks it needs; the adapter (`trainers/adapter.py`) overrides each of TRL's hooks once and runs the chain,
in the order the trainer's `FEATURES` lists (outermost first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from .interception import Patch

if TYPE_CHECKING:
    from .plan import RunPlan

# The around hooks: a feature method of this name wraps the adapter's trainer method of the same meaning.
AROUND_HOOKS = (
    "generate_and_score",  # TRL's `_generate_and_score_completions(inputs)`: one generation batch, built
    "generate",  # `_generate(prompts)`: completions
    "rewards",  # `_calculate_rewards(inputs, prompts, completions, completion_ids_list)`: rewards per function
    "scoring",  # `_get_per_token_logps_and_entropies(model, input_ids, ...)`: log-probs of a model
    "single_turn",  # `_generate_single_turn(...)`: one turn of local generation
    "tool_call_loop",  # `_tool_call_loop(...)`: a batch's tool-calling turns
    "tool_suffix",  # `_get_tool_suffix_ids(tool_messages)`: a turn's tool answers, as the next turn's tokens
    "tokenize_prompts",  # `_tokenize_prompts(prompts)`
    "precompute_ref_logps",  # DPO: `_precompute_ref_logps(dataset, name, batch_size)`
    "batch_samples",  # `get_batch_samples(epoch_iterator, num_batches, device)`
    "train",  # `train(...)`: the whole run
    "save_checkpoint",  # `_save_checkpoint(model, trial)`
    "push_to_hub",
    "init_hf_repo",
    "create_model_card",
)
EVENTS = ("check", "setup", "log", "save_state", "load_state", "state_dict", "load_state_dict", "card_tags")


def sequence_parallel(plan: RunPlan, config) -> bool:
    return plan.scoring.sequence_parallel_size > 1


class Feature:
    """One trl-scale feature. Subclasses set `name` and override what they need; every default does nothing (an
    around hook's default is not called: the chain skips features that do not override it)."""

    name: ClassVar[str] = "feature"
    PATCHES: ClassVar[tuple[Patch, ...]] = ()  # the interceptions outside TRL's hooks this feature makes
    # hook -> when the feature, built, steps aside on a call of it (`run.trace.stepped_aside`: the trace counts it)
    STEPS_ASIDE: ClassVar[dict[str, str]] = {}

    @classmethod
    def build(cls, plan: RunPlan) -> Feature | None:
        """The feature for a run with this plan (the run's settings, read once from the constructor's arguments
        before TRL's constructor runs; a feature never sees the arguments themselves), or None where it would not
        act: the chain holds only the features that do. Live handles come later, with the run, at `setup`."""
        return cls()

    def check(self, run) -> None:
        """After TRL's constructor, before any feature sets up: refuse a setting that cannot work (every feature
        checks before any starts a server or a Ray group)."""

    def setup(self, run) -> None:
        """After TRL's constructor: install what the feature needs (features set up in the chain's order)."""

    def log(self, run, logs: dict[str, float]) -> None:
        """Add figures to a training log (`logs` has "loss"), before `report_to` integrations get it."""

    def save_state(self, run, output_dir: str) -> None:
        """A checkpoint is being saved into `output_dir` (after TRL's optimizer and scheduler): files that are not
        state (the timeline's); state goes through `state_dict`."""

    def load_state(self, run, checkpoint: str) -> None:
        """Resuming from `checkpoint` (after TRL loaded its optimizer and scheduler), before any feature's state is
        loaded."""

    def state_dict(self, run) -> dict | None:
        """What resumes this feature exactly, saved with every checkpoint in this rank's one state file, under the
        feature's name (`feature_state`); None: nothing to save now."""
        return None

    def load_state_dict(self, run, state: dict, path: str) -> None:
        """Resuming: this feature's saved `state` (from the file at `path`), which it checks against this run."""

    def card_tags(self, run) -> list[str]:
        """The model card's tags for this feature, where it is in use."""
        return []


F = TypeVar("F", bound=Feature)


def _takes(feature: Feature, hook: str) -> bool:
    method = getattr(type(feature), hook, None)
    return method is not None and method is not getattr(Feature, hook, None)


class FeatureChain:
    """The features of one trainer, in order (outermost first): runs an around hook through those that take it,
    and an event through all."""

    def __init__(self, features: Iterable[Feature]):
        self.features = tuple(features)
        names = [feature.name for feature in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"a feature is listed twice: {names}")

    def names(self, hook: str | None = None) -> list[str]:
        """The features' names, in order; with `hook`, those that take it."""
        return [feature.name for feature in self.features if hook is None or _takes(feature, hook)]

    @classmethod
    def built(cls, kinds: Iterable[type[Feature]], plan: RunPlan) -> FeatureChain:
        """The chain of `kinds` (a trainer's `FEATURES`) for a run with this plan: only the features that act."""
        features = (kind.build(plan) for kind in kinds)
        return cls(feature for feature in features if feature is not None)

    def by_hook(self) -> dict[str, list[str]]:
        """Per around hook that any feature takes, the features taking it, outermost first."""
        return {hook: self.names(hook) for hook in AROUND_HOOKS if self.names(hook)}

    def get(self, kind: type[F]) -> F | None:
        return next((feature for feature in self.features if isinstance(feature, kind)), None)

    def around(self, hook: str, run, innermost: Callable, *args: Any, **kwargs: Any) -> Any:
        """`hook` through every feature that takes it, outermost first, then `innermost` (TRL's method)."""
        return self.below(None, hook, run, innermost)(*args, **kwargs)

    def below(self, feature: Feature | None, hook: str, run, innermost: Callable) -> Callable:
        """The chain of `hook` under `feature` (all of it for None): what a feature calls to run the hook without
        itself and the features outside it (dynamic sampling's rounds compute rewards as TRL's step would)."""
        position = -1 if feature is None else self.features.index(feature)
        takers = [f for index, f in enumerate(self.features) if index > position and _takes(f, hook)]
        call = innermost
        for taker in reversed(takers):
            call = _bound(taker, hook, run, call)
        return call

    def event(self, name: str, run, *args: Any) -> None:
        for feature in self.features:
            getattr(feature, name)(run, *args)

    def card_tags(self, run) -> list[str]:
        return [tag for feature in self.features for tag in feature.card_tags(run)]

    def steps_aside(self) -> list[tuple[str, str, str]]:
        """(feature, hook, when) for every per-call decision the chain's features declare, in the chain's order."""
        return [(f.name, hook, when) for f in self.features for hook, when in f.STEPS_ASIDE.items()]

    def patches(self) -> list[tuple[str, Patch]]:
        """Every interception the chain's features declare, with the feature's name, in the chain's order."""
        return [(feature.name, patch) for feature in self.features for patch in feature.PATCHES]


def _bound(feature: Feature, hook: str, run, proceed: Callable) -> Callable:
    method = getattr(feature, hook)

    def call(*args, **kwargs):
        if run is not None:
            run.trace.entered(feature.name, hook)
        return method(run, proceed, *args, **kwargs)

    return call
