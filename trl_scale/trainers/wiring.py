"""The trainer-side wiring of trl-scale's features into TRL's hooks: server rollout, packed scoring, phase timing."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager

from ..distributed.roles import RayReference
from ..logs import get_logger
from ..ranks import broadcast_from_main, run_on_main
from ..rollout.weight_dir import WeightDirectory
from ..scoring import PackingStats, ScoringSettings, install_packed_scoring
from .construction import trl_base_class
from .streamed_tools import conversing, streamed_conversations

logger = get_logger(__name__)


def claimed_weight_dir(args, run_id: str) -> WeightDirectory | None:
    """The directory this run's shared_dir / lora syncs write to ("auto" may pick shared_dir), claimed now."""
    if args.weight_sync not in ("shared_dir", "lora", "auto"):
        return None
    prefix = "trl-scale-lora-" if args.weight_sync == "lora" else "trl-scale-weights-"
    weight_dir = WeightDirectory(args.weight_sync_dir, run_id, args.output_dir, temporary_prefix=prefix)
    weight_dir.claim()
    return weight_dir


class ServerRolloutMixin:
    """Plugs the multi-server client in as TRL's `vllm_generation` (the trainer was built with TRL's vLLM off)."""

    def _install_server_rollout(self, logprobs: bool) -> None:
        from ..rollout import RolloutClient, ServerRolloutGeneration
        from ..rollout.settings import RolloutSettings
        from ..rollout.urls import check_server_urls

        args = self.args
        self.rollout_fleet = None
        run_id = broadcast_from_main(uuid.uuid4().hex[:8])  # one id on every rank: it names the weight versions
        # Claimed before any server starts: a directory another run uses, or one not writable, fails here.
        weight_dir = run_on_main(lambda: claimed_weight_dir(args, run_id))
        if args.managed_servers:
            from .fleet import start_managed_servers

            self.rollout_fleet, managed_urls = start_managed_servers(self)
            urls = managed_urls + list(args.vllm_server_base_urls or [])
        elif args.vllm_server_base_urls:
            urls = args.vllm_server_base_urls  # checked by the config
        else:  # TRL's single-server fields
            url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
            urls = check_server_urls([url], field="vllm_server_base_url")
        generation_timeout = args.rollout_generation_timeout or 120.0 + 0.25 * args.max_completion_length
        client = RolloutClient(
            urls,
            request_timeout=args.rollout_request_timeout,
            api_key=args.rollout_api_key,
            max_inflight_per_server=args.rollout_max_inflight_per_server,
            generation_timeout=generation_timeout,
            load_timeout=args.weight_load_timeout,
        )
        # GRPO and PPO: TRL's correction (TRL asks for the log-probs whenever it has one); RLOO: trl-scale's, for
        # prefetched completions only (a synchronous RLOO run asks for none, as TRL's)
        correction = bool(
            getattr(args, "corrects_sampler_logprobs", getattr(self, "vllm_importance_sampling_correction", False))
        )
        asks_logprobs = logprobs and (hasattr(self, "vllm_importance_sampling_correction") or correction)
        try:
            settings = RolloutSettings.from_config(
                args, logprobs=asks_logprobs, require_logprobs=correction, run_id=run_id
            )
            self.vllm_generation = ServerRolloutGeneration(
                self.model,
                self.accelerator,
                self.processing_class,
                client,
                settings,
                weight_dir=weight_dir,
                fleet=self.rollout_fleet,
            )
        except BaseException:  # no server outlives a trainer that never got built, no lock a directory
            self.close_rollout_servers()
            if weight_dir is not None:
                weight_dir.release()
            raise
        self.use_vllm = True
        self.vllm_mode = "server"
        self._last_loaded_step = -1
        if args.async_rollout_staleness:
            if getattr(self, "rollout_func", None) is not None:
                raise ValueError(
                    "async_rollout_staleness > 0 generates ahead from the trainer's prompts; a rollout_func generates "
                    "inside the step with its own calls. Fix: async_rollout_staleness=0 (tools are streamed: pass "
                    "them as tools=...)"
                )
            if getattr(self, "environment_factories", None) is not None:
                raise ValueError(
                    "async_rollout_staleness > 0 generates ahead from the trainer's prompts; environment_factory "
                    "rollouts take theirs from each environment's reset() inside the step. Fix: "
                    "async_rollout_staleness=0, or tools=... (stateless tools are streamed)"
                )
            streaming = self.vllm_generation.settings.streaming
            groups = self._stream_groups_per_batch() if streaming else None
            self.vllm_generation.enable_async(
                args.async_rollout_staleness,
                lambda prompts: self._tokenize_prompts(prompts)[0],
                groups,
                converse=conversing(self) if streaming and getattr(self, "tools", None) else None,
            )
            self._lookahead = None

    def _stream_groups_per_batch(self) -> int:
        """Prompt groups in this process's generation batch. Each process streams its own rows, so that batch must
        hold whole groups (TRL's sampler keeps a prompt's copies together; accelerate hands each process
        consecutive rows)."""
        args = self.args
        rows = args.per_device_train_batch_size * args.steps_per_generation
        group = self.num_generations or 1
        if rows % group:
            raise ValueError(
                f"async_rollout_mode='streaming' streams whole prompt groups, but this process's generation batch of "
                f"{rows} rows (per_device_train_batch_size x steps_per_generation) does not hold whole groups of "
                f"num_generations={group}. Fix: make per_device_train_batch_size x steps_per_generation a multiple of "
                "num_generations, or async_rollout_mode='ordered'"
            )
        return rows // group

    def _generate_and_score_completions(self, inputs):
        """Streaming: the rows trained are the finished prompt groups, taken at the weights just synced, in place of
        the rows TRL read (those were read ahead and streamed already)."""
        generation = getattr(self, "vllm_generation", None)
        if not getattr(generation, "streams", False) or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if self.state.global_step != self._last_loaded_step:  # TRL's sync, done first: the batch is taken after it
            generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        streamed = generation.take_streamed(len(inputs))
        with generation.serving(streamed):
            return super()._generate_and_score_completions(streamed.rows)

    def _top_up_round(self, num_rows: int):
        """Dynamic sampling's top-up, streaming: new prompt groups join the stream, and the next finished groups
        (not necessarily those) are taken, within the staleness bound as every streamed group."""
        generation = getattr(self, "vllm_generation", None)
        if not getattr(generation, "streams", False):
            return super()._top_up_round(num_rows)
        streamed = generation.take_streamed(num_rows, new_rows=self._top_up_rows(num_rows))
        with generation.serving(streamed):
            return self._candidate_round(streamed.rows)

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, *args, **kwargs):
        """Tool-using rollouts, asynchronous. Streaming: each conversation's later turns were generated in the stream
        with its first (`streamed_tools`); the batch takes them whole, its version span covering every turn. Ordered
        (prefetch): the first turn was prefetched, the later ones are generated now with the weights this batch
        trains at, so a conversation that called a tool spans (its first turn's first version, the current one).
        Each token keeps the sampler log-prob of the weights that drew it."""
        generation = getattr(self, "vllm_generation", None)
        conversations = getattr(generation, "last_conversations", None)
        if conversations and all(c is not None for c in conversations) and len(conversations) == len(prompt_ids):
            generation.last_conversations = None
            return streamed_conversations(conversations, completion_ids, logprobs)
        spans = list(getattr(generation, "last_version_spans", None) or [])
        called = [bool(completion[0].get("tool_calls")) for completion in completions]
        result = super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, *args, **kwargs)
        if generation is not None and len(spans) == len(called):
            now = generation.sync_count
            generation.last_version_spans = [
                (first, max(newest, now)) if tool else (first, newest) for (first, newest), tool in zip(spans, called)
            ]
            generation.last_versions = [first for first, _ in spans]
        return result

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        generation = getattr(self, "vllm_generation", None)
        if getattr(generation, "streamer", None) is not None and "loss" in logs:
            logs.update(generation.stream_metrics())
        super().log(logs, start_time)

    def close_rollout_servers(self) -> None:
        """Stop the managed vLLM servers now (they stop by themselves when this process exits, however it does)."""
        if getattr(self, "rollout_fleet", None) is not None:
            self.rollout_fleet.close()

    def close_rollout(self) -> None:
        """Done generating: the managed servers stop and the rollout client's threads end (the CLI calls it before
        its processes leave)."""
        self.close_rollout_servers()
        generation = getattr(self, "vllm_generation", None)
        if hasattr(generation, "close"):
            generation.close()

    def train(self, *args, **kwargs):
        generation = getattr(self, "vllm_generation", None)
        if getattr(generation, "streamer", None) is not None:
            generation.open_streaming()  # a second train() streams again (the first closed its stream at its end)
        try:
            return super().train(*args, **kwargs)
        except BaseException:  # an exception or Ctrl-C: no server outlives the run that failed
            self.close_rollout_servers()
            raise
        finally:  # no copy of the model left behind (in /tmp or weight_sync_dir), however the run ended
            if getattr(generation, "streamer", None) is not None:
                generation.close_streaming()  # answers still generating were not needed
            release = getattr(generation, "release_weight_dir", None)
            if release is not None:
                release()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """With async rollout, the epoch's batch iterator is read ahead so upcoming generation batches are known
        (also after `skip_first_batches` on resume: whatever iterator the epoch uses is wrapped)."""
        reader = getattr(getattr(self, "vllm_generation", None), "read_ahead", None)
        if reader is not None:
            from ..rollout.async_rollout import LookaheadIterator

            if self._lookahead is None or self._lookahead.source is not epoch_iterator:
                every = self.args.steps_per_generation * self.num_iterations
                # No generation past the last step: it would run on the servers for nothing and outlive train().
                ga = self.args.gradient_accumulation_steps
                remaining = (self.state.max_steps - self.state.global_step) * ga
                phase = self.state.global_step * ga % every  # a resume inside a generation window
                self._lookahead = LookaheadIterator(epoch_iterator, reader, every, limit=remaining, phase=phase)
            epoch_iterator = self._lookahead
        return super().get_batch_samples(epoch_iterator, num_batches, device)


