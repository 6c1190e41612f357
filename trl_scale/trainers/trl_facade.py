"""The one place outside the trainer classes and the adapter that reads or writes TRL's trainer (`TrlFacade`).

Features never hold the trainer: they are handed a `Run` (`trainers/run.py`) whose `trl` is this facade. Each TRL
attribute trl-scale reads is declared here once (`Read`: its TRL name, and what it answers where a trainer family
has none), each write is one method declared as an interception (`interception`: what it replaces, when, and when
it is undone), and `trl-scale step` lists the declarations in force from this module, so the page cannot miss one.
A TRL release that renames an attribute breaks here, at one line (the seam registry, `trl_scale/seams`, is the
tested twin of this list).
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from .construction import overridden, trl_base_class
from .interception import Patch

if TYPE_CHECKING:
    from .plan import RunPlan

_REQUIRED = object()


class Read:
    """A TRL trainer attribute the features read, under the facade's name; `absent`: what a trainer family without
    it answers (left out: every family has it, and its absence is an error)."""

    def __init__(self, what: str, attribute: str | None = None, absent: Any = _REQUIRED):
        self.what, self.attribute, self.absent = what, attribute, absent

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.attribute = self.attribute or name

    def __get__(self, facade: TrlFacade | None, owner: type) -> Any:
        if facade is None:
            return self
        if self.absent is _REQUIRED:
            return getattr(facade._trainer, self.attribute)
        return getattr(facade._trainer, self.attribute, self.absent)

    def __set__(self, facade: TrlFacade, value: Any) -> None:
        raise AttributeError(f"TrlFacade.{self.name} is read-only: TRL's trainer is written by a declared method")


def interception(target: str, when: str, undone: str, in_force: Callable[[RunPlan, Any], bool] | None = None):
    """Declares a facade method that writes TRL's trainer: `trl-scale step` lists it (where `in_force`)."""

    def declare(method: Callable) -> Callable:
        method.interception = Patch(target, when, undone, "trainers/trl_facade.py", in_force)
        return method

    return declare


def _environments(plan: RunPlan, config) -> bool:
    return plan.rollout.environments


def _streamed(key: str) -> Callable[[RunPlan, Any], bool]:
    return lambda plan, config: getattr(plan.rollout, key) and plan.rollout.takes_groups


class TrlReads:
    """The TRL trainer attributes features read (each declared once, below)."""

    __slots__ = ("_trainer",)  # nothing else is set on a facade: TRL's trainer is written by declared methods

    # ---- reads: transformers' Trainer ------------------------------------------------------------------------
    accelerator = Read("the run's Accelerator")
    args = Read("the trainer's config (trl-scale's drop-in config)")
    model = Read("the policy (wrapped by accelerate where it wraps)")
    model_wrapped = Read("the policy as DeepSpeed / FSDP wrap it")
    processing_class = Read("the tokenizer or processor")
    state = Read("transformers' TrainerState")
    train_dataset = Read("the training dataset")
    is_fsdp_enabled = Read("FSDP wraps the model")
    is_deepspeed_enabled = Read("DeepSpeed wraps the model")
    # ---- reads: TRL's online trainers ------------------------------------------------------------------------
    generation_config = Read("local generation's GenerationConfig")
    temperature = Read("the sampling temperature (the log-probs' too)")
    tokenizer = Read("the tokenizer (a processor's own, for a vision-language policy)", "_tokenizer")
    num_generations = Read("completions per prompt")
    num_generations_eval = Read("completions per prompt in evaluation")
    num_iterations = Read("optimizer passes per generation batch")
    reward_funcs = Read("the reward functions and models, in order")
    reward_func_names = Read("their names")
    reward_weights = Read("their weights (a tensor)")
    async_loop = Read("TRL's event loop for async reward functions and tools")
    tools = Read("TRL's standalone tools list", absent=None)
    standalone_tools = Read("the tools every rollout has", "_standalone_tools")
    environment_tools = Read("each environment's tools, by name", "_env_tools")
    multi_environment = Read("rows name their environment", "_multi_environment")
    environment_factories = Read("TRL's environment factories, by name", absent=None)
    environment_pool = Read("TRL's pool of environment instances", "_environment_pool")
    rollout_func = Read("the user's rollout_func", absent=None)
    vllm_generation = Read("the object TRL generates through (trl-scale's client in server rollout)", absent=None)
    use_vllm = Read("TRL generates with vLLM")
    ref_model = Read("the reference model (None: none, or the Ray group's handle)")
    beta = Read("the KL coefficient TRL uses now")
    importance_sampling_correction = Read(
        "TRL's vLLM correction is on", "vllm_importance_sampling_correction", absent=None
    )
    importance_sampling_mode = Read("TRL's correction mode", "vllm_importance_sampling_mode")
    importance_sampling_clip_min = Read("its lower clip", "vllm_importance_sampling_clip_min")
    importance_sampling_clip_max = Read("its upper clip", "vllm_importance_sampling_clip_max")
    image_pad_token_id = Read("the token TRL pads image tokens with", "_image_pad_token_id")
    buffered_inputs = Read("TRL's generation batch, split for its optimizer steps", "_buffered_inputs")
    buffer_step = Read("TRL's step counter into that batch", "_step")
    pending_extra_logs = Read("extra columns logged by reward functions, not yet logged", "_pending_extra_logs")
    weights_synced_at_step = Read("the global step TRL last synced the servers' weights at", "_last_loaded_step")
    # ---- reads: TRL's DPO ----------------------------------------------------------------------------------------
    use_weighting = Read("DPO weights each pair's loss by its probability (WPO)")
    # ---- reads: trl-scale's own, kept on the trainer for the callbacks and `close_rollout_servers` -----------
    rollout_fleet = Read("the managed vLLM fleet", absent=None)

    def __init__(self, trainer: Any):
        self._trainer = trainer  # never handed out: each use is a declared read or write

    @classmethod
    def reads(cls) -> dict[str, Read]:
        return {
            name: member for klass in cls.__mro__ for name, member in vars(klass).items() if isinstance(member, Read)
        }


