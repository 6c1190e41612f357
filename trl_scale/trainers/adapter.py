"""The one place trl-scale overrides TRL's trainer hooks: each once, running the trainer's features in order.

A trainer family's adapter (`OnlineHooks` for GRPO, RLOO and PPO; `PreferenceHooks` for DPO) sits between the
trl-scale trainer and TRL's. Each of its hooks hands the call to the trainer's `FeatureChain` (`self.features`,
built from the class's `FEATURES`, outermost first), whose innermost call is TRL's own method. What runs in a step
is the list, read top to bottom; the features are in `trainers/*.py`, one object each (`trainers/feature.py`).
"""

from __future__ import annotations

from typing import ClassVar

from ..logs import get_logger
from ..rollout.record import RECORD_KEY
from ..timeline import PhaseClock, Timeline
from .feature import Feature, FeatureChain
from .feature_state import load_feature_states, save_feature_states
from .plan import RunPlan
from .run import Run
from .trl_facade import TrlFacade

logger = get_logger(__name__)

# The around hooks' TRL methods (a feature's hook name -> the trainer method it wraps).
TRL_METHODS = {
    "generate_and_score": "_generate_and_score_completions",
    "generate": "_generate",
    "rewards": "_calculate_rewards",
    "scoring": "_get_per_token_logps_and_entropies",
    "single_turn": "_generate_single_turn",
    "tool_call_loop": "_tool_call_loop",
    "tool_suffix": "_get_tool_suffix_ids",
    "tokenize_prompts": "_tokenize_prompts",
    "precompute_ref_logps": "_precompute_ref_logps",
    "batch_samples": "get_batch_samples",
    "train": "train",
    "save_checkpoint": "_save_checkpoint",
    "push_to_hub": "push_to_hub",
    "init_hf_repo": "init_hf_repo",
    "create_model_card": "create_model_card",
}


class FeatureHooks:
    """The hooks every trl-scale trainer family shares: the run, logs, checkpoints and the Hub."""

    FEATURES: ClassVar[tuple[type[Feature], ...]] = ()
    features: FeatureChain
    run: Run

    def _start_features(self, arguments: dict) -> RunPlan:
        """The run's plan, the features that act in it and the `Run` they are handed, made from the constructor
        arguments before TRL's constructor runs (DPO's packed scoring is asked for inside it)."""
        self.plan = RunPlan.from_arguments(type(self).__name__, arguments)
        self.features = FeatureChain.built(self.FEATURES, self.plan)
        clock = PhaseClock(Timeline() if self.plan.timeline else None)
        self.run = Run(self.plan, TrlFacade(self), self.features, self._trl_hook, clock)
        return self.plan

    def _trl_hook(self, hook: str):
        """TRL's own method of an around hook, bound to this trainer."""
        return getattr(super(), TRL_METHODS[hook])

    def _set_up_features(self) -> None:
        """After TRL's constructor: every feature checks, then every feature sets up, in order."""
        self.features.event("check", self.run)
        self.features.event("setup", self.run)
        if self.accelerator.is_main_process:
            logger.info(f"trl-scale plan: {self.plan.summary()}")
            for hook, names in self.features.by_hook().items():
                logger.info(f"trl-scale {hook}: {' > '.join(names)} > TRL")

    def _chain(self) -> FeatureChain:
        """The trainer's features; none on a trainer built without trl-scale's constructor (TRL's own tests build
        one with `object.__new__` and set TRL's attributes by hand): its hooks are then TRL's methods."""
        return self.__dict__.get("features") or FeatureChain(())

    def _run(self) -> Run | None:
        """The trainer's run; none on a trainer built without trl-scale's constructor (see `_chain`)."""
        return self.__dict__.get("run")

    def _around(self, hook: str, *args, **kwargs):
        trl_method = getattr(super(), TRL_METHODS[hook])
        return self._chain().around(hook, self._run(), trl_method, *args, **kwargs)

    def card_features(self) -> list[str]:
        """The trl-scale features this run uses, as model card tags."""
        tags = self._chain().card_tags(self._run())
        return tags + (["ray"] if self.plan.ray_backend else [])

    def _log_trace(self, run: Run) -> None:
        """The features' hooks that ran since the last log (`HookTrace`), said on the main process."""
        hooks, aside = run.trace.taken_with_asides()
        if self.accelerator.is_main_process:
            logger.info(f"trl-scale trace since the last log: {run.trace.line(hooks, aside)}")

    # ---- TRL's hooks -----------------------------------------------------------------------------------------

    def train(self, *args, **kwargs):
        return self._around("train", *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs (not the final summary)
            run = self._run()
            self._chain().event("log", run, logs)
            if run is not None:
                self._log_trace(run)
            # trl-scale callbacks add their figures here, before the Trainer hands `logs` to report_to integrations
            # (a callback's own on_log runs after those and could not reach them).
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "trl_scale_metrics"):
                    logs.update(callback.trl_scale_metrics(trainer=self, logs=logs))
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        return self._around("save_checkpoint", model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._chain().features:
            self._chain().event("save_state", self.run, output_dir)
            save_feature_states(self._chain(), self.run, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and self._chain().features:
            self._chain().event("load_state", self.run, checkpoint)
            load_feature_states(self._chain(), self.run, checkpoint)

    def push_to_hub(self, *args, **kwargs):
        return self._around("push_to_hub", *args, **kwargs)

    def init_hf_repo(self, token: str | None = None, private: bool | None = None):
        return self._around("init_hf_repo", token=token, private=private)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None, **kwargs) -> None:
        return self._around("create_model_card", model_name, dataset_name, tags, **kwargs)


class OnlineHooks(FeatureHooks):
    """GRPO, RLOO and PPO: an online step's hooks."""

    def _generate_and_score_completions(self, inputs):
        run = self._run()
        if run is None:
            return super()._generate_and_score_completions(inputs)
        with run.steps.opened():  # the batch's data (`StepState`) lives as long as this outermost frame
            batch = self._around("generate_and_score", inputs)
        batch.pop(RECORD_KEY, None)  # the rollout's record, for the features only: TRL's batch is TRL's
        return batch

    def _generate(self, prompts):
        return self._around("generate", prompts)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self._around("rewards", inputs, prompts, completions, completion_ids_list)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        return self._around("scoring", *args, **kwargs)

    def _generate_single_turn(self, *args, **kwargs):
        return self._around("single_turn", *args, **kwargs)

    def _tool_call_loop(self, *args, **kwargs):
        return self._around("tool_call_loop", *args, **kwargs)

    def _get_tool_suffix_ids(self, tool_messages):
        return self._around("tool_suffix", tool_messages)

    def _tokenize_prompts(self, prompts):
        return self._around("tokenize_prompts", prompts)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        return self._around("batch_samples", epoch_iterator, num_batches, device)


class PreferenceHooks(FeatureHooks):
    """DPO: its reference log-probs, precomputed inside TRL's constructor."""

    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        return self._around("precompute_ref_logps", dataset, name, batch_size)
