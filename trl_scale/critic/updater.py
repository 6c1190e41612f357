"""The PPO critic's forward and update, shared by `PPOTrainer` (in-process) and the Ray critic worker, so the
two backends run the same code and give the same numbers."""

from __future__ import annotations

import torch

from .. import ppo_core
from ..scoring import ScoringSettings, token_scores, use_packing
from .base import CriticBatch, CriticSettings, CriticSharding, Finished, forward_images


def completion_values(
    critic,
    input_ids,
    attention_mask,
    prompt_len: int,
    num_tokens: int,
    scoring: ScoringSettings,
    multimodal_inputs: dict | None = None,
    sequence_parallel=None,
) -> torch.Tensor:
    """Values of each completion token's state, ``[B, num_tokens]``: the critic's output at the position before
    the token (prompts are left-padded to ``prompt_len``, completions follow), scored as ``scoring`` says.
    ``multimodal_inputs`` are the policy's image inputs for these rows (``pixel_values``, ``token_type_ids``, ...),
    passed to the backbone."""
    images = forward_images(multimodal_inputs)
    values = token_scores(
        critic.base_model, critic.score, input_ids, attention_mask, scoring, images, sequence_parallel
    )
    return values[:, prompt_len - 1 : prompt_len - 1 + num_tokens]


def load_critic(source, seed: int):
    """The critic from a path (a sequence-classification model with one output) or as given (a model object).
    Weights the checkpoint lacks (a policy's new value head) are initialised from ``seed`` on a forked RNG, so the
    local and Ray backends build the same critic and the trainer's own random stream (sampling) is untouched."""
    from trl.trainer.utils import disable_dropout_in_model

    if isinstance(source, str):
        from transformers import AutoModelForSequenceClassification

        from ..sharding.zero import whole_parameters

        # Whole, not ZeRO-3 partitions: no DeepSpeed engine manages the critic, each rank holds a replica.
        with torch.random.fork_rng(devices=[]), whole_parameters():
            torch.manual_seed(seed)
            source = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1)
    # Values for clipping come from eval mode, training from train mode: with dropout on they would differ.
    disable_dropout_in_model(source)
    return source


class CriticModule(torch.nn.Module):
    """The critic as one module whose forward is the completion tokens' values. A sharding wrapper (a DeepSpeed
    engine, FSDP2) then sees every submodule used inside one root forward, as it does for the policy."""

    def __init__(self, critic, scoring: ScoringSettings):
        super().__init__()
        self.critic, self.scoring = critic, scoring
        self.sequence_parallel = None  # the trainer's SP group when it shards sequences (see PPOTrainer)

    def forward(
        self, input_ids, attention_mask, prompt_len: int, num_tokens: int, multimodal_inputs: dict | None = None
    ) -> torch.Tensor:
        return completion_values(
            self.critic,
            input_ids,
            attention_mask,
            prompt_len,
            num_tokens,
            self.scoring,
            multimodal_inputs,
            self.sequence_parallel,
        )