class TrlCalls(TrlReads):
    """TRL's (and transformers') trainer methods the features call."""

    __slots__ = ()

    def metrics(self, mode: str | None = None) -> dict[str, list[float]]:
        """TRL's metric lists of `mode` ("train", "eval"; None: the model's mode now)."""
        return self._trainer._metrics[mode or ("train" if self.model.training else "eval")]

    def log_metric(self, name: str, value: float) -> None:
        self._trainer._log_metric(name, value)

    def log_completion_extra(self, column: str, values: list) -> None:
        self._trainer._log_completion_extra(column, values)

    def tokenize_prompts(self, prompts: list):
        """The trainer's `_tokenize_prompts` (through the features that hook it)."""
        return self._trainer._tokenize_prompts(prompts)

    def policy_logps(self, input_ids, attention_mask, logits_to_keep: int, base: bool = False):
        """The policy's log-probs of each row's last `logits_to_keep` tokens, as TRL scores them (its method, through
        the features that hook it: the packed engine), without gradients; `base`: a PEFT policy's adapter off."""
        import contextlib

        import torch

        trainer = self._trainer
        adapter_off = contextlib.nullcontext()
        if base:
            adapter_off = trainer.accelerator.unwrap_model(trainer.model).disable_adapter()
        with torch.no_grad(), adapter_off:
            scored = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, logits_to_keep, batch_size=input_ids.size(0)
            )
        return scored[0]

    def trl_method(self, name: str) -> Callable:
        """TRL's own `name`, unbound (the stream calls it on a view of the trainer)."""
        return getattr(trl_base_class(self._trainer), name)

    def has_trl_method(self, name: str) -> bool:
        return hasattr(trl_base_class(self._trainer), name)

    @property
    def trl_module(self):
        """The module of the TRL trainer class (its module-level helpers, which some features wrap)."""
        return sys.modules[trl_base_class(self._trainer).__module__]

    def add_callback(self, callback) -> None:
        self._trainer.add_callback(callback)

    def save_model(self, output_dir: str) -> None:
        self._trainer.save_model(output_dir, _internal_call=True)

    def is_world_process_zero(self) -> bool:
        return self._trainer.is_world_process_zero()

    def card_features(self) -> list[str]:
        return self._trainer.card_features()

    def output_dir(self, trial) -> str:
        return self._trainer._get_output_dir(trial=trial)

    def view(self, **own) -> TrainerView:
        """The trainer as one of TRL's methods sees it for one prompt group: `own` shadows its attributes."""
        return TrainerView(self._trainer, **own)

    def group_view(self, num_rows: int, send_turns, lock: threading.Lock, episode=None, timeout=None) -> _GroupView:
        """The trainer as TRL's tool loop sees it for one prompt group in a stream thread (`streamed_tools`)."""
        return _group_view(self._trainer, num_rows, send_turns, lock, episode, timeout)


