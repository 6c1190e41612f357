"""Managed vLLM servers for a trainer: the `managed_server_*` fields turned into a started, supervised fleet.

The main process starts the fleet (locally or on Ray) and hands every rank the servers' URLs; a failure to start
raises on every rank.
"""

from __future__ import annotations

import os

from ..fleet import FleetSpec, LocalLauncher, ServerFleet
from ..logs import get_logger
from ..ranks import broadcast_from_main, run_on_main

logger = get_logger(__name__)


def policy_path(trl) -> str:
    """Where the servers load the policy from: `managed_server_model`, else the path the policy was loaded from."""
    args = trl.args
    if args.managed_server_model:
        return _absolute_if_local(args.managed_server_model)
    model = trl.accelerator.unwrap_model(trl.model)
    if hasattr(model, "get_base_model"):  # PEFT: the servers hold the base model (weight_sync='lora' adds adapters)
        model = model.get_base_model()
    path = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not path:
        raise ValueError(
            "managed_servers: the policy was built in memory and has no path the servers could load. Fix: set "
            "managed_server_model to a checkpoint directory or Hub id with the same architecture (the first weight "
            "sync brings the servers to the policy's weights)"
        )
    return _absolute_if_local(str(path))


def _absolute_if_local(path: str) -> str:
    """A local directory as an absolute path (the servers start in another directory); a Hub id as it is."""
    return os.path.abspath(path) if os.path.isdir(path) else path


def fleet_spec(trl) -> FleetSpec:
    args = trl.args
    gpus = args.managed_server_gpus
    if gpus is None:
        import torch

        gpus = 1 if torch.cuda.is_available() else 0
    gpu_ids = args.managed_server_gpu_ids
    if args.managed_server_placement == "local" and gpu_ids is not None and not (gpus and cuda_on_this_machine()):
        why = (
            "managed_server_gpus=0" if gpus == 0 and args.managed_server_gpus == 0 else "this machine has no CUDA GPU"
        )
        raise ValueError(
            f"managed_server_gpu_ids={gpu_ids} hands GPUs to the servers, but {why}: the ids would be ignored. Fix: "
            "drop managed_server_gpu_ids (CPU servers: vLLM's CPU build), or run where the GPUs are"
        )
    if args.managed_server_placement == "local" and gpus and gpu_ids is None:
        raise ValueError(
            f"managed_servers={args.managed_servers} with {gpus} GPU(s) each on this machine: say which GPUs they "
            "take, apart from the trainer's. Fix: managed_server_gpu_ids=[...] (e.g. [4, 5, 6, 7] next to a trainer "
            "launched on GPUs 0-3), or managed_server_gpus=0 for vLLM's CPU build"
        )
    python = args.managed_server_python or _this_python()
    if args.managed_server_placement == "local":  # on Ray: a path on the servers' nodes
        python = os.path.abspath(python)  # the servers start in another directory
    if args.managed_server_placement == "local" and not os.access(python, os.X_OK):
        raise ValueError(
            f"managed_server_python={python!r} is not an executable file here. Fix: give the Python of the "
            "environment that has vLLM, e.g. /path/to/vllm-venv/bin/python"
        )
    return FleetSpec(
        num_servers=args.managed_servers,
        model=policy_path(trl),
        server_args=list(args.managed_server_args or []),
        env=dict(args.managed_server_env or {}),
        gpus_per_server=gpus,
        gpu_ids=gpu_ids,
        python=python,
        max_restarts=args.managed_server_max_restarts,
        ready_timeout=args.managed_server_ready_timeout,
        lora=args.weight_sync == "lora",
    )


def cuda_on_this_machine() -> bool:
    """A CUDA GPU here: seen by this torch, or by the driver (a CPU-only trainer may start GPU servers)."""
    import shutil

    import torch

    return torch.cuda.is_available() or os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def _this_python() -> str:
    import sys

    return sys.executable


def launcher_for(trl, spec: FleetSpec):
    args = trl.args
    if args.managed_server_placement == "ray":
        from ..distributed.ray_backend import init_ray
        from ..fleet.ray_hosts import RayLauncher

        init_ray(args.ray_address)
        return RayLauncher(spec, resources=args.managed_server_resources, timeout=args.ray_call_timeout)
    return LocalLauncher(spec)


def start_managed_servers(trl) -> tuple[ServerFleet | None, list[str]]:
    """Start the fleet on the main process; every rank gets the URLs, or the main process's exception (the same
    type and message on every rank, whatever the number of processes)."""

    def start() -> ServerFleet:
        spec = fleet_spec(trl)
        logger.info(
            "starting %d vLLM server(s) (%s) for %s with %s",
            spec.num_servers,
            trl.args.managed_server_placement,
            spec.model,
            spec.python,
        )
        fleet = ServerFleet(spec, launcher_for(trl, spec))
        fleet.start()  # stops what it started when it fails
        return fleet

    fleet = run_on_main(start)
    urls = broadcast_from_main(fleet.urls if fleet is not None else None)
    return fleet, urls
