"""Server rollout's config fields (GRPO, RLOO, PPO), mixed into the online trainers' configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..numbers import check_field_types, check_positive, check_whole, dict_field
from .setting_checks import check_sampling
from .settings import AsyncRollout, WeightSyncName

# `vllm.LLM` settings TRL sets for the engine and the trainer to stay in step (the set of TRL's proposed
# `vllm_llm_kwargs`, huggingface/trl#6816): a user value for one of them is refused.
RESERVED_LLM_KWARGS = (
    "model",
    "tensor_parallel_size",
    "distributed_executor_backend",
    "seed",
    "logprobs_mode",
    "quantization",
    "enable_sleep_mode",
)


def check_llm_kwargs(llm_kwargs: dict | None) -> dict:
    """`vllm_llm_kwargs` without TRL's own settings, or a ValueError naming them."""
    reserved = sorted(set(llm_kwargs or {}) & set(RESERVED_LLM_KWARGS))
    if reserved:
        raise ValueError(
            f"vllm_llm_kwargs sets {reserved}, which TRL sets itself so that the engine and the trainer stay in step. "
            "Fix: drop them (tensor parallelism: vllm_tensor_parallel_size; sleep mode: vllm_enable_sleep_mode)"
        )
    return dict(llm_kwargs or {})


