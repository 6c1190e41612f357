"""Server rollout as a trainer feature: trl-scale's multi-server client plugged in as TRL's `vllm_generation` (the
trainer was built with TRL's vLLM off), its asynchronous read-ahead, streaming, the managed fleet's life, and the
stream's state in checkpoints."""

from __future__ import annotations

import threading
import uuid

from ..logs import get_logger
from ..ranks import broadcast_from_main, run_on_main
from ..rollout.record import RECORD_KEY
from ..rollout.weight_dir import WeightDirectory
from .checkpoints import check_stream_group_size
from .feature import Feature, Patch
from .plan import RolloutPlan, RunPlan
from .stream_environments import EpisodeOpener, finished_environments
from .stream_rewards import StreamRewarder
from .stream_rollout_func import replayed_rollouts, rolling_out
from .streamed_tools import conversing, streamed_conversations
from .tool_images import policy_image_token

logger = get_logger(__name__)


def claimed_weight_dir(args, run_id: str) -> WeightDirectory | None:
    """The directory this run's shared_dir / lora syncs write to ("auto" may pick shared_dir), claimed now."""
    if args.weight_sync not in ("shared_dir", "lora", "auto"):
        return None
    prefix = "trl-scale-lora-" if args.weight_sync == "lora" else "trl-scale-weights-"
    weight_dir = WeightDirectory(args.weight_sync_dir, run_id, args.output_dir, temporary_prefix=prefix)
    weight_dir.claim()
    return weight_dir


def image_tokens(trl) -> frozenset[int]:
    """The token ids a completion must not hold (an answer that samples one is drawn again): a vision-language
    policy's image token, which TRL's local generation suppresses (`suppress_tokens`, for a processor), so that
    TRL's step never meets an image token without an image."""
    token = policy_image_token(trl)
    return frozenset() if token is None else frozenset([token])


def _read_ahead(trl):
    """The read-ahead engine: None in a synchronous run, and on a sequence-parallel group's other ranks."""
    ahead = trl.vllm_generation.ahead
    return ahead.engine if ahead is not None else None


