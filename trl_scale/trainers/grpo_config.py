"""`GRPOConfig`: TRL's `trl.GRPOConfig` plus trl-scale's fields."""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig as _TRLGRPOConfig

from .common import DistributedArguments, RolloutArguments, ScoringArguments


@dataclass
class GRPOConfig(DistributedArguments, RolloutArguments, ScoringArguments, _TRLGRPOConfig):
    r"""
    Configuration class for [`trl_scale.GRPOTrainer`]: every field of [`trl.GRPOConfig`], unchanged, plus trl-scale's.

    > Packed scoring (remove-padding + chunked log-prob head)

    padding_free (`bool`, defaults to `True`):
        Score only real tokens, packed into rows with `position_ids` restarting per sequence. `False` runs TRL's
        padded path and gives TRL's numbers exactly.
    token_budget (`int` or `None`, defaults to `None`):
        Most tokens in one packed forward; larger batches are split into balanced micro-batches, the same number on
        every data-parallel rank.
    logprob_chunk_size (`int`, defaults to `256`):
        Tokens projected onto the vocabulary at once by trl-scale's chunked head (non-Triton devices).

    > Server rollout (with `use_vllm=True, vllm_mode="server"`)

    vllm_server_base_urls (`list[str]` or `None`):
        Completion servers (vLLM or `trl-scale serve`), routed by least outstanding work, with failover.
    weight_sync (`str`, defaults to `"http"`), weight_sync_dir (`str` or `None`):
        `"http"` (safetensors body), `"shared_dir"` (a directory the servers read) or `"lora"` (adapter loading).
    weight_sync_timeout (`float`, defaults to `120`), rollout_request_timeout (`float`, defaults to `120`):
        Bounds in seconds: a stalled sync or an unreachable fleet fails with a clear error, never hangs.
    rollout_api_key (`str` or `None`): bearer token for the servers.

    > Placement (`pip install trl-scale[ray]`)

    backend (`str`, defaults to `"local"`): `"ray"` puts reward models (and PPO's critic) on Ray role groups,
        started and called by the main trainer process for every rank.
    ray_address (`str` or `None`): a Ray cluster; `None` starts a local one.
    reward_placement, critic_placement, reference_placement (`dict` or `None`):
        `{"num_workers": 1, "num_gpus_per_worker": 1.0, "num_cpus_per_worker": 1}` per role. The reference goes to
        its own group only when `reference_placement` is given (and `beta != 0`, no PEFT).
    ray_call_timeout (`float`, defaults to `300`): bound on every call to a Ray worker.
    """
