"""`OnlineTrainerMixin`: trl-scale's online trainers (GRPO, RLOO, and PPO through GRPO): their constructor around
TRL's, and their features, in order."""

from __future__ import annotations

import warnings
from contextlib import nullcontext

from .adapter import OnlineHooks
from .checkpoints import RolloutResume, SafeCheckpoint
from .construction import (
    check_model_arguments,
    check_output_dir,
    check_tool_prompts,
    check_train_dataset,
    overridden,
    remote_reward_funcs,
    trl_arguments,
    trl_base_class,
)
from .correction import RatioMetrics
from .decoder_layers import DecoderLayers
from .dynamic_sampling import DynamicSampling
from .evaluation import Evaluation
from .hub import ModelCard
from .mismatch_gate import MismatchGate
from .packing import PackedScoring
from .remote_reference import RemoteReference
from .reward_checks import check_added_reward_funcs, check_environment_resets, checked_reward_funcs
from .rollout_checks import checked_rollout_func
from .router_logits import RouterLogitsInGeneration
from .routing_replay import RoutingReplay
from .server_rollout import ServerRollout, close_servers
from .shared_prefill import SharedPrefill
from .step_checks import ContextLength, EmptyRewardsWarning
from .stream_rewards import StreamRewards
from .timing import PhaseTiming
from .tool_images import TextPolicyToolAnswers, ToolImages

# TRL 1.16 reads `model.is_gradient_checkpointing`, which transformers 5.17 deprecates: a FutureWarning on every run
# that no user setting causes or silences (stock TRL prints it too).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

# An online trainer's features, outermost first (each hook runs them in this order, then TRL's method; `check` and
# `setup` run in it too). Where the order matters, tests/test_features.py pins it:
ONLINE_FEATURES = (
    RatioMetrics,  # reads the finished batch: outside whatever builds it
    ContextLength,  # checks the prompts TRL tokenizes (those of a streamed or topped-up batch too)
    EmptyRewardsWarning,  # on the rewards TRL's step gets (dynamic sampling's chosen rows')
    ToolImages,  # outside packing: the scoring calls it sees take only what the model takes
    TextPolicyToolAnswers,
    Evaluation,  # pass@k from an evaluation batch's rewards (gathered)
    SafeCheckpoint,
    RolloutResume,
    ModelCard,
    MismatchGate,  # outside the rollout: the first batch's sync and the probe before it is generated or taken
    ServerRollout,  # streaming swaps the batch's rows first; set up before packing (sequence parallelism shares it)
    RoutingReplay,  # inside the rollout: each generated batch's routes, before TRL scores it
    PackedScoring,  # its sequence-parallel gathers cover dynamic sampling's rounds, which call TRL's reward gathers
    DecoderLayers,  # compiled after packing's probe; checkpointed layers planned by memory
    SharedPrefill,  # inside packing's generation under sequence parallelism (the model's own attention)
    RouterLogitsInGeneration,  # inside shared prefill: every generate call of a turn asks for no router logits
    DynamicSampling,  # rounds of generation and rewards under it; TRL's step answered from the chosen rows
    PhaseTiming,  # inside dynamic sampling: times the rounds' real work, not the answers served from them
    StreamRewards,  # under dynamic sampling: its rounds read the rewards computed in the stream too
    RemoteReference,  # TRL's reference scoring calls answered by the Ray group (timed as scoring)
)


def colocated(trainer, config):
    """TRL's colocate mode (vLLM in the trainer): TRL's constructor builds trl-scale's `ColocatedVLLMGeneration`."""
    if config is None or not (config.use_vllm and config.vllm_mode == "colocate"):
        return nullcontext()
    from ..rollout.colocate import colocated_generation

    return colocated_generation(trl_base_class(trainer).__module__, config.vllm_llm_kwargs)


def check_lora_sync(arguments: dict) -> None:
    from accelerate.utils import is_peft_model

    model = arguments["model"]
    if arguments.get("peft_config") is None and not (not isinstance(model, str) and is_peft_model(model)):
        raise ValueError(
            "weight_sync='lora' sends only a LoRA adapter to the servers, but this policy has none. Fix: pass "
            "peft_config=LoraConfig(...) (or a PeftModel), or use weight_sync='nccl' / 'shared_dir' (full weights)"
        )


class OnlineTrainerMixin(OnlineHooks):
    """trl-scale's online trainers: TRL's constructor, with bad input refused first and TRL's own vLLM and reference
    kept off where a feature stands in for them; then `ONLINE_FEATURES` on TRL's hooks."""

    FEATURES = ONLINE_FEATURES

    def __init__(self, *args, **kwargs):
        arguments = trl_arguments(self, args, kwargs)
        config = arguments.get("args")
        check_output_dir(config)
        check_model_arguments(arguments)
        # TRL reads `prompt` unless an environment owns the data (its `reset()` then supplies the prompt).
        prompt_column = () if arguments.get("environment_factory") is not None else ("prompt",)
        check_train_dataset(arguments.get("train_dataset"), prompt_column, type(self).__name__)
        check_tool_prompts(arguments)
        plan = self._start_features(arguments)
        server, remote_reference = plan.rollout.server, plan.remote_reference
        if server and config.weight_sync == "lora":
            check_lora_sync(arguments)
        reward_funcs = arguments.get("reward_funcs")
        if plan.ray_backend:
            reward_funcs = remote_reward_funcs(reward_funcs, config)
        arguments["reward_funcs"] = checked_reward_funcs(reward_funcs)
        # With server rollout, TRL's vLLM path stays off while it builds: no vLLM import, no CUDA-only communicator.
        # With a remote reference, TRL builds none (beta=0 while it builds) and the reference group stands in.
        with (
            overridden(config if server else None, use_vllm=False),
            overridden(config if remote_reference else None, beta=0.0),
            colocated(self, config),
        ):
            super().__init__(**arguments)
        check_added_reward_funcs(self.run.trl)
        check_environment_resets(self.run.trl)
        if self.run.trl.rollout_func is not None:
            self.run.trl.set_rollout_func(checked_rollout_func(self.run.trl.rollout_func))
        self._set_up_features()

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Wall time per phase since the last log (`PhaseTiming`), read by `StepTimeCallback`."""
        timing = self.features.get(PhaseTiming)
        return timing.seconds if timing is not None else {}

    def close_rollout_servers(self) -> None:
        """Stop the managed vLLM servers now (they stop by themselves when this process exits, however it does)."""
        close_servers(self.run.trl)

    def close_rollout(self) -> None:
        """Done generating: the managed servers stop and the rollout client's threads end (the CLI calls it before
        its processes leave)."""
        close_servers(self.run.trl)
        generation = self.run.trl.vllm_generation
        if hasattr(generation, "close"):
            generation.close()