class ServerRollout(Feature):
    """`use_vllm=True, vllm_mode="server"` served by trl-scale's client (one server or several, managed or given;
    every server-mode run, images included: `uses_server_rollout`)."""

    name = "server_rollout"
    PATCHES = (
        Patch(
            "config.use_vllm (False)",
            "while TRL's constructor runs (TRL builds no vLLM client)",
            "when it returns",
            "trainers/online.py",
        ),
    )

    def __init__(self, plan: RolloutPlan, corrects_sampler_logprobs: bool = False, on_sampler_support: bool = False):
        self.plan = plan  # TRL's vLLM stays off while TRL's constructor runs, and this client stands in
        self.corrects_sampler_logprobs = corrects_sampler_logprobs  # RLOO's own correction
        self.on_sampler_support = on_sampler_support  # the trainer scores on the sampler's support (the plan's)
        self.lookahead = None  # the epoch's batch iterator, read ahead (async rollout)
        self.episodes = None  # streaming with environments: the pool and its episodes

    @classmethod
    def build(cls, plan: RunPlan) -> ServerRollout | None:
        if not plan.rollout.server:
            return None
        return cls(plan.rollout, plan.corrects_sampler_logprobs, plan.scoring.sampler_support is not None)

    def setup(self, run) -> None:
        run.trl.set_rollout_fleet(None)
        run.trl.install_rollout_client(self._client(run.trl, run.clock, run.steps))
        if self.plan.asynchronous.staleness:
            self._enable_async(run.trl)

    def _urls(self, trl) -> list[str]:
        from ..rollout.urls import check_server_urls

        args = trl.args
        if args.managed_servers:
            from .fleet import start_managed_servers

            fleet, managed_urls = start_managed_servers(trl)
            trl.set_rollout_fleet(fleet)
            return managed_urls + list(args.vllm_server_base_urls or [])
        if args.vllm_server_base_urls:
            return args.vllm_server_base_urls  # checked by the config
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"  # TRL's own
        return check_server_urls([url], field="vllm_server_base_url")

    def _client(self, trl, clock, steps):
        """trl-scale's client and generation for this run, given the run's phase clock and timeline and its step
        states."""
        from ..rollout import RolloutClient, ServerRolloutGeneration
        from ..rollout.settings import RolloutSettings

        args = trl.args
        run_id = broadcast_from_main(uuid.uuid4().hex[:8])  # one id on every rank: it names the weight versions
        # Claimed before any server starts: a directory another run uses, or one not writable, fails here.
        weight_dir = run_on_main(lambda: claimed_weight_dir(args, run_id))
        try:
            client = RolloutClient(
                self._urls(trl),
                request_timeout=args.rollout_request_timeout,
                api_key=args.rollout_api_key,
                max_inflight_per_server=args.rollout_max_inflight_per_server,
                generation_timeout=args.rollout_generation_timeout or 120.0 + 0.25 * args.max_completion_length,
                load_timeout=args.weight_load_timeout,
                redraw_tokens=image_tokens(trl),
                timeline=clock.timeline,
            )
            # GRPO and PPO: TRL's correction (TRL asks for the log-probs whenever it has one); RLOO: trl-scale's,
            # for prefetched completions, and the mismatch gate's per-step figures (TRL's RLOO asks for none: the
            # sampled token's log-prob changes no number of the run)
            trl_correction = trl.importance_sampling_correction
            correction = self.corrects_sampler_logprobs or bool(trl_correction)
            asks_logprobs = trl_correction is not None or correction or self.plan.mismatch_measured
            settings = RolloutSettings.from_config(
                args,
                self.plan.asynchronous,
                logprobs=asks_logprobs,
                require_logprobs=correction,
                run_id=run_id,
                on_sampler_support=self.on_sampler_support,
            )
            return ServerRolloutGeneration(
                trl.model,
                trl.accelerator,
                trl.processing_class,
                client,
                settings,
                weight_dir=weight_dir,
                fleet=trl.rollout_fleet,
                phase=clock.phase,
                steps=steps,
            )
        except BaseException:  # no server outlives a trainer that never got built, no lock a directory
            close_servers(trl)
            if weight_dir is not None:
                weight_dir.release()
            raise

    def _enable_async(self, trl) -> None:
        generation, plan = trl.vllm_generation, self.plan
        environments, streaming = plan.environments, plan.takes_groups  # whole groups, later turns in them
        lock = threading.Lock()  # the tokenizer's and the tool loops' (see streamed_tools)
        timeout = trl.args.environment_timeout
        self.episodes = EpisodeOpener.of(trl, timeout, lock) if environments else None
        tokenize = _no_prompt_ids if environments else (lambda prompts: trl.tokenize_prompts(prompts)[0])
        generation.enable_async(
            tokenize,  # with environments a group's prompts are made when it is sent (each reset())
            stream_groups_per_batch(trl) if streaming else None,
            converse=conversing(trl, lock, timeout) if streaming and trl.tools else None,
            reward=StreamRewarder(trl, plan.asynchronous.reward_workers) if plan.rewards_in_stream else None,
            open_episode=self.episodes,
            rollout=rolling_out(trl) if plan.rollout_func else None,
        )

    # ---- the step -------------------------------------------------------------------------------------------

    def generate_and_score(self, run, proceed, inputs):
        """Streaming: the rows trained are the finished prompt groups, taken at the weights just synced, in place of
        the rows TRL read (those were read ahead and streamed already). An evaluation batch (TRL's `evaluate`) is
        generated now, at the current weights, through the router, never from or into what is read ahead. The
        batch carries its record (`rollout.record`) out, to the features outside this one."""
        generation = run.trl.vllm_generation
        batch = self._built(run, generation, proceed, inputs)
        record = run.step.records.newest()
        if record is not None and len(record) == batch["completion_ids"].size(0):
            batch[RECORD_KEY] = record
        return batch

    def _built(self, run, generation, proceed, inputs):
        trl = run.trl
        if not trl.model.training and self.plan.asynchronous.staleness:  # an evaluation: generated now
            with generation.ahead.evaluating():
                return proceed(inputs)
        if not self.plan.takes_groups or not trl.model.training:
            return proceed(inputs)
        if trl.state.global_step != trl.weights_synced_at_step:  # TRL's sync, done first: the batch is after it
            generation.sync_weights()
            trl.mark_synced()
        streamed = generation.ahead.take_streamed(len(inputs))
        run.step.serve(streamed)
        with finished_environments(trl), replayed_rollouts(trl, streamed, run.step):
            return proceed(streamed.rows)

    def tool_call_loop(self, run, proceed, prompts, prompt_ids, completion_ids, completions, logprobs, *rest):
        """Tool-using rollouts, asynchronous. Streaming: each conversation's later turns were generated in the stream
        with its first (`streamed_tools`); the batch takes them whole, its version span covering every turn. Ordered
        (prefetch): the first turn was prefetched, the later ones are generated now with the weights this batch
        trains at, so a conversation that called a tool spans (its first turn's first version, the current one).
        Each token keeps the sampler log-prob of the weights that drew it."""
        record = run.step.records.newest()
        conversations = record.conversations if record is not None else None
        if conversations and all(c is not None for c in conversations) and len(conversations) == len(prompt_ids):
            return streamed_conversations(list(conversations), completion_ids, logprobs)
        called = [bool(completion[0].get("tool_calls")) for completion in completions]
        result = proceed(prompts, prompt_ids, completion_ids, completions, logprobs, *rest)
        if record is not None and len(record) == len(called):
            now = run.trl.vllm_generation.sync_count
            spans = [
                (first, max(newest, now)) if tool else (first, newest)
                for (first, newest), tool in zip(record.version_spans, called)
            ]
            run.step.records.replace_newest(record.with_spans(spans))
        return result

    def batch_samples(self, run, proceed, epoch_iterator, num_batches, device):
        """With async rollout, the epoch's batch iterator is read ahead so upcoming generation batches are known
        (also after `skip_first_batches` on resume: whatever iterator the epoch uses is wrapped)."""
        reader = _read_ahead(run.trl)
        if reader is not None:
            from ..rollout.lookahead import LookaheadIterator

            if self.lookahead is None or self.lookahead.source is not epoch_iterator:
                args, state = run.trl.args, run.trl.state
                every = args.steps_per_generation * run.trl.num_iterations
                # No generation past the last step: it would run on the servers for nothing and outlive train().
                ga = args.gradient_accumulation_steps
                remaining = (state.max_steps - state.global_step) * ga
                phase = state.global_step * ga % every  # a resume inside a generation window
                self.lookahead = LookaheadIterator(epoch_iterator, reader, every, limit=remaining, phase=phase)
            epoch_iterator = self.lookahead
        return proceed(epoch_iterator, num_batches, device)

    # ---- the run ----------------------------------------------------------------------------------------------

    def train(self, run, proceed, *args, **kwargs):
        generation = run.trl.vllm_generation
        if generation.ahead is not None:
            generation.ahead.open()  # a second train() reads ahead again (the first closed it at its end)
        try:
            return proceed(*args, **kwargs)
        except BaseException:  # an exception or Ctrl-C: no server outlives the run that failed
            close_servers(run.trl)
            raise
        finally:  # no copy of the model left behind (in /tmp or weight_sync_dir), however the run ended
            if self.episodes is not None:
                self.episodes.close()  # every environment instance closed (the next run makes new ones)
            if generation.ahead is not None:
                generation.ahead.close()  # answers still generating were not needed
            generation.syncer.release_weight_dir()

    def log(self, run, logs: dict[str, float]) -> None:
        generation = run.trl.vllm_generation  # trl-scale's client: this process's requests, by server
        busy = generation.client.busy_fractions()
        logs.update({f"rollout/busy_fraction/server{i}": fraction for i, fraction in enumerate(busy)})
        if _read_ahead(run.trl) is not None:
            logs.update(generation.ahead.metrics(generation.client.answers_continued))
        if run.trl.rollout_fleet is not None:
            logs.update(run.trl.rollout_fleet.metrics())
        if self.episodes is not None:
            logs.update(self.episodes.metrics())

    # ---- checkpoints: the stream's prompt groups -------------------------------------------------------------

    def state_dict(self, run) -> dict | None:
        """The read-ahead engine's state (streaming: the prompt groups read and not yet trained, generating,
        finished or queued), each rank its own, so that a resume trains each once and reads on past them (see
        `rollout.streaming`)."""
        read_ahead = _read_ahead(run.trl)
        noted = self.lookahead.noted_ahead() if self.lookahead is not None else 0
        state = read_ahead.state(noted) if read_ahead is not None else None
        if state is None:
            return None
        return {**state, "group_size": run.trl.num_generations}  # the groups are cut at it: a resume must use it

    def load_state_dict(self, run, state: dict, path: str) -> None:
        read_ahead = _read_ahead(run.trl)
        if read_ahead is not None:
            check_stream_group_size(state, run.trl.num_generations, f"{path} (its {self.name} entry)")
            read_ahead.restore(state)


def _no_prompt_ids(prompts: list) -> list[list[int]]:
    return [[] for _ in prompts]


def stream_groups_per_batch(trl) -> int:
    """Prompt groups in this process's generation batch. Each process streams its own rows, so that batch must hold
    whole groups (TRL's sampler keeps a prompt's copies together; accelerate hands each process consecutive rows)."""
    args = trl.args
    rows = args.per_device_train_batch_size * args.steps_per_generation
    group = trl.num_generations or 1
    if rows % group:
        raise ValueError(
            f"async_rollout_mode='streaming' streams whole prompt groups, but this process's generation batch of "
            f"{rows} rows (per_device_train_batch_size x steps_per_generation) does not hold whole groups of "
            f"num_generations={group}. Fix: make per_device_train_batch_size x steps_per_generation a multiple of "
            "num_generations, or async_rollout_mode='ordered'"
        )
    return rows // group


def close_servers(trl) -> None:
    """Stop the managed vLLM servers now (they stop by themselves when the process exits, however it does)."""
    if trl.rollout_fleet is not None:
        trl.rollout_fleet.close()
