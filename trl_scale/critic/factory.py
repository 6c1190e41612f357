"""PPOTrainer's critic: where it comes from (`value_model`, the first reward model, or the policy's backbone with a
new head), the checks it must pass, and the one factory that builds it, in the trainer processes (`CriticUpdater`:
replicated, or sharded as the launcher shards the policy) or on its Ray role group (`RayCritic`). Both implement
`Critic`."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from functools import partial

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from ..sharding.zero import gathered, whole_parameters
from .base import Critic, CriticSettings
from .holders import critic_sharding, deepspeed_critic_config
from .updater import CriticUpdater, load_critic


@dataclass
class BuiltCritic:
    """What `build_critic` gives the trainer: the critic, the local critic's model (None on Ray: no trainer process
    holds it) and the config saved beside its weights (None on a process that never saves it)."""

    critic: Critic
    model: PreTrainedModel | None
    config: object | None


def build_critic(
    args, accelerator, processing_class, policy, value_model, model, reward_list: list, images: list[str]
) -> BuiltCritic:
    """The critic for a PPO run with ``args``: from ``value_model``, else the first reward model of ``reward_list``,
    else ``policy`` (the prepared policy; ``model`` is what the user passed, a path or an object)."""
    settings = CriticSettings.from_config(args)
    source = partial(value_model_source, accelerator, policy, args.seed, value_model, model, reward_list)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a VLM's processor holds one
    if args.backend == "ray":
        # The critic lives on its own role group, started by the main process: no trainer process holds it.
        from .ray import start_critic

        config = []  # known on the main process, the only one that saves it

        def check(path: str) -> None:
            check_value_model_tokenizer(tokenizer, path, None)
            config.append(AutoConfig.from_pretrained(path, num_labels=1))

        critic = start_critic(source, settings, args, check)  # built on the main process
        return BuiltCritic(critic, None, config[0] if config else None)
    critic_model = load_critic(source(), args.seed)
    check_value_model_tokenizer(tokenizer, value_model, critic_model)
    if images:
        if value_model is not None:
            origin = "value_model"
        elif first_reward_model(reward_list) is not None:
            origin = "the critic (from the first reward model in reward_funcs, as value_model=None)"
        else:
            origin = "the critic (from the policy, as value_model=None)"
        check_critic_takes_images(critic_model, images, origin)
    critic_model.to(accelerator.device)
    # Held as the launcher holds the policy: replicated (DDP), its own DeepSpeed engine, or FSDP2.
    sharding = critic_sharding(accelerator)
    critic = CriticUpdater(
        critic_model,
        settings,
        sharding=sharding,
        deepspeed_config=partial(deepspeed_critic_config, accelerator, args, critic_model),
        fsdp_plugin=accelerator.state.fsdp_plugin if sharding == "fsdp2" else None,
    )
    return BuiltCritic(critic, critic_model, critic_model.config)


def value_model_source(accelerator, policy, seed: int, value_model, model, reward_list):
    """Where the critic comes from: `value_model`, else the first reward model (the classic RLHF recipe),
    else the policy (its backbone with a new scalar head). A path or a model object."""
    if value_model is not None:
        return value_model
    reward = first_reward_model(reward_list)
    if isinstance(reward, str):
        return reward
    if reward is not None:  # a copy: the critic trains, the reward model must not
        return copy.deepcopy(accelerator.unwrap_model(reward))
    if isinstance(model, str):
        return model
    unwrapped = accelerator.unwrap_model(policy)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    # As `load_critic`: a seeded head, the trainer's RNG untouched, whole parameters (under ZeRO-3 the policy's
    # are partitions: read them gathered).
    with torch.random.fork_rng(devices=[]), whole_parameters():
        torch.manual_seed(seed)
        try:
            critic = AutoModelForSequenceClassification.from_config(config)
        except ValueError as error:
            raise ValueError(
                f"PPOTrainer cannot build a critic from this policy: transformers has no sequence-classification "
                f"class for model type {config.model_type!r} ({error}). Fix: pass value_model= (a "
                "sequence-classification model with one label that shares the policy's tokenizer)"
            ) from error
    with gathered(base):
        critic.base_model.load_state_dict({k: v.clone() for k, v in base.base_model.state_dict().items()})
    return critic


def check_value_model_tokenizer(tokenizer, value_model, critic) -> None:
    """The critic reads the policy's token ids: ``value_model`` (a path) must share the policy's vocabulary, and
    ``critic`` (the loaded model, when local) embed every token with one output."""
    policy_vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    if isinstance(value_model, str) and policy_vocab is not None:
        try:
            critic_vocab = AutoTokenizer.from_pretrained(value_model).get_vocab()
        except (OSError, ValueError):
            critic_vocab = None
        if critic_vocab is not None and critic_vocab != policy_vocab:
            raise ValueError(
                f"value_model {value_model!r} has a different tokenizer from the policy's: the critic reads the "
                "policy's token ids, so it must share its vocabulary. Fix: pass a value model trained with the "
                "policy's tokenizer, or leave value_model=None to initialise it from the policy."
            )
    if critic is None:
        return
    if critic.get_input_embeddings().num_embeddings < len(tokenizer):
        raise ValueError(
            f"value_model's embedding has {critic.get_input_embeddings().num_embeddings} rows but the policy's "
            f"tokenizer has {len(tokenizer)} tokens: the critic must share the policy's tokenizer."
        )
    if getattr(critic.config, "num_labels", 1) != 1:
        raise ValueError(f"value_model must have one output (num_labels=1), not {critic.config.num_labels}")


def first_reward_model(reward_list: list):
    """The first reward model of `reward_funcs` (a path or a model object), the default critic's source; None if
    every reward is a function."""
    return next((reward for reward in reward_list if isinstance(reward, (str, PreTrainedModel))), None)


def check_critic_takes_images(critic, images: list[str], origin: str) -> None:
    """A text-only critic would value an image prompt without its image: refuse it at construction. ``origin``
    says where the critic came from, for the message."""
    forward = critic.base_model.forward
    if "pixel_values" in inspect.signature(forward).parameters:
        return
    raise ValueError(
        f"the dataset has image columns {images}, but {origin} is a {type(critic).__name__}, whose backbone takes no "
        "pixel_values: it would value each completion without its image. Fix: pass value_model= a "
        "sequence-classification model of a vision-language architecture (e.g. Gemma3ForSequenceClassification), "
        "or leave value_model=None with no reward model in reward_funcs to build the critic from the policy"
    )