class TrlFacade(TrlCalls):
    """TRL's trainer as trl-scale's features see it: declared reads (`TrlReads`), TRL's methods (`TrlCalls`), and
    here the writes, each an interception `trl-scale step` lists."""

    __slots__ = ()

    @interception(
        "trainer.vllm_generation, use_vllm, vllm_mode, _last_loaded_step",
        "setup, with server rollout: trl-scale's client stands in for TRL's",
        "never",
        lambda plan, config: plan.rollout.server,
    )
    def install_rollout_client(self, generation) -> None:
        trainer = self._trainer
        trainer.vllm_generation, trainer.use_vllm, trainer.vllm_mode = generation, True, "server"
        trainer._last_loaded_step = -1

    @interception(
        "trainer.rollout_fleet (trl-scale's managed servers)",
        "setup, with server rollout",
        "never",
        lambda plan, config: plan.rollout.server,
    )
    def set_rollout_fleet(self, fleet) -> None:
        self._trainer.rollout_fleet = fleet

    @interception(
        "trainer._last_loaded_step (TRL's marker of the step its weights were synced at)",
        "each generation batch's build when the step takes streamed groups: the sync TRL would make first is made, "
        "then marked; and before the first batch, where the mismatch gate measures the servers after that sync",
        "never (TRL's own marker, kept current)",
        lambda plan, config: plan.rollout.takes_groups or (plan.rollout.server and plan.mismatch.budget is not None),
    )
    def mark_synced(self) -> None:
        self._trainer._last_loaded_step = self.state.global_step

    @interception(
        "trainer.reward_funcs",
        "TRL's reward call for a streamed batch (replayed from the stream's rewards)",
        "when the call returns",
        lambda plan, config: plan.rollout.rewards_in_stream,
    )
    def reward_funcs_replaced(self, functions: list) -> AbstractContextManager[None]:
        return overridden(self._trainer, reward_funcs=functions)

    @interception(
        "trainer.reward_funcs (the get_reward TRL adds for environments, wrapped in trl-scale's checks)",
        "after TRL's constructor, with an environment_factory",
        "never",
        _environments,
    )
    def set_reward_funcs(self, functions: list) -> None:
        self._trainer.reward_funcs = functions

    @interception(
        "trainer.environment_factories (each instance's reset() checked)",
        "after TRL's constructor, with an environment_factory",
        "never",
        _environments,
    )
    def set_environment_factories(self, factories: dict) -> None:
        self._trainer.environment_factories = factories

    @interception(
        "trainer.environment_factories, trainer._environment_pool",
        "a streamed batch's step, with environments",
        "at the step's end",
        _streamed("environments"),
    )
    def environments_replaced(self, factories: dict, pool: dict) -> AbstractContextManager[None]:
        return overridden(self._trainer, environment_factories=factories, _environment_pool=pool)

    @interception(
        "trainer.rollout_func (its output checked)",
        "after TRL's constructor, with a rollout_func",
        "never",
        lambda plan, config: plan.rollout.rollout_func,
    )
    def set_rollout_func(self, function: Callable) -> None:
        self._trainer.rollout_func = function

    @interception(
        "trainer.rollout_func",
        "a streamed batch's step, with a rollout_func (answers TRL's one call)",
        "after that call, or at the step's end",
        _streamed("rollout_func"),
    )
    @contextmanager
    def rollout_func_replaced(self, stand_in: Callable[[Callable[[], None]], Callable]) -> Iterator[None]:
        """Within the block TRL calls `stand_in(restore)` in place of the user's rollout_func; `restore` puts the
        user's back early (the replay answers one call)."""
        trainer = self._trainer
        function = trainer.rollout_func

        def restore() -> None:
            trainer.rollout_func = function

        trainer.rollout_func = stand_in(restore)
        try:
            yield
        finally:
            restore()

    @interception(
        "trainer._batch_environments",
        "each dynamic-sampling round with environments: the round's rows' environments",
        "the next round's, or TRL's next batch",
        lambda plan, config: plan.dynamic_sampling and plan.rollout.environments,
    )
    def set_batch_environments(self, names: list) -> None:
        self._trainer._batch_environments = names

    @interception(
        "trainer._image_pad_token_id",
        "setup, with tools on a vision-language policy whose processor names no pad token (its image token stands in)",
        "never",
        lambda plan, config: plan.tools and bool(plan.vision_language),
    )
    def set_image_pad_token_id(self, token: int) -> None:
        self._trainer._image_pad_token_id = token

    @interception(
        "trainer.ref_model (the Ray reference group's handle) and trainer.beta (the config's again)",
        "setup, with a remote reference (TRL built none: beta was 0 while it built)",
        "never",
        lambda plan, config: plan.remote_reference,
    )
    def use_remote_reference(self, handle) -> None:
        trainer = self._trainer
        trainer.beta, trainer.ref_model = trainer.args.beta, handle

    @interception(
        "trainer._step, trainer._buffered_inputs (TRL's split generation batch)",
        "resuming from a checkpoint saved mid generation batch",
        "never (TRL's own state, restored)",
        lambda plan, config: hasattr(config, "steps_per_generation"),  # an online trainer's
    )
    def restore_buffered_inputs(self, step: int, inputs) -> None:
        self._trainer._step, self._trainer._buffered_inputs = step, inputs

    @interception(
        "trainer.beta (PPO's kl_coef)",
        "each PPO generation batch's build: TRL scores the reference log-probs the reward's KL penalty needs",
        "when the build returns",
        lambda plan, config: hasattr(config, "kl_coef"),
    )
    def beta_replaced(self, beta: float) -> AbstractContextManager[None]:
        return overridden(self._trainer, beta=beta)

    @classmethod
    def interceptions(cls) -> list[tuple[str, Patch]]:
        """Every declared write, by method name, in the class's order."""
        return [(name, member.interception) for name, member in vars(cls).items() if hasattr(member, "interception")]


