"""The packed scoring engine's config fields, mixed into every trl-scale trainer config."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from ..numbers import check_field_types, check_training_arguments, check_whole
from .logprob_head import DEFAULT_LOGPROB_CHUNK_SIZE


def launched_processes() -> int:
    """The processes the launcher started (its WORLD_SIZE), readable before TrainingArguments sets up."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class ScoringArguments:
    """Config fields of the packed scoring engine, shared by GRPO, RLOO, DPO (and PPO) configs."""

    FIELDS_DOC = """
    > Packed scoring (remove-padding + chunked log-prob head)

    padding_free (`bool` or `None`, defaults to `None`):
        Score only real tokens, packed into rows with `position_ids` restarting per sequence. `None` packs where a
        one-off probe of the model finds packing exact, and otherwise runs TRL's padded path with one warning;
        `True` makes an inexact model an error; `False` runs TRL's padded path and gives TRL's numbers exactly. In
        `DPOConfig` this is TRL's own `padding_free` (a bool there, default `False`, which TRL 1.16 disables when
        `True`): TRL users' YAML keeps working, with the meanings above, and the default becomes `None`.
    token_budget (`int` or `None`, defaults to `None`):
        Most real tokens in one packed forward; larger batches are split into balanced micro-batches, the same
        number on every data-parallel rank. `None` is automatic: one packed row for flash kernels, for sdpa on CUDA
        (torch's flash varlen kernel, `trl_scale.scoring.varlen`) and for flex attention; rows no wider than the
        longest sequence, all in one forward, for sdpa elsewhere and eager.
    tree_packing (`"auto"`, `True` or `False`, defaults to `"auto"`):
        Rows of a scoring call that share a prefix (a group's prompt, a DPO pair's prompt, a conversation's earlier
        turns) folded into one prefix trie: each shared token is forwarded once, each token attends to its own
        row's path, and every row's log-probs and gradients are those of its own forward. `"auto"` does so per call
        where the estimated work drops by 10 % or more and the model's attention takes a tree exactly (probed once;
        recurrent or convolutional layers, sliding windows shorter than a row and other kernels step aside with a
        warning naming why); `True` on every packed call (a model that cannot take it is an error); `False` never.
        With it, `token_budget` counts unique tokens. Not with sequence parallelism. The logs give
        `tree_packing/share_ratio` (tokens as rows over tokens forwarded).
    logprob_chunk_size (`int`, defaults to `256`):
        Tokens projected onto the vocabulary at once by trl-scale's chunked head (non-Triton devices).
    compile_decoder_layers (`bool` or `None`, defaults to `None`):
        `torch.compile` each decoder layer of the policy and the reference (regional compilation: one compiled graph
        serves every layer), for the forwards that score; generation with a KV cache runs them uncompiled. Fuses
        the norms, rotary embeddings and activations around the matrix products: on an H200, a Qwen2-1.5B-shaped
        training step of 23k packed tokens went from 0.59 s to 0.46 s (layers planned by memory, below). Compiling
        costs 13-14 s there (the first steps, and the first new length once; none after): 101-218 steps to break
        even. `None` compiles where that pays back within the run: a model of 100M parameters or more on CUDA, 500
        optimizer steps or more planned, no PEFT adapter, no ZeRO-3 or FSDP (the log says which reason left it
        off). `True` always, `False` never.
    gradient_checkpointing_layers (`"auto"` or `"all"`, defaults to `"auto"`):
        Which decoder layers TRL's `gradient_checkpointing=True` recomputes in the backward. `"auto"`: on CUDA, each
        training forward checkpoints only as many layers as the device's free memory needs for its tokens
        (measured: what an unchecked layer keeps per token), the others keep their activations, which saves their
        recompute (on an H200 the 1.5B shape's step: 0.73 s to 0.59 s, 0.46 s compiled, none recomputed);
        elsewhere, and under ZeRO-3, FSDP or sequence parallelism, every layer. `"all"`: every layer, as TRL. The
        numbers are the same either way; the logs give `gradient_checkpointing/layers`.
    sequence_parallel_size (`int`, defaults to `1`):
        Ulysses sequence parallelism (DeepSpeed's ALST): each packed row is sharded over this many consecutive
        ranks, so one sequence's activations are spread over them. Also read from accelerate's
        `parallelism_config=ParallelismConfig(sp_size=N, sp_backend="deepspeed")`, as TRL's SFT takes it, or the
        accelerate YAML's `parallelism_config` section. GRPO, RLOO, PPO (with its critic) and DPO. The ranks of a
        group share one batch: data parallelism is `world_size / sequence_parallel_size`, and
        `per_device_train_batch_size` (and the generation batch) count per group. See the README's "Long sequences".
"""  # its section of each config's docstring (`config_docstring`)

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Score only real tokens: pack each scoring batch's sequences into rows with position_ids "
            "restarting per sequence (no attention mask, no KV cache) and project only labelled tokens through "
            "the chunked log-prob head. None (default): pack where a one-off probe finds it exact for the model, "
            "else TRL's padded path with a warning. True: the same, but an inexact model is an error. False: TRL's "
            "padded path unchanged, with identical numbers. The same in GRPO, RLOO, PPO and DPO; in DPO it is TRL's "
            "own field (a bool there, default False, whose True TRL 1.16 disables): a YAML written for TRL keeps "
            "working, True and False meaning what they mean in TRL, and unset (None) packing where exact."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Most real tokens in one packed forward (micro-batch); a batch with more is split into several, "
            "balanced, and every data-parallel rank runs the same number. A sequence longer than the budget gets a "
            "micro-batch of its own. None (automatic): one packed row per call with flash kernels, sdpa on CUDA "
            "(torch's flash varlen kernel) and flex attention; with sdpa elsewhere and eager the sequences are laid "
            "in rows no wider than the longest one (attention then costs no more than the padded batch's)."
        },
    )
    tree_packing: str = field(
        default="auto",
        metadata={
            "help": "Rows of a scoring call sharing a prefix (a group's prompt, a DPO pair's prompt, a "
            "conversation's earlier turns) forwarded once as a prefix trie, each row's numbers those of its own "
            "forward. 'auto' (default): per call, where it saves 10 % of the work or more and the model's attention "
            "takes it exactly (else packed rows, with a warning naming why); true: every packed call (an error for "
            "a model that cannot); false: never. token_budget then counts unique tokens."
        },
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ulysses sequence parallelism: ranks that share each packed row of the scoring engine (1: "
            "none). Also read from parallelism_config.sp_size (accelerate's ParallelismConfig)."
        },
    )
    logprob_chunk_size: int = field(
        default=DEFAULT_LOGPROB_CHUNK_SIZE,
        metadata={
            "help": "Tokens projected onto the vocabulary at once by trl-scale's chunked log-prob head (CPU and "
            "other non-Triton devices); peak head memory is about 2 x chunk x vocab x 4 bytes plus the weight "
            "gradient. On CUDA/XPU with Triton, TRL's own kernel runs with its own tiling."
        },
    )

    compile_decoder_layers: bool | None = field(
        default=None,
        metadata={
            "help": "torch.compile each decoder layer of the policy and the reference (regional compilation) for "
            "the scoring forwards; generation with a KV cache runs them uncompiled. Faster steps on GPUs (0.71 s -> "
            "0.53 s for a Qwen2-1.5B-shaped step on an H200) after a first step that compiles. None (default): "
            "where that pays back (CUDA, >= 100M parameters, >= 500 steps planned, no PEFT, no ZeRO-3/FSDP); "
            "True: always; False: never."
        },
    )
    gradient_checkpointing_layers: Literal["auto", "all"] = field(
        default="auto",
        metadata={
            "help": "Which decoder layers gradient_checkpointing recomputes. 'auto' (default): on CUDA, only as "
            "many as each training forward needs to fit the device's memory (the rest keep their activations and "
            "skip the recompute); every layer elsewhere and under ZeRO-3, FSDP or sequence parallelism. 'all': "
            "every layer, as TRL."
        },
    )

    def __post_init__(self):
        check_training_arguments(self)  # before transformers' own, which replaces some values silently
        self._take_sequence_parallel_size()  # before TRL's own checks, which refuse it
        sized = self.sequence_parallel_size > 1 and hasattr(self, "generation_batch_size")
        if sized:
            self._steps_per_generation_over_groups()  # before TRL sizes the batch over every process
        super().__post_init__()
        self._validate_scoring_arguments()
        check_field_types(self, ScoringArguments)
        if sized:
            self._generation_batch_over_groups(self._sequence_parallel_groups(self.world_size))

    def _sequence_parallel_groups(self, world_size: int) -> int:
        groups, rem = divmod(world_size, self.sequence_parallel_size)
        if rem or not groups:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} does not divide the {world_size} processes: "
                f"each sequence-parallel group takes that many. Fix: launch a multiple of "
                f"{self.sequence_parallel_size} processes, or a sequence_parallel_size dividing {world_size}"
            )
        return groups

    def _steps_per_generation_over_groups(self) -> None:
        """Under sequence parallelism the data-parallel ranks are the SP groups (`world_size /
        sequence_parallel_size`), each one "device" of `per_device_train_batch_size` rows. TRL sizes the
        generation batch over `world_size` processes: a `generation_batch_size` asked for is turned into the
        `steps_per_generation` it means over the groups, which TRL then takes. (Before TRL's setup: the launcher's
        WORLD_SIZE, which that setup reads too.)"""
        if self.generation_batch_size is None or self.steps_per_generation is not None:
            return
        groups = self._sequence_parallel_groups(launched_processes())
        global_batch = self.per_device_train_batch_size * groups
        if self.generation_batch_size % global_batch:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch "
                f"size ({global_batch}: per_device_train_batch_size x {groups} sequence-parallel groups)"
            )
        self.steps_per_generation = self.generation_batch_size // global_batch
        self.generation_batch_size = None

    def _generation_batch_over_groups(self, groups: int) -> None:
        """TRL's generation batch, sized again over the groups, and TRL's divisibility checks on it."""
        self.generation_batch_size = self.per_device_train_batch_size * groups * self.steps_per_generation
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}: per_device_train_batch_size x {groups} "
                f"sequence-parallel groups x steps_per_generation) must be divisible by num_generations "
                f"({self.num_generations})"
            )
        num_generations = getattr(self, "num_generations_eval", None) or self.num_generations
        evaluates = self.do_eval and self.eval_strategy != "no"
        if evaluates and (self.per_device_eval_batch_size * groups) % num_generations:
            raise ValueError(
                f"The global eval batch size ({self.per_device_eval_batch_size} x {groups} sequence-parallel groups) "
                f"must be divisible by the number of generations used for evaluation ({num_generations})"
            )

    def _validate_scoring_arguments(self) -> None:
        if self.gradient_checkpointing_layers not in ("auto", "all"):
            raise ValueError(
                f"gradient_checkpointing_layers={self.gradient_checkpointing_layers!r}: use 'auto' (only the layers "
                "memory needs) or 'all' (every layer, as TRL); gradient_checkpointing=False checkpoints none"
            )
        check_whole(
            "token_budget",
            self.token_budget,
            minimum=1,
            optional=True,
            fix="use a positive number of tokens, or None for no limit",
        )
        check_whole(
            "logprob_chunk_size", self.logprob_chunk_size, minimum=1, fix="use a positive number of tokens (e.g. 256)"
        )
        check_whole(
            "sequence_parallel_size",
            self.sequence_parallel_size,
            minimum=1,
            fix="use the number of ranks that share each sequence (1: no sequence parallelism)",
        )
        self.tree_packing = _tree_packing_choice(self.tree_packing)
        if self.tree_packing is True and self.padding_free is False:
            raise ValueError(
                "tree_packing=True, but padding_free=False asks for TRL's padded path, which folds nothing: the "
                "setting would not be read. Fix: padding_free=None (or True) to fold prefixes, or tree_packing='auto'"
            )
        if self.sequence_parallel_size > 1 and self.tree_packing is True:
            raise ValueError(
                f"tree_packing=True and sequence_parallel_size={self.sequence_parallel_size}: tree rows are not "
                "sharded over a sequence-parallel group. Fix: tree_packing='auto' (packed rows under sequence "
                "parallelism) or sequence_parallel_size=1"
            )
        if self.sequence_parallel_size > 1 and self.padding_free is False:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} shards the packed rows of the scoring engine, "
                "but padding_free=False asks for TRL's padded path. Fix: padding_free=None (or True)"
            )

    def _take_sequence_parallel_size(self) -> None:
        """`parallelism_config.sp_size` (accelerate's, as TRL's SFT takes it) becomes `sequence_parallel_size`, and
        leaves the config before TRL reads it: TRL refuses it for GRPO and RLOO, and accelerate would run its own
        ALST (a data loader that slices rows into sequence shards, which are prompts here) under DeepSpeed."""
        parallelism = getattr(self, "parallelism_config", None)
        sp_size = (getattr(parallelism, "sp_size", 1) or 1) if parallelism is not None else 1
        if parallelism is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
            # the accelerate YAML's `parallelism_config` section (`accelerate launch` exports it): read it here,
            # and switch accelerate's own off, which would otherwise build it from the same variables
            from accelerate.utils import ParallelismConfig

            parallelism = ParallelismConfig()  # accelerate's own reading of those variables
            sp_size = parallelism.sp_size or 1
            if sp_size > 1:
                os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
        if sp_size <= 1:
            return
        if self.sequence_parallel_size not in (1, sp_size):
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} and parallelism_config.sp_size={sp_size} "
                "disagree. Fix: set one of them"
            )
        others = {
            name: getattr(parallelism, name, 1)
            for name in ("tp_size", "cp_size", "dp_replicate_size")
            if (getattr(parallelism, name, 1) or 1) > 1
        }
        if others:
            raise ValueError(
                f"parallelism_config sets {others} besides sp_size: trl-scale takes sp_size only (data parallelism "
                "comes from the launcher). Fix: drop them"
            )
        self.sequence_parallel_size = sp_size
        self.parallelism_config = None


def _tree_packing_choice(value) -> bool | str:
    """`tree_packing` as the engine reads it: "auto", True or False (the command line gives text)."""
    if isinstance(value, bool):
        return value
    choices = {"true": True, "false": False, "auto": "auto"}
    if isinstance(value, str) and value.lower() in choices:
        return choices[value.lower()]
    raise ValueError(f"tree_packing={value!r}: use 'auto' (where it pays and is exact), True or False")
