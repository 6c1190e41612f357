"""Server rollout as a trainer feature: trl-scale's multi-server client plugged in as TRL's `vllm_generation` (the
trainer was built with TRL's vLLM off), its asynchronous read-ahead, streaming, the managed fleet's life, and the
stream's state in checkpoints."""

from __future__ import annotations

import os
import threading
import uuid

from ..logs import get_logger
from ..ranks import broadcast_from_main, run_on_main
from ..rollout.weight_dir import WeightDirectory
from .checkpoints import STREAM_STATE_NAME, check_stream_group_size
from .construction import image_columns, uses_server_rollout
from .feature import Feature
from .stream_environments import EpisodeOpener, finished_environments
from .stream_rewards import StreamScorer
from .stream_rollout_func import replayed_rollouts, rolling_out
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


def _generation(trainer):
    return getattr(trainer, "vllm_generation", None)


def _read_ahead(trainer):
    return getattr(_generation(trainer), "read_ahead", None)


class ServerRollout(Feature):
    """`use_vllm=True, vllm_mode="server"` served by trl-scale's client (one server or several, managed or given;
    `uses_server_rollout` says when TRL's own client serves instead)."""

    name = "server_rollout"

    def __init__(self, wanted: bool = False):
        self.wanted = wanted  # TRL's vLLM stays off while TRL's constructor runs, and this client stands in
        self.lookahead = None  # the epoch's batch iterator, read ahead (async rollout)
        self.episodes = None  # streaming with environments: the pool and its episodes

    @classmethod
    def from_arguments(cls, arguments: dict) -> ServerRollout:
        config = arguments.get("args")
        images = image_columns(arguments.get("train_dataset"), arguments.get("eval_dataset"))
        return cls(config is not None and uses_server_rollout(config, images))

    def check(self, trainer) -> None:
        """Environments (TRL's `environment_factory`) and a `rollout_func` with asynchronous rollout run in the
        stream's engine (streaming, or ordered: `rollout.ordered_stream`), an environment's rewards with it;
        `environment_timeout` acts only there. Refused before any server is reached."""
        from ..rollout.settings import AsyncRollout

        args = trainer.args
        asynchronous = AsyncRollout.from_config(args) if self.wanted else AsyncRollout()
        environments = getattr(trainer, "environment_factories", None) is not None
        rollout_func = getattr(trainer, "rollout_func", None) is not None
        why = asynchronous.unread_reward_workers(getattr(args, "stream_rewards", None), environments)
        if why is not None:
            raise ValueError(why)
        if asynchronous.staleness and rollout_func:
            check_streamed_rollout_func(args, environments)
        if environments and asynchronous.staleness:
            check_streamed_environments(args)
        timeout = getattr(args, "environment_timeout", 300.0)
        if timeout != 300.0 and not (environments and asynchronous.staleness):
            raise ValueError(
                f"environment_timeout={timeout:g} bounds the calls of environments run in the stream; this run "
                "streams none (it needs environment_factory=..., server rollout and async_rollout_staleness >= 1). "
                "Fix: leave environment_timeout at its default (300)"
            )

    def setup(self, trainer) -> None:
        trainer.rollout_fleet = None
        if not self.wanted:
            return
        trainer.vllm_generation = self._client(trainer)
        trainer.use_vllm = True
        trainer.vllm_mode = "server"
        trainer._last_loaded_step = -1
        if trainer.vllm_generation.settings.asynchronous.staleness:
            self._enable_async(trainer)

    def _urls(self, trainer) -> list[str]:
        from ..rollout.urls import check_server_urls

        args = trainer.args
        if args.managed_servers:
            from .fleet import start_managed_servers

            trainer.rollout_fleet, managed_urls = start_managed_servers(trainer)
            return managed_urls + list(args.vllm_server_base_urls or [])
        if args.vllm_server_base_urls:
            return args.vllm_server_base_urls  # checked by the config
        url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"  # TRL's own
        return check_server_urls([url], field="vllm_server_base_url")

    def _client(self, trainer):
        from ..rollout import RolloutClient, ServerRolloutGeneration
        from ..rollout.settings import RolloutSettings

        args = trainer.args
        run_id = broadcast_from_main(uuid.uuid4().hex[:8])  # one id on every rank: it names the weight versions
        # Claimed before any server starts: a directory another run uses, or one not writable, fails here.
        weight_dir = run_on_main(lambda: claimed_weight_dir(args, run_id))
        try:
            client = RolloutClient(
                self._urls(trainer),
                request_timeout=args.rollout_request_timeout,
                api_key=args.rollout_api_key,
                max_inflight_per_server=args.rollout_max_inflight_per_server,
                generation_timeout=args.rollout_generation_timeout or 120.0 + 0.25 * args.max_completion_length,
                load_timeout=args.weight_load_timeout,
            )
            # GRPO and PPO: TRL's correction (TRL asks for the log-probs whenever it has one); RLOO: trl-scale's,
            # for prefetched completions only (a synchronous RLOO run asks for none, as TRL's)
            trl_correction = getattr(trainer, "vllm_importance_sampling_correction", None)
            correction = bool(getattr(args, "corrects_sampler_logprobs", trl_correction or False))
            asks_logprobs = trl_correction is not None or correction
            settings = RolloutSettings.from_config(
                args, logprobs=asks_logprobs, require_logprobs=correction, run_id=run_id
            )
            return ServerRolloutGeneration(
                trainer.model,
                trainer.accelerator,
                trainer.processing_class,
                client,
                settings,
                weight_dir=weight_dir,
                fleet=trainer.rollout_fleet,
            )
        except BaseException:  # no server outlives a trainer that never got built, no lock a directory
            close_servers(trainer)
            if weight_dir is not None:
                weight_dir.release()
            raise

    def _enable_async(self, trainer) -> None:
        generation = trainer.vllm_generation
        asynchronous = generation.settings.asynchronous
        environments = getattr(trainer, "environment_factories", None) is not None
        rollout_func = getattr(trainer, "rollout_func", None) is not None
        streaming = asynchronous.streams_groups(environments, rollout_func)  # whole groups, later turns in them
        rewards_in_stream = asynchronous.rewards_in_stream or environments
        lock = threading.Lock()  # the tokenizer's and the tool loops' (see streamed_tools)
        timeout = trainer.args.environment_timeout
        self.episodes = EpisodeOpener(trainer, timeout, lock) if environments else None
        tokenize = _no_prompt_ids if environments else (lambda prompts: trainer._tokenize_prompts(prompts)[0])
        generation.enable_async(
            tokenize,  # with environments a group's prompts are made when it is sent (each reset())
            stream_groups_per_batch(trainer) if streaming else None,
            converse=conversing(trainer, lock, timeout) if streaming and getattr(trainer, "tools", None) else None,
            score=StreamScorer(trainer, asynchronous.reward_workers) if rewards_in_stream else None,
            open_episode=self.episodes,
            rollout=rolling_out(trainer) if rollout_func else None,
        )

    # ---- the step -------------------------------------------------------------------------------------------

    def generate_and_score(self, trainer, proceed, inputs):
        """Streaming: the rows trained are the finished prompt groups, taken at the weights just synced, in place of
        the rows TRL read (those were read ahead and streamed already). An evaluation batch (TRL's `evaluate`) is
        generated now, at the current weights, through the router, never from or into what is read ahead."""
        generation = _generation(trainer)
        if not trainer.model.training and _read_ahead(trainer) is not None:  # an evaluation: generated now
            with generation.evaluating():
                return proceed(inputs)
        if not getattr(generation, "streams", False) or not trainer.model.training:
            return proceed(inputs)
        if trainer.state.global_step != trainer._last_loaded_step:  # TRL's sync, done first: the batch is after it
            generation.sync_weights()
            trainer._last_loaded_step = trainer.state.global_step
        streamed = generation.take_streamed(len(inputs))
        with generation.serving(streamed), finished_environments(trainer), replayed_rollouts(trainer, streamed):
            return proceed(streamed.rows)

    def tool_call_loop(self, trainer, proceed, prompts, prompt_ids, completion_ids, completions, logprobs, *rest):
        """Tool-using rollouts, asynchronous. Streaming: each conversation's later turns were generated in the stream
        with its first (`streamed_tools`); the batch takes them whole, its version span covering every turn. Ordered
        (prefetch): the first turn was prefetched, the later ones are generated now with the weights this batch
        trains at, so a conversation that called a tool spans (its first turn's first version, the current one).
        Each token keeps the sampler log-prob of the weights that drew it."""
        generation = _generation(trainer)
        conversations = getattr(generation, "last_conversations", None)
        if conversations and all(c is not None for c in conversations) and len(conversations) == len(prompt_ids):
            generation.last_conversations = None
            return streamed_conversations(conversations, completion_ids, logprobs)
        spans = list(getattr(generation, "last_version_spans", None) or [])
        called = [bool(completion[0].get("tool_calls")) for completion in completions]
        result = proceed(prompts, prompt_ids, completion_ids, completions, logprobs, *rest)
        if generation is not None and len(spans) == len(called):
            now = generation.sync_count
            generation.last_version_spans = [
                (first, max(newest, now)) if tool else (first, newest) for (first, newest), tool in zip(spans, called)
            ]
            generation.last_versions = [first for first, _ in spans]
        return result

    def batch_samples(self, trainer, proceed, epoch_iterator, num_batches, device):
        """With async rollout, the epoch's batch iterator is read ahead so upcoming generation batches are known
        (also after `skip_first_batches` on resume: whatever iterator the epoch uses is wrapped)."""
        reader = getattr(_generation(trainer), "read_ahead", None)
        if reader is not None:
            from ..rollout.async_rollout import LookaheadIterator

            if self.lookahead is None or self.lookahead.source is not epoch_iterator:
                args, state = trainer.args, trainer.state
                every = args.steps_per_generation * trainer.num_iterations
                # No generation past the last step: it would run on the servers for nothing and outlive train().
                ga = args.gradient_accumulation_steps
                remaining = (state.max_steps - state.global_step) * ga
                phase = state.global_step * ga % every  # a resume inside a generation window
                self.lookahead = LookaheadIterator(epoch_iterator, reader, every, limit=remaining, phase=phase)
            epoch_iterator = self.lookahead
        return proceed(epoch_iterator, num_batches, device)

    # ---- the run ----------------------------------------------------------------------------------------------

    def train(self, trainer, proceed, *args, **kwargs):
        generation = _generation(trainer)
        if _read_ahead(trainer) is not None:
            generation.open_read_ahead()  # a second train() reads ahead again (the first closed it at its end)
        try:
            return proceed(*args, **kwargs)
        except BaseException:  # an exception or Ctrl-C: no server outlives the run that failed
            close_servers(trainer)
            raise
        finally:  # no copy of the model left behind (in /tmp or weight_sync_dir), however the run ended
            if self.episodes is not None:
                self.episodes.close()  # every environment instance closed (the next run makes new ones)
            if _read_ahead(trainer) is not None:
                generation.close_read_ahead()  # answers still generating were not needed
            release = getattr(generation, "release_weight_dir", None)
            if release is not None:
                release()

    def log(self, trainer, logs: dict[str, float]) -> None:
        generation = _generation(trainer)
        if self.wanted and generation is not None:  # trl-scale's client: this process's requests, by server
            busy = generation.client.busy_fractions()
            logs.update({f"rollout/busy_fraction/server{i}": fraction for i, fraction in enumerate(busy)})
        if _read_ahead(trainer) is not None:
            logs.update(generation.read_ahead_metrics())
        if getattr(trainer, "rollout_fleet", None) is not None:
            logs.update(trainer.rollout_fleet.metrics())
        if self.episodes is not None:
            logs.update(self.episodes.metrics())

    # ---- checkpoints: the stream's prompt groups -------------------------------------------------------------

    def save_state(self, trainer, output_dir: str) -> None:
        """The read-ahead engine's state (streaming: the prompt groups read and not yet trained, generating,
        finished or queued), each rank its own, so that a resume trains each once and reads on past them (see
        `rollout.streaming`)."""
        read_ahead = _read_ahead(trainer)
        noted = self.lookahead.noted_ahead() if self.lookahead is not None else 0
        state = read_ahead.state(noted) if read_ahead is not None else None
        if state is None:
            return
        import torch

        state["group_size"] = trainer.num_generations  # the saved groups are cut at it: a resume must use the same
        os.makedirs(output_dir, exist_ok=True)
        rank = trainer.accelerator.process_index
        torch.save(state, os.path.join(output_dir, STREAM_STATE_NAME.format(rank=rank)))

    def load_state(self, trainer, checkpoint: str) -> None:
        read_ahead = _read_ahead(trainer)
        path = os.path.join(checkpoint, STREAM_STATE_NAME.format(rank=trainer.accelerator.process_index))
        if read_ahead is None or not os.path.isfile(path):
            return
        import torch

        state = torch.load(path, map_location="cpu", weights_only=False)
        check_stream_group_size(state, trainer.num_generations, path)
        read_ahead.restore(state)


