"""What the rollout client reads from a trainer's config, read once into a typed object: the generation interface
never holds the trainer or its arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..scoring.sampler_support import SamplerSupport

WeightSyncName = Literal["auto", "nccl", "shared_dir", "lora"]


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
    on_sampler_support: bool = False  # the trainer scores its log-probs on the sampler's truncated support
    streaming: bool = False  # async_rollout_mode="streaming": syncs do not drain the servers
    # streaming: a sync freezes running answers ("keep") or cuts them, each continued after it ("partial")
    interrupt: Literal["keep", "partial"] = "keep"

    @classmethod
    def from_config(cls, args, *, logprobs: bool, require_logprobs: bool, run_id: str) -> RolloutSettings:
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
        if sampling.get("seed") is not None:
            _warn_seeded_requests(sampling["seed"], getattr(args, "async_rollout_mode", None) == "streaming")
        regex = getattr(args, "vllm_structured_outputs_regex", None)
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
            on_sampler_support=SamplerSupport.from_config(args) is not None,
            streaming=getattr(args, "async_rollout_mode", "ordered") == "streaming",
            interrupt=getattr(args, "async_rollout_interrupt", "keep"),
        )


def _warn_seeded_requests(seed, streaming: bool) -> None:
    from ..logs import get_logger

    crash = (
        " With streaming rollout, vLLM 0.32's CPU worker has also died resuming seeded requests a sync had preempted "
        "(refused by the preflight on such a server)."
        if streaming
        else ""
    )
    get_logger(__name__).warning(
        f"generation_kwargs sets seed={seed}: every request (one per prompt group) is sampled with the same random "
        "numbers, step after step, so the groups' answers vary less than sampling should make them (on trl-scale's "
        f"toy task such runs learned about half as much, README 'Asynchronous rollout').{crash} Fix: drop the seed "
        "for training runs (the trainer's own seed still fixes its data order and initialisation)"
    )