class PackedScoringMixin:
    """Installs the packed scoring engine on the policy and reference forwards TRL patched, and logs its figures."""

    _packing_stats: PackingStats | None = None  # set while packing is installed and on
    _packing_installed: bool = False

    def _install_packed_scoring(
        self, temperature: float, policy_outputs: tuple[str, ...], padding_free: bool | None = None
    ) -> None:
        """Pack the policy's and the reference's scoring forwards (once; TRL's forwards where packing is off or
        not exact for the model); then compile their layers where `compile_decoder_layers` asks (after packing's
        probe, which would otherwise compile its own small shapes first)."""
        if not (self._packing_installed or padding_free is False):
            self._install_packing_engine(temperature, policy_outputs, padding_free)
        if getattr(self.args, "compile_decoder_layers", False):
            self._compile_decoder_layers()

    def _install_packing_engine(
        self, temperature: float, policy_outputs: tuple[str, ...], padding_free: bool | None
    ) -> None:
        self._packing_installed = True
        from peft import PeftModel

        stats = PackingStats()
        # One settings object for the policy and its reference (and, through `scoring_settings`, the critic and a
        # reference on its Ray group).
        # (DPO keeps its own padding_free apart from TRL's flag: the caller's value stands.)
        settings = ScoringSettings.from_config(self.args, temperature)
        self.scoring_settings = settings = dataclasses.replace(settings, padding_free=padding_free)
        policy = self.accelerator.unwrap_model(self.model)
        if isinstance(policy, PeftModel):
            policy = policy.get_base_model()
        reference = getattr(self, "ref_model", None)
        group = self._sequence_parallel_group(policy, reference)
        packed = install_packed_scoring(policy, settings, outputs=policy_outputs, stats=stats, sequence_parallel=group)
        if reference is not None and not isinstance(reference, RayReference):
            install_packed_scoring(
                self.accelerator.unwrap_model(reference), settings, stats=stats, sequence_parallel=group
            )
        self._packing_stats = stats if packed is not None else None

    def _compile_decoder_layers(self) -> None:
        """`compile_decoder_layers`: the policy's and a local reference's layers compiled for scoring (once)."""
        from ..scoring.compiled import compile_decoder_layers

        for model in (self.model, getattr(self, "ref_model", None)):
            if model is not None and not isinstance(model, RayReference):
                compile_decoder_layers(self.accelerator.unwrap_model(model))

    # Trainers whose every scoring path goes through the engine under sequence parallelism (GRPO, RLOO, DPO, PPO).
    takes_sequence_parallel = False
    _sequence_parallel = None  # the SP group, once enabled

    def _sequence_parallel_group(self, policy, reference):
        """Ulysses attention on the policy and the reference (`sequence_parallel_size` > 1), after the refusals;
        None without sequence parallelism."""
        sp_size = getattr(self.args, "sequence_parallel_size", 1)
        if sp_size <= 1:
            return None
        if not self.takes_sequence_parallel:
            raise ValueError(
                f"sequence_parallel_size={sp_size}: {type(self).__name__} does not shard sequences. Fix: "
                "sequence_parallel_size=1"
            )
        from ..scoring.sequence_parallel import enable_sequence_parallel
        from ..sharding.data_parallel import draw_like_group_leader, share_batches_within_groups

        self._plain_attention = policy.config._attn_implementation  # what local generation runs with
        group = self._sequence_parallel = enable_sequence_parallel(policy, sp_size)
        if reference is not None:
            enable_sequence_parallel(self.accelerator.unwrap_model(reference), sp_size)
        # the group is one data-parallel rank: TRL sees world / sp processes (data, slices, gathers)
        share_batches_within_groups(self.accelerator, sp_size)
        draw_like_group_leader(group.group, group.rank)
        generation = getattr(self, "vllm_generation", None)
        if hasattr(generation, "share_with"):
            generation.share_with(group.group, group.rank)
        return group

    @contextmanager
    def _data_parallel_gathers(self):
        """TRL's module-level `gather` / `gather_object` (rewards, logs) with one copy per sequence-parallel group
        while TRL builds a batch (nothing changes without sequence parallelism)."""
        import sys

        from ..sharding.data_parallel import data_parallel_gathers

        with data_parallel_gathers(self.accelerator, sys.modules[trl_base_class(self).__module__]):
            yield

    def _generate_single_turn(self, *args, **kwargs):
        """Local generation under sequence parallelism: with the model's own attention (only scoring is sharded).
        Every rank of the group generates (ZeRO-3 gathers parameters collectively), and all take rank 0's
        completions: they train on one batch."""
        plain = getattr(self, "_plain_attention", None)
        if plain is None or getattr(self, "use_vllm", False):
            return super()._generate_single_turn(*args, **kwargs)
        from ..ranks import decide_on_leader

        model = self.accelerator.unwrap_model(self.model)
        sharded = model.config._attn_implementation
        model.set_attn_implementation(plain)
        try:
            generated = super()._generate_single_turn(*args, **kwargs)
        finally:
            model.set_attn_implementation(sharded)
        return decide_on_leader(lambda: generated, self._sequence_parallel.group)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs (not the final summary)
            if getattr(self, "rollout_fleet", None) is not None:
                logs.update(self.rollout_fleet.metrics())
            if self._packing_stats is not None:
                logs.update(self._packing_stats.pop())
            # trl-scale callbacks add their figures here, before the Trainer hands `logs` to report_to integrations
            # (a callback's own on_log runs after those and could not reach them).
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "trl_scale_metrics"):
                    logs.update(callback.trl_scale_metrics(trainer=self, logs=logs))
        super().log(logs, start_time)


# transformers' `Trainer.create_model_card` kwargs that TRL 1.16's override rejects with TypeError.


class PhaseTimingMixin:
    """Wall time per phase of an online step (generation, reward scoring, log-prob scoring), accumulated between
    logs and read by `trl_scale.callbacks.StepTimeCallback`."""

    @property
    def phase_seconds(self) -> dict[str, float]:
        if not hasattr(self, "_phase_seconds"):
            self._phase_seconds = defaultdict(float)
        return self._phase_seconds

    @contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - start

    def _generate(self, *args, **kwargs):
        with self._timed("generate"):
            return super()._generate(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        with self._timed("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        with self._timed("score"):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
