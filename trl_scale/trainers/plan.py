"""The run plan: what a trainer's arguments ask of trl-scale, read and resolved once, before TRL's constructor.

The drop-in configs stay flat (TRL's fields and trl-scale's beside them); the plan is their typed reading for one run:
which client serves rollout, the asynchronous settings with every tri-state resolved (`stream_rewards=None` becomes
True or False here, nowhere else), and the features that act. A trainer's features are built from it, those that do
not act are left out of the chain, and a setting no feature would act on is refused here, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..logs import get_logger
from ..mismatch import MismatchSettings
from ..rollout.arguments import RolloutArguments
from ..rollout.settings import AsyncRollout
from ..scoring.router_loss import asks_router_logits
from ..scoring.sampler_support import SamplerSupport
from .construction import check_image_inputs, image_columns, names_vision_language, policy_config
from .setting_needs import refuse_unread_settings

if TYPE_CHECKING:
    from transformers import TrainingArguments

logger = get_logger(__name__)

# Who generates: TRL in the trainer (transformers, or vLLM colocated), or trl-scale's multi-server client (every
# `vllm_mode="server"` run, images included).
RolloutClient = Literal["trainer", "trl_scale"]
DEFAULT_ENVIRONMENT_TIMEOUT = 300.0


@dataclass(frozen=True)
class RolloutPlan:
    """Generation, resolved: the client, the asynchronous settings (synchronous unless trl-scale's client serves),
    and what the stream carries."""

    client: RolloutClient = "trainer"
    asynchronous: AsyncRollout = AsyncRollout()
    environments: bool = False  # TRL's environment_factory
    rollout_func: bool = False  # TRL's rollout_func
    takes_groups: bool = False  # the stream's engine runs: the step takes finished prompt groups whole
    rewards_in_stream: bool = False  # stream_rewards resolved: each group's rewards computed as it finishes
    stream_rewards_chosen: bool = False  # the user set stream_rewards (None, the default, is resolved here)
    # the sampler's log-prob of each token it drew is asked for the mismatch gate's per-step figures (RLOO's TRL asks
    # for none; GRPO's and PPO's always do)
    mismatch_measured: bool = False

    @property
    def server(self) -> bool:
        """trl-scale's client serves rollout."""
        return self.client == "trl_scale"


@dataclass(frozen=True)
class ScoringPlan:
    """How the policy is scored and generated with in the trainer, resolved: tree packing, sequence parallelism,
    and whether TRL generates locally (transformers' `generate`)."""

    tree_packing: bool | Literal["auto"] = "auto"
    sequence_parallel_size: int = 1  # ranks that score one packed row together (Ulysses); 1: none
    local_generation: bool = False  # TRL generates in the trainer with transformers (use_vllm=False)
    continuous_batching: bool = False  # TRL's local generation through `generate_batch`, not `generate`
    padding_free: bool | None = None  # the config's padding_free as given (DPO's: TRL's constructor turns it off)
    cast_lm_head_to_fp32: bool = False  # GRPO's: the head in fp32 (the other families have no such field)
    sampler_support: SamplerSupport | None = None  # the sampler's truncation the policy is scored on, where asked

    @staticmethod
    def _sampler_support(config: TrainingArguments) -> SamplerSupport | None:
        """Where the sampler's log-probs feed an importance-sampling correction (`sampler_logprobs_corrected`: TRL's,
        or RLOO's own) and `logprobs_on_sampler_support` is on with vLLM: the truncation it samples with."""
        on = getattr(config, "logprobs_on_sampler_support", False) and config.use_vllm  # a rollout config's fields
        return SamplerSupport.from_config(config) if on and config.sampler_logprobs_corrected else None

    @classmethod
    def from_config(cls, config: TrainingArguments) -> ScoringPlan:
        # DPO's config has no generation fields, and TRL's own configs none of trl-scale's: read once, here
        return cls(
            tree_packing=getattr(config, "tree_packing", "auto"),
            sequence_parallel_size=getattr(config, "sequence_parallel_size", 1),
            local_generation=hasattr(config, "use_vllm") and not config.use_vllm,
            continuous_batching=bool(getattr(config, "use_transformers_continuous_batching", False)),
            padding_free=getattr(config, "padding_free", None),
            cast_lm_head_to_fp32=bool(getattr(config, "cast_lm_head_to_fp32", False)),
            sampler_support=cls._sampler_support(config),
        )


@dataclass(frozen=True)
class RunPlan:
    """One run's reading of its trainer's arguments (see the module's docstring)."""

    trainer: str
    rollout: RolloutPlan = RolloutPlan()
    images: tuple[str, ...] = ()  # the datasets' image columns
    tools: bool = False  # TRL's tool loop runs: tools, or environments (whose methods are tools)
    vision_language: bool | None = None  # a vision-language policy; None: not asked (no tools, no image columns)
    remote_reference: bool = False  # the reference model on its own Ray group
    dynamic_sampling: bool = False
    corrects_sampler_logprobs: bool = False  # RLOO's own correction of prefetched completions
    scoring: ScoringPlan = ScoringPlan()
    timeline: bool = False  # rollout_timeline: the run's phases drawn and saved
    ray_backend: bool = False  # backend="ray"
    mismatch: MismatchSettings = MismatchSettings()  # the mismatch gate (server rollout)
    # an MoE policy whose config asks for its router's logits (read where the trainer generates: `router_logits.py`)
    router_logits: bool = False
    routing_replay: bool = False  # the servers' expert routes replayed in every training forward (R3)
    # the settings that cut a generation's rollout into the steps trained on it, those the family has (name, value)
    generation_window: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_arguments(cls, trainer_name: str, arguments: dict) -> RunPlan:
        """The plan of a trainer built with these constructor arguments (TRL's, by name). A setting that nothing in
        this run would act on is a ValueError naming the field and the fix."""
        config = arguments.get("args")
        refuse_unread_settings(config, arguments)
        images = tuple(image_columns(arguments.get("train_dataset"), arguments.get("eval_dataset")))
        tools = bool(arguments.get("tools")) or arguments.get("environment_factory") is not None
        # asked once, and only where tools or images need it (it may read the model's config from disk)
        vision_language = names_vision_language(arguments) if tools or images else None
        check_image_inputs(arguments, list(images), vision_language)
        if config is None:
            return cls(trainer_name, images=images, tools=tools, vision_language=vision_language)
        scoring = ScoringPlan.from_config(config)
        sp_size = scoring.sequence_parallel_size
        if images and sp_size > 1:
            raise ValueError(
                f"this dataset has image columns {list(images)}, and sequence_parallel_size={sp_size}: sequence "
                "parallelism shards token rows only, and a scoring call with images would fail at the first step. "
                "Fix: sequence_parallel_size=1, or drop the image columns"
            )
        if images and scoring.tree_packing is True:
            raise ValueError(
                f"this dataset has image columns {list(images)}, and tree_packing=True: tree rows take text-only "
                "scoring calls, and a call with images is scored as packed rows without trees, so the setting would "
                "not be read. Fix: tree_packing='auto' (tree rows where a call has no images) or tree_packing=False"
            )
        rollout = _rollout_plan(config, arguments)
        replay = isinstance(config, RolloutArguments) and config.routing_replay  # (a rollout config's field)
        if replay and (scoring.tree_packing is True or sp_size > 1):
            which = "tree_packing=True" if scoring.tree_packing is True else f"sequence_parallel_size={sp_size}"
            raise ValueError(
                f"routing_replay=True and {which}: replayed routes are laid out by packed rows, not by tree rows or "
                "a sequence shard. Fix: tree_packing='auto' (tree rows step aside while routes are replayed) or "
                "False, sequence_parallel_size=1; or routing_replay=False"
            )
        return cls(
            trainer=trainer_name,
            rollout=rollout,
            images=images,
            tools=tools,
            vision_language=vision_language,
            remote_reference=wants_remote_reference(config, arguments["model"], arguments.get("peft_config")),
            dynamic_sampling=bool(getattr(config, "dynamic_sampling", False)),
            corrects_sampler_logprobs=bool(getattr(config, "corrects_sampler_logprobs", False)),
            scoring=scoring,
            timeline=bool(getattr(config, "rollout_timeline", False)),
            ray_backend=getattr(config, "backend", "local") == "ray",
            mismatch=MismatchSettings.from_config(config),
            generation_window=_generation_window(config),
            router_logits=scoring.local_generation and _asks_router_logits(config, arguments),
            routing_replay=replay,
        )

    def summary(self) -> str:
        """One line for the run's log."""
        rollout = self.rollout
        parts = [f"rollout client: {rollout.client}"]
        if rollout.asynchronous.staleness:
            parts.append(
                f"async: staleness {rollout.asynchronous.staleness}, {rollout.asynchronous.mode}, "
                f"rewards {'in the stream' if rollout.rewards_in_stream else 'in the step'}"
            )
        parts += [
            name
            for name, on in (("dynamic sampling", self.dynamic_sampling), ("remote reference", self.remote_reference))
            if on
        ]
        return "; ".join(parts)


def _asks_router_logits(config: TrainingArguments, arguments: dict) -> bool:
    """Whether the policy's config asks for its MoE router's logits, as the model is loaded: its own config, or
    `model_init_kwargs` (TRL passes them to `from_pretrained`, which sets config fields)."""
    init_kwargs = config.model_init_kwargs or {}  # an online config (they generate in the trainer)
    if "output_router_logits" in init_kwargs:
        return bool(init_kwargs["output_router_logits"])
    model_config = policy_config(arguments)  # read as TRL's scoring reads it (its text config)
    return model_config is not None and asks_router_logits(model_config, {})


def _generation_window(config: TrainingArguments) -> tuple[tuple[str, int], ...]:
    names = ("steps_per_generation", "num_iterations", "num_ppo_epochs", "num_mini_batches")
    values = ((name, getattr(config, name, None)) for name in names)
    return tuple((name, value) for name, value in values if value is not None)


def _rollout_plan(config, arguments: dict) -> RolloutPlan:
    environments = arguments.get("environment_factory") is not None
    rollout_func = arguments.get("rollout_func") is not None
    server = uses_server_rollout(config)
    client: RolloutClient = "trl_scale" if server else "trainer"
    asynchronous = AsyncRollout.from_config(config) if server else AsyncRollout()
    stream_rewards = getattr(config, "stream_rewards", None)
    _refuse_unread(config, asynchronous, stream_rewards, environments, rollout_func)
    # None: an environment's rewards read its instance, which goes back to the pool when its episode ends in the
    # stream, so they are computed there; any other run computes them in the step unless asked
    in_stream = bool(asynchronous.staleness) and (stream_rewards is True or (stream_rewards is None and environments))
    return RolloutPlan(
        client=client,
        asynchronous=asynchronous,
        environments=environments,
        rollout_func=rollout_func,
        takes_groups=asynchronous.takes_groups(environments, rollout_func),
        rewards_in_stream=in_stream,
        stream_rewards_chosen=stream_rewards is not None,
        mismatch_measured=server and MismatchSettings.from_config(config).budget is not None,
    )


def _refuse_unread(config, asynchronous: AsyncRollout, stream_rewards, environments: bool, rollout_func: bool):
    """Environments (TRL's `environment_factory`) and a `rollout_func` with asynchronous rollout run in the stream's
    engine (streaming, or ordered: `rollout.ordered_stream`), an environment's rewards with it; `environment_timeout`
    acts only there. Refused before TRL's constructor, so before any server is reached."""
    why = asynchronous.unread_reward_workers(stream_rewards, environments)
    if why is not None:
        raise ValueError(why)
    if asynchronous.staleness and rollout_func:
        _check_streamed_rollout_func(config, stream_rewards, environments)
    if environments and asynchronous.staleness and stream_rewards is False:
        raise ValueError(
            "stream_rewards=False with environment_factory and async_rollout_staleness >= 1: each group's "
            "environments go back to their pool when its episode ends in the stream, so the rewards that read them "
            "(get_reward, environments=) are computed there. Fix: stream_rewards=None (the default) or True"
        )
    timeout = getattr(config, "environment_timeout", DEFAULT_ENVIRONMENT_TIMEOUT)
    if timeout != DEFAULT_ENVIRONMENT_TIMEOUT and not (environments and asynchronous.staleness):
        raise ValueError(
            f"environment_timeout={timeout:g} bounds the calls of environments run in the stream; this run "
            "streams none (it needs environment_factory=..., server rollout and async_rollout_staleness >= 1). "
            "Fix: leave environment_timeout at its default (300)"
        )


def _check_streamed_rollout_func(config, stream_rewards, environments: bool) -> None:
    """A rollout_func with asynchronous rollout runs in the stream's engine, once per prompt group; its rewards in
    the step."""
    if environments:
        raise ValueError(
            "rollout_func with environment_factory and async_rollout_staleness >= 1: the stream runs either a "
            "group's environment episode or its rollout_func, not one inside the other. Fix: "
            "async_rollout_staleness=0 (TRL's own loop runs both in the step), or drop one of them"
        )
    if stream_rewards:
        raise ValueError(
            "stream_rewards=True with a rollout_func: its extra keys reach the reward functions in the step, where "
            "TRL merges them. Fix: stream_rewards=None (the default) or False"
        )
    if getattr(config, "dynamic_sampling", False):
        raise ValueError(
            "dynamic_sampling=True with a streamed rollout_func: the top-up rounds generate without it. Fix: "
            "dynamic_sampling=False, or async_rollout_staleness=0"
        )


def wants_remote_reference(args, model, peft_config) -> bool:
    """Whether the reference goes to its own Ray group: backend='ray', a reference_placement, a KL term that needs a
    reference, and no PEFT (a PEFT policy's reference is its disabled adapter, which costs no extra model)."""
    if getattr(args, "backend", "local") != "ray" or getattr(args, "reference_placement", None) is None:
        return False
    if args.beta == 0.0:
        return False
    from accelerate.utils import is_peft_model

    if peft_config is not None or (not isinstance(model, str) and is_peft_model(model)):
        logger.warning("reference_placement is unused: a PEFT policy's reference is the policy without its adapter")
        return False
    return True


def uses_server_rollout(args) -> bool:
    """Which client serves `use_vllm=True, vllm_mode='server'`: trl-scale's, always (TRL's single
    `vllm_server_base_url` is a fleet of one: versions, the correction, streaming, the timeline), whether or not vLLM
    is importable in the trainer's environment, so one config acts the same in every environment; images included
    (what a run with images may not combine, sequence parallelism and tree_packing=True, the run plan refuses)."""
    return bool(getattr(args, "use_vllm", False)) and getattr(args, "vllm_mode", None) == "server"