@dataclass
class RolloutArguments:
    """Config fields of server rollout (GRPO, RLOO, PPO): many completion servers, no vLLM in the trainer."""

    FIELDS_DOC = """
    > Server rollout (with `use_vllm=True, vllm_mode="server"`)

    vllm_server_base_urls (`list[str]` or `None`):
        Completion servers (vLLM or `trl-scale serve`), routed by measured latency (the default; or least outstanding
        work), with failover.
    weight_sync (`str`, defaults to `"auto"`), weight_sync_dir (`str` or `None`):
        `"nccl"` (one weight-transfer group over every server, vLLM's `/update_weights` route; NCCL needs vLLM and
        CUDA in the trainer, `trl-scale serve` offers gloo), `"shared_dir"` (safetensors in a directory the servers
        read, then vLLM's `/collective_rpc reload_weights`), `"lora"` (adapter loading), or `"auto"`: `"nccl"` when
        every server offers a weight-transfer engine this trainer can drive, else `"shared_dir"`. `weight_sync_dir`
        (every server must read it; `None`: a temporary directory): the run writes only inside its own
        `trl-scale-run-<id>/` there and removes it at the end of `train()`; a lock file refuses a second live run.
    weight_sync_timeout (`float`, defaults to `120`), weight_load_timeout (`float`, defaults to `900`):
        Seconds for a weight sync's control calls and each broadcast collective; seconds a server may take to
        receive or load the weights (`/update_weights`, `/collective_rpc reload_weights`, a LoRA load). With
        `weight_sync="lora"`, the end of the run also waits up to `weight_sync_timeout` for requests still out on
        an adapter before deleting its directory (a vLLM server that reads a deleted adapter's directory again loses
        its engine): raise it where answers outlast two minutes.
    rollout_request_timeout (`float`, defaults to `120`), rollout_generation_timeout (`float` or `None`):
        Seconds a request may wait for a server to take it (a free slot, failovers); seconds one server may take to
        generate it, `None` meaning `120 + 0.25 × max_completion_length` (1144 s for 4096 tokens).
    rollout_api_key (`str` or `None`): bearer token for the servers.
    rollout_max_inflight_per_server (`int`, defaults to `8`):
        Requests in flight per server (one request: one prompt group's completions); more wait in the client for the
        first server to free up (load-aware routing). Raise it for vLLM servers that batch many requests.
    async_rollout_staleness (`int`, defaults to `0`):
        0: generate each batch when it is needed (synchronous, TRL's behaviour). k ≥ 1: the servers generate the
        next k generation batches while the trainer trains; no completion is trained on more than k weight syncs
        after the weights it was sampled from, and the vLLM importance-sampling correction (TRL's for GRPO and PPO,
        trl-scale's per-sequence one for RLOO) corrects the off-policy gap. A sync happens once per generation batch,
        so with `steps_per_generation` × epochs optimizer steps per batch, k syncs are k × that many optimizer steps.
        Needs `vllm_importance_sampling_correction=True`.
    async_rollout_mode (`str` or `None`, defaults to `None`): with `async_rollout_staleness ≥ 1`, how generation
        runs ahead. `"streaming"` (the default): prompt groups stream through the servers, up to `k + 1` generation
        batches' worth at a time, each sent as soon as another finishes, and each generation batch trains on the
        groups that have finished (oldest weights first), so no step waits for the longest answer of its batch; a
        sync does not drain: the servers pause between two decoding steps (vLLM's `/pause?mode=keep`), load the new
        weights, and running generations go on with them, so a completion may hold tokens of two versions, each with
        the sampler log-prob of the weights that drew it (what the correction uses). A group whose deadline (k syncs
        after it was sent) has come is waited for, so a long answer delays its batch and is never dropped. Not
        reproducible bit for bit (which group finishes first depends on timing). `"ordered"`: the next k generation
        batches are prefetched whole and a sync waits for them: a run's numbers do not depend on timing. `None`:
        `"streaming"`. With `weight_sync="lora"` a sync loads the new adapter under a new name and a running
        generation finishes on the adapter it started with (left loaded for `k` syncs: serve vLLM with
        `--max-loras` of at least `k + 1`, or generations of different adapters take turns), so its tokens are all
        of one version.
    async_rollout_interrupt (`str`, defaults to `"keep"`): with `async_rollout_mode="streaming"`, what a weight sync
        does to the answers running on the servers. `"keep"`: they are frozen between two decoding steps
        (`/pause?mode=keep`) and go on with the new weights after the load. `"partial"` (partial rollout, for a
        server without `keep`): they are cut (`/pause?mode=abort`: vLLM returns the tokens so far) and each cut answer
        is continued after the sync from where it stopped (its prompt and tokens so far sent as the next request's
        prompt, within what is left of `max_completion_length`), on the new weights. Either way a completion holds
        tokens of two versions, each with its sampler log-prob; "partial" re-reads the prefix once per cut.
    stream_rewards (`bool` or `None`, defaults to `None`), stream_reward_workers (`int`, defaults to `4`): with
        `async_rollout_mode="streaming"`, compute each prompt group's rewards as soon as it finishes, off the
        training step (`None`: on with an `environment_factory`, whose instances the rewards read as the episode
        ends in the stream; off otherwise): synchronous reward functions (and reward models on Ray groups) on
        `stream_reward_workers` threads (they must be safe to call from several threads at once; 1 calls one at a
        time), async ones on TRL's event loop. A reward model in the trainer stays in the step. The step's rewards
        are then TRL's `_calculate_rewards` over the values computed in the stream (weights, NaN rules, per-function
        logs, gathers). Each function is called once per prompt group (its rows only), and `trainer_state` is the state
        when the group finished (up to `async_rollout_staleness` syncs before the step that trains it): a
        function that looks across a whole batch should keep `stream_rewards=False`.
    environment_timeout (`float`, defaults to `300`): with an `environment_factory` and streaming, seconds an
        environment's `reset()` or method may take: a tool call past it fails as TRL reports a failing tool, a
        `reset()` past it stops the run naming the environment and the group; the instance is discarded and closed.
    logprobs_on_sampler_support (`bool`, defaults to `True`): with `top_k`, `top_p` or `min_p` truncating vLLM's
        sampling and `vllm_importance_sampling_correction=True`, score the trainer's log-probs on the support vLLM
        samples from (its rule applied to the trainer's own logits, the sampled token always in it): vLLM's
        log-probs are renormalised over that support, so against whole-vocabulary log-probs every importance ratio
        of an unchanged policy is the kept mass (~0.9 at top_p=0.9) instead of 1. The policy trained is then the
        truncated one that samples. `False`: TRL's whole-vocabulary log-probs. Refused with penalties or logit biases
        that change the logits before truncation (the trainer cannot repeat them).
    routing_replay (`bool`, defaults to `False`): a mixture-of-experts policy (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
        trained on the experts its servers chose (R3, "Rollout Routing Replay"): each server returns every token's
        routes (vLLM: `--enable-return-routed-experts`, which needs its V2 model runner; `trl-scale serve` takes the
        same flag), and every training forward of those tokens (old, reference, policy) takes them, the gate's
        weights over them keeping the router's gradient. `routing/agreement` logs how often the trainer's own router
        chose the same experts. Packed rows carry them; tree rows step aside.

    vllm_llm_kwargs (`dict` or `None`): with `vllm_mode="colocate"` (TRL's default: vLLM in the trainer), extra
        `vllm.LLM` settings on top of TRL's (e.g. `{"dtype": "bfloat16", "hf_overrides": {...}}`); the engine's dtype
        follows the policy's unless set here. Colocated weight syncs use vLLM's layerwise `reload_weights` where the
        engine repacks its weights (vLLM's CPU backend), TRL's direct `load_weights` elsewhere.
"""  # its section of each config's docstring (`config_docstring`)

    vllm_server_base_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "With use_vllm=True and vllm_mode='server': the completion servers (vLLM or `trl-scale serve`). "
            "Requests are routed by load and observed speed; a failing server leaves the rotation and is probed "
            "again later. TRL's single vllm_server_base_url keeps working."
        },
    )
    weight_sync: WeightSyncName = field(
        default="auto",
        metadata={
            "help": "How weights reach the servers: 'nccl' (a weight-transfer group over every server: vLLM's NCCL "
            "engine, which needs vLLM and CUDA here, or trl-scale serve's gloo engine), 'shared_dir' (safetensors in "
            "weight_sync_dir, reloaded with vLLM's /collective_rpc reload_weights), 'lora' (an adapter per sync), or "
            "'auto' ('nccl' where every server offers an engine this trainer can drive, else 'shared_dir')."
        },
    )
    weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory the servers can read, for weight_sync='shared_dir' or 'lora' (None: a temporary one). "
            "The run writes only inside its own trl-scale-run-<id>/ subdirectory, removed at the end of train(), and "
            "holds a lock file (.trl-scale-lock) so a second live run is refused."
        },
    )
    weight_sync_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds a weight sync's control calls and each broadcast collective may take."},
    )
    weight_load_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Seconds a server may take to receive or load the weights of one sync (/update_weights, "
            "/collective_rpc reload_weights, /v1/load_lora_adapter): large models need minutes."
        },
    )
    rollout_request_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds a completion request may wait for a server to take it (free slot, failovers)."},
    )
    rollout_generation_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one server may take to generate one request (a prompt's completions). None: "
            "120 + 0.25 x max_completion_length (a 4096-token completion gets 1144 s)."
        },
    )
    rollout_api_key: str | None = field(default=None, metadata={"help": "Bearer token for the servers."})
    async_rollout_staleness: int = field(
        default=0,
        metadata={
            "help": "0: synchronous rollout. k >= 1: the servers generate the next k generation batches while the "
            "trainer trains; a completion is trained on at most k weight syncs after the weights it was sampled from "
            "(one sync per generation batch: k x steps_per_generation x epochs optimizer steps), importance-sampling "
            "corrected (TRL's correction for GRPO and PPO, trl-scale's per-sequence one for RLOO)."
        },
    )
    async_rollout_mode: Literal["ordered", "streaming"] | None = field(
        default=None,
        metadata={
            "help": "With async_rollout_staleness >= 1: 'streaming' (prompt groups stream through the servers, the "
            "trainer takes finished ones; syncs land between decoding steps) or 'ordered' (whole batches prefetched, "
            "a sync waits for them: reproducible). None: 'streaming'."
        },
    )
    async_rollout_interrupt: Literal["keep", "partial"] = field(
        default="keep",
        metadata={
            "help": "Streaming: what a weight sync does to running answers. 'keep': frozen between decoding steps, "
            "they go on with the new weights (/pause?mode=keep). 'partial' (servers without keep): cut "
            "(/pause?mode=abort) and each continued after the sync from where it stopped (partial rollout)."
        },
    )
    stream_rewards: bool | None = field(
        default=None,
        metadata={
            "help": "Streaming: compute each prompt group's rewards as soon as it finishes, off the training step "
            "(sync reward functions on stream_reward_workers threads, async ones on TRL's event loop); a reward "
            "model in the trainer stays in the step. Each function is called once per prompt group. None: on with "
            "an environment_factory, off otherwise."
        },
    )
    stream_reward_workers: int = field(
        default=4,
        metadata={"help": "With stream_rewards=True: threads for synchronous reward functions (1: one at a time)."},
    )
    environment_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Streaming with an environment_factory: seconds an environment's reset() or method may take "
            "(a tool past it fails as a failing tool does in TRL; a reset() past it stops the run)."
        },
    )
    logprobs_on_sampler_support: bool = field(
        default=True,
        metadata={
            "help": "With top_k/top_p/min_p and the importance-sampling correction: score the trainer on the tokens "
            "vLLM samples from (its log-probs are renormalised there), so an unchanged policy's ratio is 1, not the "
            "kept mass. False: TRL's whole-vocabulary log-probs."
        },
    )
    routing_replay: bool = field(
        default=False,
        metadata={
            "help": "An MoE policy trained on the experts its servers chose for each token (R3): servers started "
            "with --enable-return-routed-experts return them, every training forward takes them."
        },
    )
    rollout_max_inflight_per_server: int = field(
        default=8,
        metadata={
            "help": "Requests in flight per server (one request = one prompt's num_generations completions); more "
            "wait in the client for the first server to free up (load-aware routing). Raise it for vLLM servers "
            "that batch many requests."
        },
    )

    vllm_llm_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "vllm_mode='colocate': extra vllm.LLM settings on top of TRL's, e.g. {'dtype': 'bfloat16', "
            "'hf_overrides': {...}}. The engine's dtype follows the policy's unless set here. TRL's own settings "
            "(model, seed, tensor_parallel_size, ...) are refused."
        },
    )

    @property
    def sampler_logprobs_corrected(self) -> bool:
        """Whether the servers' log-probs feed an importance-sampling correction: TRL's (GRPO, PPO); RLOO's config
        says when its own does."""
        return bool(self.vllm_importance_sampling_correction)

    def __post_init__(self):
        super().__post_init__()
        self._validate_rollout_arguments()
        check_field_types(self, RolloutArguments)  # after the fields' own checks, whose messages name their fixes

    def _validate_rollout_arguments(self) -> None:
        from ..scoring.sampler_support import SamplerSupport

        if hasattr(self, "top_p"):
            check_sampling(self)
        # a truncation the trainer cannot repeat fails here, not at the first step (as `trainers.plan.ScoringPlan`)
        if self.logprobs_on_sampler_support and self.use_vllm and self.sampler_logprobs_corrected:
            SamplerSupport.from_config(self)
        self.vllm_llm_kwargs = check_llm_kwargs(dict_field(self.vllm_llm_kwargs, "vllm_llm_kwargs")) or None
        if self.vllm_server_base_urls is not None:
            from .urls import check_server_urls

            check_server_urls(self.vllm_server_base_urls)
        if self.weight_sync == "http":
            raise ValueError(
                "weight_sync='http' is gone: no vLLM route takes weights in a request body (its /update_weights takes "
                "JSON metadata and a broadcast). Fix: weight_sync='auto' (default), 'nccl', 'shared_dir' or 'lora'"
            )
        if self.weight_sync not in ("auto", "nccl", "shared_dir", "lora"):
            raise ValueError(f"weight_sync={self.weight_sync!r}: use 'auto', 'nccl', 'shared_dir' or 'lora'")
        for name in (
            "weight_sync_timeout",
            "weight_load_timeout",
            "rollout_request_timeout",
            "rollout_generation_timeout",
            "vllm_server_timeout",
            "environment_timeout",
        ):
            check_positive(name, getattr(self, name), optional=name == "rollout_generation_timeout")
        check_whole(
            "rollout_max_inflight_per_server",
            self.rollout_max_inflight_per_server,
            minimum=1,
            fix="use a positive whole number of requests (default 8); with 0 no request could ever be sent",
        )
        sequence_parallel = getattr(self, "sequence_parallel_size", 1) > 1
        if sequence_parallel and self.use_vllm and self.vllm_mode == "colocate":
            raise ValueError(
                f"vllm_mode='colocate' with sequence_parallel_size={self.sequence_parallel_size}: each rank's vLLM "
                "engine would sample its own completions for a batch the group shares. Fix: vllm_mode='server' "
                "(trl-scale's rollout servers), or sequence_parallel_size=1"
            )
        asynchronous = AsyncRollout.from_config(self)  # checked once, with the fields it depends on
        self.async_rollout_mode = asynchronous.mode  # the default resolved (streaming with staleness >= 1)
