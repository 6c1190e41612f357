"""What the rollout client reads from a trainer's config, read once into a typed object: the generation interface
never holds the trainer or its arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..numbers import check_whole

WeightSyncName = Literal["auto", "nccl", "shared_dir", "lora"]
AsyncMode = Literal["ordered", "streaming"]
Interrupt = Literal["keep", "partial"]


@dataclass(frozen=True)
class AsyncRollout:
    """Asynchronous rollout, read once from `async_rollout_staleness`, `async_rollout_mode` and
    `async_rollout_interrupt` and checked with the fields it depends on (each error names the field and the fix):
    how many weight syncs a trained token may be behind, which read-ahead engine generates ahead (`ahead.py`'s
    registry), and what a streaming sync does to running answers."""

    staleness: int = 0  # 0: synchronous
    mode: AsyncMode = "ordered"  # the read-ahead engine (with staleness >= 1)
    interrupt: Interrupt = "keep"  # streaming: a sync freezes running answers ("keep") or cuts them ("partial")
    stream_rewards_asked: bool = False  # stream_rewards=True (the run plan resolves None: `rewards_in_stream`)
    reward_workers: int = 4  # ... its synchronous reward functions on this many threads

    @property
    def streaming(self) -> bool:
        """Streaming rollout: generations run across weight syncs (the mode, with staleness >= 1)."""
        return self.staleness > 0 and self.mode == "streaming"

    def takes_groups(self, episodes: bool, rollout: bool) -> bool:
        """Whether the read-ahead engine is the stream's, whose finished groups the step takes whole: streaming, and
        ordered with environments' episodes or a `rollout_func`, which only that engine runs (`ahead._ordered`)."""
        return self.streaming or (self.staleness > 0 and (episodes or rollout))

    @classmethod
    def from_config(cls, args) -> AsyncRollout:
        """From an online trainer's config (`RolloutArguments` and TRL's vLLM fields)."""
        staleness = args.async_rollout_staleness
        check_whole(
            "async_rollout_staleness", staleness, fix="use a whole number of weight syncs: 0 (synchronous) or k >= 1"
        )
        # streaming by default with staleness >= 1
        mode = args.async_rollout_mode or ("streaming" if staleness else "ordered")
        interrupt = args.async_rollout_interrupt
        if mode not in ("ordered", "streaming"):
            raise ValueError(f"async_rollout_mode={mode!r}: use 'ordered' or 'streaming'")
        if interrupt not in ("keep", "partial"):
            raise ValueError(
                f"async_rollout_interrupt={interrupt!r}: use 'keep' (running answers go on with the new weights) or "
                "'partial' (they are cut at the sync and continued after it)"
            )
        reward_workers = args.stream_reward_workers
        check_whole("stream_reward_workers", reward_workers, minimum=1, fix="use a positive whole number of threads")
        settings = cls(staleness, mode, interrupt, args.stream_rewards is True, reward_workers)
        settings.check_with(args)
        return settings

    def unread_reward_workers(self, stream_rewards: bool | None, environments: bool) -> str | None:
        """Why `stream_reward_workers` would be read by nothing (rewards computed in the step); None where they
        size the stream's reward threads: stream_rewards=True, or None where an environment streams."""
        if self.reward_workers == 4 or self.stream_rewards_asked or (stream_rewards is None and environments):
            return None
        return (
            f"stream_reward_workers={self.reward_workers} sizes the threads that compute rewards in the stream, and "
            "stream_rewards is not True (False computes them in the step; None too, unless an environment_factory "
            "streams). Fix: stream_rewards=True, or leave stream_reward_workers at its default (4)"
        )

    def check_with(self, args) -> None:
        """What the other fields must be for these settings to act."""
        if self.staleness and not (args.use_vllm and args.vllm_mode == "server"):
            raise ValueError(
                "async_rollout_staleness > 0 overlaps server generation with training: it needs use_vllm=True, "
                "vllm_mode='server' and vllm_server_base_urls. Fix: set those, or async_rollout_staleness=0"
            )
        if self.mode == "streaming" and not self.staleness:
            raise ValueError(
                "async_rollout_mode='streaming' lets generations run across weight syncs; with "
                "async_rollout_staleness=0 none does. Fix: async_rollout_staleness=1 (or more)"
            )
        if self.interrupt == "partial":
            self._check_partial(args.weight_sync)
        self._check_stream_rewards(args)
        if self.staleness and not args.vllm_importance_sampling_correction:
            raise ValueError(
                f"async_rollout_staleness={self.staleness} trains completions sampled from older weights; with "
                "vllm_importance_sampling_correction=False nothing corrects for it. Fix: "
                "vllm_importance_sampling_correction=True (default), or async_rollout_staleness=0"
            )

    def _check_stream_rewards(self, args) -> None:
        """Rewards are computed in the stream only where groups stream; the workers act only there."""
        if self.stream_rewards_asked and not self.streaming:
            raise ValueError(
                "stream_rewards=True computes each prompt group's rewards as soon as it finishes streaming; "
                f"with async_rollout_staleness={self.staleness} and async_rollout_mode={self.mode!r} no group "
                "streams. Fix: async_rollout_staleness=1 (or more) with async_rollout_mode='streaming' (the "
                "default), or stream_rewards=False"
            )
        # stream_rewards=None with asynchronous rollout: an environment (known to the trainer, which checks again)
        # streams its rewards, ordered or streaming; synchronous, None is False
        asked = args.stream_rewards if self.staleness else False
        why = self.unread_reward_workers(asked, environments=True)
        if why is not None:
            raise ValueError(why)

    def _check_partial(self, weight_sync: str) -> None:
        """`interrupt="partial"` acts only where a sync meets running answers it can cut: streaming (with staleness
        >= 1), and full-weight syncs (a LoRA sync loads the next adapter beside the running one and never pauses).
        Anywhere else it would be accepted and do nothing."""
        keep = "async_rollout_interrupt='keep' (the default)"
        if not self.staleness:
            raise ValueError(
                "async_rollout_interrupt='partial' cuts the answers a weight sync meets on the servers; with "
                "async_rollout_staleness=0 a sync waits for every answer, so none is cut. Fix: "
                f"async_rollout_staleness=1 (streaming), or {keep}"
            )
        if self.mode != "streaming":
            raise ValueError(
                f"async_rollout_interrupt='partial' with async_rollout_mode={self.mode!r}: ordered read-ahead lets "
                "the answers a sync meets finish on the old weights (they are never cut). Fix: "
                f"async_rollout_mode='streaming', or {keep}"
            )
        if weight_sync == "lora":
            raise ValueError(
                "async_rollout_interrupt='partial' with weight_sync='lora': a LoRA sync loads the new adapter under a "
                "new name and running answers finish on the adapter they started with, so none is cut. Fix: "
                f"{keep}, or a full-weight sync (weight_sync='auto') with streaming"
            )