# ---- views of the trainer, for TRL's methods called for one prompt group ---------------------------------------


class TrainerView:
    """The trainer as one of TRL's methods sees it when called for one prompt group: the trainer's attributes, those
    set on the view (the group's own) shadowing them."""

    def __init__(self, trainer, **own):
        self._trainer = trainer
        vars(self).update(own)

    def __getattr__(self, name: str):
        return getattr(self._trainer, name)


class _GroupView(TrainerView):
    """The trainer as TRL's tool loop sees it, for one prompt group in a stream thread. Built by `_group_view`, an
    instance of the trainer's own class too: TRL's loop calls `super()._prepare_inputs` for tools that answer with
    images, which takes only an instance of TRL's class."""

    def __init__(self, trainer, num_rows: int, send_turns, lock: threading.Lock, episode=None, timeout=None):
        super().__init__(trainer)
        # the trainer's features hook what TRL's loop calls on the view (a tool answer's check): the adapter reads
        # them from the instance's own attributes, which the view's are
        own = vars(trainer)
        self.features, self.run = own.get("features"), own.get("run")
        self._send_turns = send_turns
        self._lock = lock
        self._sync_tool_dicts, self._async_tool_dicts = [], []
        for row in range(num_rows):  # TRL's per-rollout tables: standalone tools, then the row's environment's methods
            methods = episode.tool_methods(row, timeout) if episode is not None else []
            sync_tools, async_tools = {}, {}
            for tool in [*trainer._standalone_tools, *methods]:
                (async_tools if inspect.iscoroutinefunction(tool) else sync_tools)[tool.__name__] = tool
            self._sync_tool_dicts.append(sync_tools)
            self._async_tool_dicts.append(async_tools)
        if episode is not None:
            self._batch_environments = list(episode.names)  # the group's, not the step's

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations=1, has_tool_images=False):
        # each row's images in the order their tokens sit: the prompt's, then those its tools answered with (TRL
        # merges them so); the server reads no multimodal fields, it renders the images itself
        with_images = {"images": images} if images is not None and any(images) else {}
        self._lock.release()  # other conversations run their tools while this turn generates
        try:
            return self._send_turns([list(ids) for ids in prompt_ids], **with_images)
        finally:
            self._lock.acquire()


@functools.cache
def _group_view_class(trainer_class: type) -> type:
    # the view's own methods first, then the trainer's (bound to the view: they read its shadowing attributes)
    return type(f"GroupView[{trainer_class.__name__}]", (_GroupView, trainer_class), {})


def _group_view(trainer, *args) -> _GroupView:
    """`_GroupView(trainer, *args)`, of a class that is also the trainer's (never initialised as a trainer: the
    trainer's attributes are read through the view)."""
    cls = _group_view_class(type(trainer))
    view = object.__new__(cls)
    _GroupView.__init__(view, trainer, *args)
    for name in _class_values(cls) & vars(trainer).keys() - vars(view).keys():
        setattr(view, name, getattr(trainer, name))  # the trainer's own value, not its class's default
    return view


@functools.cache
def _class_values(cls: type) -> frozenset[str]:
    """The names `cls` gives plain values (a class-level default an instance may set): a view would read those
    from its class rather than from the trainer."""
    return frozenset(
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if not name.startswith("__") and not callable(value) and not hasattr(value, "__get__")
    )
