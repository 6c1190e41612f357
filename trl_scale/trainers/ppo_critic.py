"""PPOTrainer's critic: where it comes from (`value_model`, the first reward model, or the policy's backbone with a
new head), the checks it must pass, and the one factory that builds it, in the trainer processes (`CriticUpdater`:
replicated, or sharded as the launcher shards the policy) or on its Ray role group (`RayCritic`). Both implement
`trl_scale.critic.Critic`."""

from __future__ import annotations

import copy
import inspect
from functools import partial

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from ..critic import Critic, CriticUpdater, load_critic
from ..scoring import ScoringSettings
from ..sharding.critic_sharding import critic_sharding, deepspeed_critic_config
from ..sharding.zero import gathered, whole_parameters


def build_critic(trainer, value_model, model, reward_list: list, images: list[str]) -> Critic:
    """The critic for this run; sets `trainer.value_model` (the local critic's model, None on Ray) and
    `trainer._critic_config` (the config saved beside its weights)."""
    args = trainer.args
    scoring = ScoringSettings.from_config(args)  # the critic scores its rows as the policy does
    updater_settings = dict(
        learning_rate=args.value_learning_rate or args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        padding_free=scoring.padding_free,
        token_budget=scoring.token_budget,
        cliprange_value=args.cliprange_value,
        vf_coef=args.vf_coef,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
    )
    if args.backend == "ray":
        # The critic lives on its own role group, started by the main process: no trainer process holds it.
        from ..distributed.roles import start_critic

        def check(path: str) -> None:
            check_value_model_tokenizer(trainer, path)
            trainer._critic_config = AutoConfig.from_pretrained(path, num_labels=1)

        trainer.value_model = None
        trainer._critic_config = None  # known on the main process, the only one that saves it
        source = partial(value_model_source, trainer, value_model, model, reward_list)  # built on the main process
        return start_critic(source, updater_settings, args, check)
    else:
        trainer.value_model = load_critic(value_model_source(trainer, value_model, model, reward_list), args.seed)
        check_value_model_tokenizer(trainer, value_model)
        if images:
            if value_model is not None:
                origin = "value_model"
            elif first_reward_model(reward_list) is not None:
                origin = "the critic (from the first reward model in reward_funcs, as value_model=None)"
            else:
                origin = "the critic (from the policy, as value_model=None)"
            check_critic_takes_images(trainer.value_model, images, origin)
        trainer.value_model.to(trainer.accelerator.device)
        trainer._critic_config = trainer.value_model.config
        # Held as the launcher holds the policy: replicated (DDP), its own DeepSpeed engine, or FSDP2.
        sharding = critic_sharding(trainer.accelerator)
        return CriticUpdater(
            trainer.value_model,
            **updater_settings,
            sharding=sharding,
            deepspeed_config=partial(deepspeed_critic_config, trainer.accelerator, args, trainer.value_model),
            fsdp_plugin=trainer.accelerator.state.fsdp_plugin if sharding == "fsdp2" else None,
        )


def value_model_source(trainer, value_model, policy, reward_list):
    """Where the critic comes from: `value_model`, else the first reward model (the classic RLHF recipe),
    else the policy (its backbone with a new scalar head). A path or a model object."""
    if value_model is not None:
        return value_model
    reward = first_reward_model(reward_list)
    if isinstance(reward, str):
        return reward
    if reward is not None:  # a copy: the critic trains, the reward model must not
        return copy.deepcopy(trainer.accelerator.unwrap_model(reward))
    if isinstance(policy, str):
        return policy
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    # As `load_critic`: a seeded head, the trainer's RNG untouched, whole parameters (under ZeRO-3 the policy's
    # are partitions: read them gathered).
    with torch.random.fork_rng(devices=[]), whole_parameters():
        torch.manual_seed(trainer.args.seed)
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


def check_value_model_tokenizer(trainer, value_model) -> None:
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # a VLM's processor holds one
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
    critic = getattr(trainer, "value_model", None)
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
