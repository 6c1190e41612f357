"""Packed scoring as a trainer feature: the engine installed on the policy's and the reference's forwards TRL
patched, sequence parallelism around it, and its figures in the logs."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import NamedTuple

from ..distributed.roles import RayReference
from ..scoring import PackingStats, ScoringSettings, install_packed_scoring, packing_support
from .feature import Feature, Patch, sequence_parallel
from .plan import ScoringPlan


class PackingRequest(NamedTuple):
    """What a trainer family scores: the softmax temperature, the outputs the policy's forward returns besides
    log-probs, and `padding_free` (None: trl-scale's default)."""

    temperature: float
    policy_outputs: tuple[str, ...]
    padding_free: bool | None


class PackedScoring(Feature):
    """The packed scoring engine on the policy's and a local reference's forwards (TRL's forwards where packing is
    off or not exact for the model); Ulysses sequence parallelism
    (`sequence_parallel_size` > 1) on the same forwards; `padding_free/*` figures in the logs."""

    name = "packed_scoring"
    STEPS_ASIDE = {"single_turn": "without sequence parallelism, or where vLLM generates (only scoring is sharded)"}
    PATCHES = (
        Patch(
            "model.forward",
            "setup, where packing is exact for the model family",
            "never (the run's model)",
            "scoring/engine.py",
        ),
        Patch(
            "accelerator.__class__",
            "setup, with sequence_parallel_size > 1 (a data-parallel view of the groups)",
            "never",
            "sharding/data_parallel.py",
            sequence_parallel,
        ),
        Patch(
            "gather, gather_object in TRL's trainer module",
            "each generation batch's build, with sequence_parallel_size > 1",
            "when the build returns",
            "sharding/data_parallel.py",
            sequence_parallel,
        ),
        Patch(
            "the policy's attention implementation (model.set_attn_implementation)",
            "each turn of local generation, with sequence_parallel_size > 1: the model's own attention (the "
            "sharded one expects every rank of the group with a slice of one row)",
            "when the turn returns",
            "trainers/packing.py",
            sequence_parallel,
        ),
        Patch(
            "each rank's random state (torch, CUDA, Python, NumPy)",
            "setup, with sequence_parallel_size > 1: every rank of a group takes its leader's (they run the same "
            "steps on one batch)",
            "never",
            "sharding/data_parallel.py",
            sequence_parallel,
        ),
    )

    def __init__(self, sequence_parallel_size: int = 1, scoring: ScoringPlan | None = None):
        self.sequence_parallel_size = sequence_parallel_size
        self.scoring = scoring or ScoringPlan()  # the plan's (the family's head cast, the sampler's support)
        self.stats: PackingStats | None = None  # while packing is installed and on
        self.packed_backbone = None  # (the policy's backbone, padding_free) where the engine is installed
        self.installed = False
        self.sequence_parallel = None  # the SP group, once enabled
        self.plain_attention: str | None = None  # what local generation runs with under SP

    @classmethod
    def build(cls, plan) -> PackedScoring:
        return cls(plan.scoring.sequence_parallel_size, plan.scoring)

    def request(self, trl) -> PackingRequest:
        """What this trainer family scores (an online trainer's; DPO's is its own), asked when the engine is
        installed, after TRL built the models."""
        return PackingRequest(trl.temperature, ("entropy",), trl.args.padding_free)

    def setup(self, run) -> None:
        self.install(run.trl)

    def install(self, trl) -> None:
        """Pack once (TRL's forwards where `padding_free=False`). The layers are compiled after this, by
        `DecoderLayers` (packing's probe would otherwise compile its own small shapes)."""
        request = self.request(trl)
        if not (self.installed or request.padding_free is False):
            self._install_engine(trl, request)

    def _install_engine(self, trl, request: PackingRequest) -> None:
        self.installed = True
        from peft import PeftModel

        stats = PackingStats()
        # One settings object for the policy and its reference. (DPO keeps its own padding_free apart from TRL's
        # flag: the request's value stands.)
        scoring = self.scoring
        settings = ScoringSettings.from_config(
            trl.args, request.temperature, scoring.sampler_support, scoring.cast_lm_head_to_fp32
        )
        settings = dataclasses.replace(settings, padding_free=request.padding_free)
        policy = trl.accelerator.unwrap_model(trl.model)
        if isinstance(policy, PeftModel):
            policy = policy.get_base_model()
        reference = trl.ref_model
        group = self._sequence_parallel_group(trl, policy, reference)
        outputs = request.policy_outputs
        packed = install_packed_scoring(policy, settings, outputs=outputs, stats=stats, sequence_parallel=group)
        if reference is not None and not isinstance(reference, RayReference):
            unwrapped = trl.accelerator.unwrap_model(reference)
            install_packed_scoring(unwrapped, settings, stats=stats, sequence_parallel=group)
        self.stats = stats if packed is not None else None
        # read by the card: whether rows pack (a vision-language model keeps the engine for its image calls alone
        # where its text packing is not exact), known once the first scoring call probed the model
        self.packed_backbone = (policy.base_model, settings.padding_free) if packed is not None else None

    def _sequence_parallel_group(self, trl, policy, reference):
        """Ulysses attention on the policy and the reference (`sequence_parallel_size` > 1), after the refusals;
        None without sequence parallelism."""
        sp_size = self.sequence_parallel_size
        if sp_size <= 1:
            return None
        from ..scoring.sequence_parallel import enable_sequence_parallel
        from ..sharding.data_parallel import draw_like_group_leader, share_batches_within_groups

        self.plain_attention = policy.config._attn_implementation
        group = self.sequence_parallel = enable_sequence_parallel(policy, sp_size)
        if reference is not None:
            enable_sequence_parallel(trl.accelerator.unwrap_model(reference), sp_size)
        # the group is one data-parallel rank: TRL sees world / sp processes (data, slices, gathers)
        share_batches_within_groups(trl.accelerator, sp_size)
        draw_like_group_leader(group.group, group.rank)
        generation = trl.vllm_generation
        if hasattr(generation, "share_with"):
            generation.share_with(group.group, group.rank)
        return group

    def generate_and_score(self, run, proceed, inputs):
        """TRL's module-level `gather` / `gather_object` (rewards, logs) with one copy per sequence-parallel group
        while TRL builds a batch (nothing changes without sequence parallelism)."""
        with self._data_parallel_gathers(run.trl):
            return proceed(inputs)

    @contextmanager
    def _data_parallel_gathers(self, trl):
        from ..sharding.data_parallel import data_parallel_gathers

        with data_parallel_gathers(trl.accelerator, trl.trl_module):
            yield

    def single_turn(self, run, proceed, *args, **kwargs):
        """Local generation under sequence parallelism: with the model's own attention (only scoring is sharded).
        Every rank of the group generates (ZeRO-3 gathers parameters collectively), and all take rank 0's
        completions: they train on one batch."""
        if self.plain_attention is None or run.trl.use_vllm:
            run.trace.stepped_aside(self.name, "single_turn")
            return proceed(*args, **kwargs)
        from ..ranks import decide_on_leader

        model = run.trl.accelerator.unwrap_model(run.trl.model)
        sharded = model.config._attn_implementation
        model.set_attn_implementation(self.plain_attention)
        try:
            generated = proceed(*args, **kwargs)
        finally:
            model.set_attn_implementation(sharded)
        return decide_on_leader(lambda: generated, self.sequence_parallel.group)

    def precompute_ref_logps(self, run, proceed, dataset, name: str, batch_size: int):
        # DPO precomputes the reference log-probs inside TRL's constructor: packed as the policy will be.
        self.install(run.trl)
        return proceed(dataset, name, batch_size)

    def log(self, run, logs: dict[str, float]) -> None:
        if self.stats is not None:
            logs.update(self.stats.pop())

    def card_tags(self, run) -> list[str]:
        if self.packed_backbone is None:
            return []
        backbone, padding_free = self.packed_backbone
        # what the first scoring call's probe found, never a probe now (a forward here would run under sequence
        # parallelism's attention, whose calls all pack, or gather ZeRO-3 shards on one rank); undecided: it packs
        packs = padding_free is not False and packing_support(backbone, probe=False).exact is not False
        return ["padding-free"] if packs else []
