"""The step on one page: for a trainer class and its constructor arguments, the run's plan, each of TRL's hooks in
call order with the features that take it (outermost first, then TRL's method), the events, and every interception
in force. `trl-scale step` prints it; `docs/step.md` holds it for the demo's config (a test keeps it current)."""

from __future__ import annotations

from ..rollout.step_state import SERVE_CALLERS, STEP_FIELDS
from .adapter import TRL_METHODS
from .feature import EVENTS, FeatureChain, Patch
from .plan import RunPlan
from .trl_facade import TrlFacade

# TRL's hooks in the order a run calls them, with their depth (what runs inside what).
CALL_ORDER = (
    ("precompute_ref_logps", 0, "DPO, in TRL's constructor: the reference's log-probs of the dataset"),
    ("train", 0, "the run"),
    ("batch_samples", 1, "each optimizer step's batches"),
    ("generate_and_score", 1, "a generation batch, built"),
    ("tokenize_prompts", 2, "its prompts"),
    ("generate", 2, "its completions"),
    ("single_turn", 3, "one turn of generation"),
    ("tool_call_loop", 3, "the tool-calling turns"),
    ("tool_suffix", 4, "each turn's tool answers, as the next turn's tokens"),
    ("rewards", 2, "its rewards, per function"),
    ("scoring", 2, "log-probs: old and reference here, the policy's in the loss"),
    ("save_checkpoint", 1, "a checkpoint"),
    ("push_to_hub", 0, "the Hub"),
    ("init_hf_repo", 0, ""),
    ("create_model_card", 0, ""),
)
# Interceptions a trainer makes itself (not a feature's, nor TRL's attributes, which `TrlFacade` declares):
# colocated generation (online trainers), PPO's KL coefficient while TRL builds.
COLOCATED_GENERATION = Patch(
    "VLLMGeneration in TRL's trainer module",
    "while TRL's constructor runs, with vllm_mode='colocate' (trl-scale's ColocatedVLLMGeneration)",
    "when it returns",
    "rollout/colocate.py",
    lambda plan, config: bool(config.use_vllm) and config.vllm_mode == "colocate",
)
TRAINER_PATCHES = {
    "GRPOTrainer": (COLOCATED_GENERATION,),
    "RLOOTrainer": (COLOCATED_GENERATION,),
    "PPOTrainer": (
        COLOCATED_GENERATION,
        Patch(
            "config.beta (kl_coef)",
            "while TRL's constructor runs: TRL builds the reference that the reward's KL penalty needs",
            "when it returns",
            "trainers/ppo_trainer.py",
        ),
    ),
}


def trainer_patches(trainer_class: type) -> tuple[Patch, ...]:
    """The interceptions the nearest trl-scale trainer class in `trainer_class`'s bases makes itself."""
    return next((TRAINER_PATCHES[k.__name__] for k in trainer_class.__mro__ if k.__name__ in TRAINER_PATCHES), ())


def chain_for(trainer_class: type, plan: RunPlan) -> FeatureChain:
    """The features a trainer of `trainer_class` would run with this plan (as its constructor builds them)."""
    return FeatureChain.built(trainer_class.FEATURES, plan)


def _step_fields(chain: FeatureChain, plan: RunPlan) -> list[str]:
    """The `StepState` fields this run writes, each with its writers and readers in this run."""
    present = {type(feature).__name__ for feature in chain.features}
    if plan.rollout.server:  # trl-scale's generation interface, and the streamed rollout function it replays
        present |= {"ServerRolloutGeneration", "stream_rollout_func"}
    serve = [name for name in SERVE_CALLERS if _owner(name) in present]
    present |= {"StepScope"} | ({"StepState"} if serve else set())

    def here(names: tuple[str, ...]) -> list[str]:
        return [_short(name) for name in names if _owner(name) in present]

    lines = []
    for field in STEP_FIELDS:
        writers = here(field.writers)
        if writers:
            lines.append(f"  {field.name}: {field.holds}")
            lines.append(f"    written by {', '.join(writers)}; read by {', '.join(here(field.readers))}")
    if serve:
        lines.append(f"  (StepState.serve is called by {', '.join(_short(name) for name in serve)})")
    return lines


def _owner(qualified: str) -> str:
    """The class of `layer.module.Class.function`, or the module of `layer.module.function`."""
    parts = qualified.split(".")
    return parts[2] if len(parts) > 3 else parts[1]


def _short(qualified: str) -> str:
    """`trainers.dynamic_sampling.DynamicSampling.generate` -> `DynamicSampling.generate`."""
    parts = qualified.split(".")
    return ".".join(parts[2:]) if len(parts) > 3 else ".".join(parts[1:])


def describe_step(trainer_class: type, arguments: dict) -> str:
    """The printed step of a `trainer_class` built with `arguments` (TRL's constructor arguments, by name; no model is
    loaded and no server reached: the plan and the features are built, not set up)."""
    plan = RunPlan.from_arguments(trainer_class.__name__, arguments)
    chain = chain_for(trainer_class, plan)
    lines = [f"{trainer_class.__name__}: {plan.summary()}", "", "hooks, in call order (features outermost first):"]
    for hook, depth, meaning in CALL_ORDER:
        method = TRL_METHODS[hook]
        if not hasattr(trainer_class, method):
            continue
        takers = chain.names(hook)
        path = " > ".join([*takers, f"TRL {method}"])
        note = f"  ({meaning})" if meaning else ""
        lines.append(f"{'  ' * (depth + 1)}{hook}: {path}{note}")
    lines += ["", "events (every feature is told; these act on them):"]
    for event in EVENTS:
        takers = chain.names(event)
        lines.append(f"  {event}: {', '.join(takers) if takers else '-'}")
    asides = chain.steps_aside()
    lines += ["", "per call (the trace at every training log counts the calls each of these stepped aside on):"]
    lines += [f"  {name} on {hook}: steps aside {when}" for name, hook, when in asides] or ["  none"]
    lines += ["", "a generation batch's data (StepState: opened by the outermost generate_and_score, closed after):"]
    lines += _step_fields(chain, plan) or ["  none"]
    config = arguments.get("args")
    declared = (
        [("trainer", patch) for patch in trainer_patches(trainer_class)]
        + [(f"trl.{method}", patch) for method, patch in TrlFacade.interceptions()]
        + chain.patches()
    )
    patches = [(name, patch) for name, patch in declared if patch.made_in(plan, config)]
    lines += ["", "interceptions in force (outside TRL's hooks):"]
    for name, patch in patches:
        lines.append(f"  {patch.target} [{name}, {patch.where}]: {patch.when}; undone {patch.undone}")
    if not patches:
        lines.append("  none")
    return "\n".join(lines)
