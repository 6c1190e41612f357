"""Weight sync to the rollout servers by vLLM's own routes (vLLM 0.22-0.33, dev mode): one interface
(`WeightSyncMode`: sync, catch_up, server_version, close; `base.py`), one class per mode, chosen from a registry.

- `"nccl"` (`GroupSync`): one weight-transfer group over every server;
- `"shared_dir"` (`SharedDirSync`): a directory the servers read, `/collective_rpc reload_weights`;
- `"lora"` (`LoraSync`): a LoRA adapter per sync, `/v1/load_lora_adapter`, superseded ones unloaded;
- `"auto"`: `"nccl"` where every server offers an engine this trainer can drive, else `"shared_dir"` (`choose_mode`).
Each pauses the servers around the change, gives the sync a version, and records which servers took it on the
router (`RolloutClient.record_sync`), which then sends requests only to servers on the current version.
"""

from __future__ import annotations

from ...logs import get_logger
from ..client import RolloutClient
from .base import PolicyWeights, SyncSettings, WeightSyncMode
from .group import GroupSync
from .lora import LoraSync
from .shared_dir import SharedDirSync

logger = get_logger(__name__)

WEIGHT_SYNC_MODES: dict[str, type[WeightSyncMode]] = {mode.name: mode for mode in (GroupSync, SharedDirSync, LoraSync)}

__all__ = [
    "WEIGHT_SYNC_MODES",
    "GroupSync",
    "LoraSync",
    "PolicyWeights",
    "SharedDirSync",
    "SyncSettings",
    "WeightSyncMode",
    "choose_mode",
    "weight_sync_for",
]


def weight_sync_for(mode: str, client: RolloutClient, settings: SyncSettings) -> WeightSyncMode:
    return WEIGHT_SYNC_MODES[mode](client, settings)


def choose_mode(requested: str, backend: str | None) -> str:
    """The mode a run uses: the one asked for, or for `"auto"` a group where the servers offer an engine this
    trainer can drive (`backend`, from the preflight), else a shared directory. Raises where `"nccl"` was asked for
    and the servers' NCCL engine cannot be driven from here (no CUDA, no vLLM)."""
    from ..weight_transfer import GLOO_BACKEND, check_nccl_sender

    if requested in ("lora", "shared_dir"):
        return requested
    if requested == "nccl":
        if backend == "nccl":
            check_nccl_sender()
        return "nccl"
    if backend == GLOO_BACKEND:
        return "nccl"
    if backend == "nccl":
        try:
            check_nccl_sender()
            return "nccl"
        except RuntimeError as error:
            logger.warning("weight_sync='auto' uses 'shared_dir': %s", error)
    return "shared_dir"