class CriticUpdater:
    """A critic with its own optimizer and scheduler: values, clipped value loss, gradient accumulation, stepping.
    ``sharding`` holds it as the launcher holds the policy (see `critic.holders`): "replicated",
    "fsdp2", or "deepspeed" (its engine is built with the scheduler, once the step count is known; until then the
    critic is whole)."""

    def __init__(
        self,
        critic,
        settings: CriticSettings,
        sharding: CriticSharding = "replicated",
        deepspeed_config=None,
        fsdp_plugin=None,
    ):
        from .holders import FSDP2Critic, ReplicatedCritic

        self.critic, self.settings = critic, settings
        self.micro_steps = 0
        self.grad_norm: float | None = None
        self.sharding = sharding
        self._optimizer_settings = dict(
            lr=settings.learning_rate, betas=settings.betas, eps=settings.eps, weight_decay=settings.weight_decay
        )
        self._deepspeed_config = deepspeed_config  # (num_training_steps) -> config, for the "deepspeed" engine
        module = CriticModule(critic, settings.scoring)
        if sharding == "fsdp2":
            self.holder = FSDP2Critic(module, self._optimizer_settings, settings.max_grad_norm, fsdp_plugin)
        elif sharding in ("replicated", "deepspeed"):
            self.holder = ReplicatedCritic(module, self._optimizer_settings, settings.max_grad_norm)
        else:
            raise ValueError(f"unknown critic sharding {sharding!r}")

    @property
    def optimizer(self):
        return self.holder.optimizer

    @property
    def scheduler(self):
        return self.holder.scheduler

    def set_scheduler(self, scheduler_type: str, num_warmup_steps: int, num_training_steps: int, kwargs=None):
        args = (scheduler_type, num_warmup_steps, num_training_steps, kwargs)
        if self.sharding == "deepspeed":
            from .holders import DeepSpeedCritic

            config = self._deepspeed_config(num_training_steps)
            self.holder = DeepSpeedCritic(self.holder.module, self._optimizer_settings, config, args)
        else:
            self.holder.set_scheduler(*args)

    def _empty_padded_shard(self, input_ids) -> bool:
        """An empty shard (fewer rows than workers) on the padded path has nothing to run. The packed path still
        runs a dummy forward there, because its forwards are counted across workers."""
        return input_ids.size(0) == 0 and not use_packing(
            self.critic.base_model, self.settings.scoring.padding_free, probe_now=True
        )

    def _must_run(self) -> bool:
        """Sharded, every rank runs every forward and backward (they gather and reduce collectively)."""
        return self.sharding != "replicated"

    def _dummy_forward(self, input_ids, prompt_len: int, num_tokens: int) -> torch.Tensor:
        """An empty shard's share in a sharded critic's collectives: one all-padding-free row of zeros."""
        dummy = input_ids.new_zeros((1, input_ids.size(1)))
        return self.holder.module(dummy, torch.ones_like(dummy), prompt_len, num_tokens)

    @torch.no_grad()
    def values(
        self, input_ids, attention_mask, prompt_len: int, num_tokens: int, multimodal_inputs: dict | None = None
    ) -> torch.Tensor:
        self.holder.module.eval()
        if self._empty_padded_shard(input_ids):
            if self._must_run():
                self._dummy_forward(input_ids, prompt_len, num_tokens)
            return torch.zeros(0, num_tokens, device=input_ids.device)
        return self.holder.module(input_ids, attention_mask, prompt_len, num_tokens, multimodal_inputs)

    def step(self, batch: CriticBatch, train: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A whole micro-step on one batch: `loss_and_backward`, then in training the end of the micro-step (an
        optimizer step at the end of an accumulation window)."""
        result = self.loss_and_backward(batch, train)
        if train:
            self.end_micro_step()
        return result

    def loss_and_backward(self, batch: CriticBatch, train: bool = True) -> tuple[torch.Tensor, dict]:
        """The value loss of some rows and, in training, its backward (no optimizer step): a micro-step may take
        several calls, one per part of the batch (`CriticBatch.loss_scale` weights each)."""
        input_ids, attention_mask, prompt_len = batch.input_ids, batch.attention_mask, batch.prompt_len
        old_values, returns, mask = batch.old_values, batch.returns, batch.mask
        if self._empty_padded_shard(input_ids):
            zero = mask.new_zeros(())
            if self._must_run():
                with torch.set_grad_enabled(train):
                    self.holder.module.train(train)
                    vpred = self._dummy_forward(input_ids, prompt_len, mask.size(1))
                    if train:
                        self.holder.backward(vpred.sum() * 0.0)
            return zero, {"val/vpred": zero, "val/error": zero, "val/clipfrac": zero}
        with torch.set_grad_enabled(train):
            self.holder.module.train(train)
            vpred = self.holder.module(input_ids, attention_mask, prompt_len, mask.size(1), batch.multimodal_inputs)
            loss, clipfrac = ppo_core.clipped_value_loss(
                vpred, old_values, returns, mask, self.settings.cliprange_value
            )
            if train and loss.requires_grad:
                self.holder.backward(
                    batch.loss_scale * self.settings.vf_coef * loss / self.settings.gradient_accumulation_steps
                )
        stats = {
            "val/vpred": ppo_core.masked_mean(vpred.detach(), mask),
            "val/error": ppo_core.masked_mean((vpred.detach() - returns) ** 2, mask),
            "val/clipfrac": clipfrac.detach(),
        }
        return loss.detach(), stats

    def end_micro_step(self) -> None:
        """Count a micro-step; at the end of an accumulation window the holder reduces, clips and steps."""
        self.micro_steps += 1
        # the gradient norm (before clipping) of the optimizer step just taken, None inside a window
        self.grad_norm = self.holder.end_micro_step(
            boundary=self.micro_steps % self.settings.gradient_accumulation_steps == 0
        )

    def step_async(self, batch: CriticBatch, train: bool = True) -> Finished:
        """`step`, as a handle with `.result()`: in-process the work is done here; a remote critic overlaps it."""
        return Finished(self.step(batch, train))

    # ---- state: the same calls whether the critic is in-process (any sharding) or remote --------------------

    def weights(self) -> dict:
        """The whole critic's weights (a collective where sharded; whole on the main process)."""
        return self.holder.full_state_dict()

    def save_training_state(self, directory: str, is_main_process: bool) -> None:
        """Optimizer and scheduler into a checkpoint folder (a collective where sharded)."""
        self.holder.save(directory, is_main_process)

    def load_training_state(self, directory: str, weights: dict) -> None:
        self.holder.load_full_state_dict(weights)
        self.holder.load(directory)  # checkpoints are saved at accumulation boundaries: micro_steps stays valid

    def state(self, with_weights: bool = True) -> dict:
        """Weights (unless ``with_weights`` is False), optimizer and scheduler in one dict (a Ray critic worker's,
        sent to the main process)."""
        return {
            "model": self.weights() if with_weights else None,
            "optimizer": self.holder.optimizer_state(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "micro_steps": self.micro_steps,
        }

    def load_state(self, state: dict) -> None:
        if state.get("model") is not None:
            self.holder.load_full_state_dict(state["model"])
        if state.get("optimizer") is not None:
            self.holder.load_optimizer_state(state["optimizer"])
        if state.get("scheduler") is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.micro_steps = state.get("micro_steps", self.micro_steps)

    def shard_bytes(self) -> dict[str, int]:
        """Bytes of the critic's parameters and optimizer state held by this rank."""
        return self.holder.shard_bytes()