@dataclass(frozen=True)
class RolloutSettings:
    max_completion_length: int
    sampling: dict = field(default_factory=dict)  # /v1/completions sampling fields, as TRL's client sends them
    weight_sync: WeightSyncName = "auto"
    weight_sync_timeout: float = 120.0  # a sync's control calls and each broadcast collective
    ready_timeout: float = 240.0  # vllm_server_timeout: every server's /health before the first request
    logprobs: bool = True  # ask for the sampled tokens' log-probs (GRPO and PPO, as TRL; not RLOO)
    require_logprobs: bool = False  # they feed an importance-sampling correction: a server without them is an error
    managed: bool = False  # this run manages its servers: a failed sync is tried once more after a restart
    run_id: str = ""  # names the weight versions and adapters of this run (the same on every rank)
    run_seed: int = 0  # the trainer's seed: with generation_kwargs' seed, the base of each request's (`seeds.py`)
    on_sampler_support: bool = False  # the trainer scores its log-probs on the sampler's truncated support
    asynchronous: AsyncRollout = field(default_factory=AsyncRollout)
    routing_replay: bool = False  # every server must return each token's routes (vLLM's routed_experts)

    @property
    def streaming(self) -> bool:
        """Prompt groups stream through the servers: syncs do not drain them."""
        return self.asynchronous.streaming

    @classmethod
    def from_config(
        cls,
        args,
        asynchronous: AsyncRollout | None = None,
        *,
        logprobs: bool,
        require_logprobs: bool,
        run_id: str,
        on_sampler_support: bool = False,
    ) -> RolloutSettings:
        """The client's settings from the config's fields, with what the run's plan read: the asynchronous settings
        (None: read here from the config) and whether the trainer scores on the sampler's support."""
        sampling = {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else -1,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            "return_tokens_as_token_ids": True,  # as TRL sends it
            "logprobs": 0 if logprobs else None,
        }
        sampling.update(args.generation_kwargs or {})
        seed = sampling.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(
                f"generation_kwargs={{'seed': {seed!r}}}: a request seed is a whole number (each request draws its "
                "own from it). Fix: an int, or no seed"
            )
        asynchronous = asynchronous if asynchronous is not None else AsyncRollout.from_config(args)
        if seed is not None:
            _warn_seeded_requests(seed, asynchronous.streaming)
        regex = args.vllm_structured_outputs_regex
        if regex is not None:  # as TRL's client sends it (vllm_client.py:441-442), taking precedence
            sampling["structured_outputs"] = {"regex": regex}
        return cls(
            max_completion_length=args.max_completion_length,
            sampling=sampling,
            weight_sync=args.weight_sync,
            weight_sync_timeout=args.weight_sync_timeout,
            ready_timeout=args.vllm_server_timeout,
            logprobs=logprobs,
            require_logprobs=require_logprobs,
            managed=bool(args.managed_servers),
            run_id=run_id,
            run_seed=args.seed or 0,
            on_sampler_support=on_sampler_support,
            asynchronous=asynchronous,
            routing_replay=args.routing_replay,
        )


def _warn_seeded_requests(seed, streaming: bool) -> None:
    """Each request draws its own numbers (`seeds.py`: a seed per request from this one, the run's seed and the
    request's identity), so a seed only makes runs reproducible; with streaming rollout it can meet vLLM 0.32's CPU
    worker dying on seeded requests a sync preempted."""
    from ..logs import get_logger

    if streaming:
        get_logger(__name__).warning(
            f"generation_kwargs sets seed={seed}: each request draws its own numbers from it (reproducible runs). "
            "With streaming rollout, vLLM 0.32's CPU worker has died resuming seeded requests a sync had preempted "
            "(refused by the preflight on such a server). Fix, if a server of that kind dies: drop the seed, or "
            "async_rollout_mode='ordered' (reproducible with a seed)"
        )
