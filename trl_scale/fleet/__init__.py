"""The managed fleet of vLLM servers: started by the trainer, supervised, stopped on every exit path.

- `FleetSpec` says what to run (`managed_server_*` config fields); `server_command` / `server_environment` turn
  it into `python -m vllm.entrypoints.openai.api_server ...` with vLLM's RL routes on (dev mode).
- A launcher starts server `index` and returns a handle (`url`, `returncode()`, `ready()`, `stop()`,
  `log_tail()`): `LocalLauncher` here (subprocesses on this machine, each in its own process group, GPUs by
  `CUDA_VISIBLE_DEVICES`), `ray_hosts.RayLauncher` on a Ray cluster (one actor per server in a
  placement group); `ServeLauncher` runs `trl-scale serve` in place of vLLM (a CPU fleet: tests, the chaos run).
- `ServerFleet` starts every server at once, waits for all with progress on the console, then supervises: a server
  that exits is restarted on the same address (bounded attempts, exponential backoff) and counted in metrics. A
  restarted server serves its original weights: the router keeps it out of the rotation (its `/weight_info`
  version is not the current one) until it has loaded the current weights, at once through `on_restarted`
  (`shared_dir`, `lora`) or at the next sync (`nccl`), so no completion comes from stale weights.
- The fleet imports nothing of the rollout client or of `serve`: the trainer wires it to the client through two
  callbacks (`on_moved`, `on_restarted`).
- Local servers die with the trainer however it ends: `close()` when `train()` raises and at interpreter exit, and
  the reaper (`reaper.py`) for a trainer ended by a signal (SIGTERM, SIGKILL), which runs no exit code.
"""

from .local import LocalLauncher, LocalServer, Reaper, ServeLauncher
from .spec import FleetSpec, check_python_has, restart_delay, server_command, server_environment, start_failure_fix
from .supervisor import ServerFleet

__all__ = [
    "FleetSpec",
    "LocalLauncher",
    "LocalServer",
    "Reaper",
    "ServeLauncher",
    "ServerFleet",
    "check_python_has",
    "restart_delay",
    "server_command",
    "server_environment",
    "start_failure_fix",
]
