"""What PPOTrainer asks of its critic, wherever it lives, and the settings every critic is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from ..scoring import ScoringSettings

CriticSharding = Literal["replicated", "fsdp2", "deepspeed"]


@dataclass(frozen=True)
class CriticSettings:
    """How the critic is updated: its AdamW, value-loss clipping and weight, accumulation and clipping of its
    gradients, and how it scores its rows (as the policy does). Built from a `PPOConfig` by `from_config`; the same
    object reaches a Ray critic worker."""

    learning_rate: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    scoring: ScoringSettings = ScoringSettings()  # how it scores its rows: as the policy does (packing, tree rows)
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = 1.0

    @classmethod
    def from_config(cls, args) -> CriticSettings:
        return cls(
            learning_rate=args.value_learning_rate or args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            scoring=ScoringSettings.from_config(args),  # the critic scores its rows as the policy does
            cliprange_value=args.cliprange_value,
            vf_coef=args.vf_coef,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            max_grad_norm=args.max_grad_norm,
        )


# Image inputs that only say how the others split by rows (TRL's names): a critic's forward takes the rest; a critic
# on a Ray group reads them to give each worker its rows' images.
ROW_SLICING_FIELDS = ("num_images", "num_tiles")


def forward_images(multimodal_inputs: dict | None) -> dict | None:
    """What a critic's backbone takes of a call's image inputs (the row-slicing fields left out)."""
    if not multimodal_inputs:
        return None
    return {key: value for key, value in multimodal_inputs.items() if key not in ROW_SLICING_FIELDS} or None


@dataclass(frozen=True)
class CriticBatch:
    """What one value-loss micro-step (or a part of one) reads: padded rows (``[B, P + T]``: prompt, then completion),
    the prompt's width, the old values, returns and completion mask (``[B, T]``), image inputs for a vision-language
    critic, and ``loss_scale``, this part's weight in the micro-step (its share of the tokens, times the data-parallel
    world size that averages the gradients)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    old_values: torch.Tensor
    returns: torch.Tensor
    mask: torch.Tensor
    multimodal_inputs: dict | None = None
    loss_scale: float = 1.0


class Critic(Protocol):
    """What PPOTrainer asks of its critic, wherever it lives: in the trainer processes (`CriticUpdater`, replicated
    or sharded) or on a Ray role group (`RayCritic`). Built by `build_critic`; `tests/test_ppo.py` checks both
    implement every member with the same parameters."""

    scheduler: object | None  # None until `set_scheduler` (the step count is known)
    grad_norm: float | None  # of the optimizer step the last micro-step ended; None inside a window or not measured

    def set_scheduler(
        self, scheduler_type: str, num_warmup_steps: int, num_training_steps: int, kwargs=None
    ) -> None: ...

    def values(
        self, input_ids, attention_mask, prompt_len: int, num_tokens: int, multimodal_inputs: dict | None = None
    ) -> torch.Tensor:
        """Each completion token's value, ``[B, num_tokens]`` (a collective: every rank calls it)."""

    def step_async(self, batch: CriticBatch, train: bool = True) -> PendingCriticStep:
        """Start one micro-step's value loss (and, in training, its update); `.result()` is `(loss, stats)`."""

    def weights(self) -> dict | None:
        """The whole critic's weights (on the main process; a collective where sharded)."""

    def state(self, with_weights: bool = True) -> dict | None: ...

    def load_state(self, state: dict) -> None: ...

    def save_training_state(self, directory: str, is_main_process: bool) -> None: ...

    def load_training_state(self, directory: str, weights: dict) -> None: ...

    def shard_bytes(self) -> dict[str, int]:
        """What this trainer process holds of the critic: {"parameters": bytes, "optimizer": bytes}."""


class PendingCriticStep(Protocol):
    """A critic micro-step started by `step_async`: `.result()` waits for it and gives `(loss, stats)`."""

    def result(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class Finished:
    """An already-computed result with the `.result()` of a future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value