def _no_prompt_ids(prompts: list) -> list[list[int]]:
    return [[] for _ in prompts]


def check_streamed_rollout_func(args, environments: bool) -> None:
    """A rollout_func with asynchronous rollout runs in the stream's engine, once per prompt group; its rewards in
    the step."""
    if environments:
        raise ValueError(
            "rollout_func with environment_factory and async_rollout_staleness >= 1: the stream runs either a "
            "group's environment episode or its rollout_func, not one inside the other. Fix: "
            "async_rollout_staleness=0 (TRL's own loop runs both in the step), or drop one of them"
        )
    if args.stream_rewards:
        raise ValueError(
            "stream_rewards=True with a rollout_func: its extra keys reach the reward functions in the step, where "
            "TRL merges them. Fix: stream_rewards=None (the default) or False"
        )
    if getattr(args, "dynamic_sampling", False):
        raise ValueError(
            "dynamic_sampling=True with a streamed rollout_func: the top-up rounds generate without it. Fix: "
            "dynamic_sampling=False, or async_rollout_staleness=0"
        )


def check_streamed_environments(args) -> None:
    """Environments with asynchronous rollout run in the stream's engine (their episodes end there, and their
    rewards with them)."""
    if args.stream_rewards is False:
        raise ValueError(
            "stream_rewards=False with environment_factory and async_rollout_staleness >= 1: each group's "
            "environments go back to their pool when its episode ends in the stream, so the rewards that read them "
            "(get_reward, environments=) are computed there. Fix: stream_rewards=None (the default) or True"
        )


def stream_groups_per_batch(trainer) -> int:
    """Prompt groups in this process's generation batch. Each process streams its own rows, so that batch must hold
    whole groups (TRL's sampler keeps a prompt's copies together; accelerate hands each process consecutive rows)."""
    args = trainer.args
    rows = args.per_device_train_batch_size * args.steps_per_generation
    group = trainer.num_generations or 1
    if rows % group:
        raise ValueError(
            f"async_rollout_mode='streaming' streams whole prompt groups, but this process's generation batch of "
            f"{rows} rows (per_device_train_batch_size x steps_per_generation) does not hold whole groups of "
            f"num_generations={group}. Fix: make per_device_train_batch_size x steps_per_generation a multiple of "
            "num_generations, or async_rollout_mode='ordered'"
        )
    return rows // group


def close_servers(trainer) -> None:
    """Stop the managed vLLM servers now (they stop by themselves when the process exits, however it does)."""
    if getattr(trainer, "rollout_fleet", None) is not None:
        trainer.rollout_fleet.close()
