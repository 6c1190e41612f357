"""Ray role groups: a role's models on their own resources, behind bounded remote calls.

A role group is a placement group of `num_workers` bundles (`num_gpus_per_worker` GPUs, `num_cpus_per_worker`
CPUs each) holding one `RoleWorker` actor per bundle. Every remote call has a timeout; a worker that dies or stalls
is reported as an error naming its role (`RoleError`), and a stateless role's dead worker is restarted.

With several workers, a role is data parallel inside its group: rows are split over the workers, and the critic's
workers form their own torch.distributed group (gloo on CPU, NCCL on GPU) in which the critic is sharded with
FSDP2 (each worker holds 1/num_workers of its parameters, gradients and AdamW state; `sharding: "replicated"`
keeps whole replicas that average gradients). What the trainer
holds in place of each model (`RayCritic`, `RayRewardModel`, `RayReference`) is in `roles`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ..logs import get_logger
from ..numbers import check_non_negative, check_whole

logger = get_logger(__name__)


class RoleError(RuntimeError):
    """A role group's worker died, stalled past its timeout, or could not start."""

    def __init__(self, message: str, worker_died: bool = False):
        super().__init__(message)
        self.worker_died = worker_died


@dataclass
class Placement:
    num_workers: int = 1
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0
    sharding: Literal["fsdp2", "replicated"] = (
        "fsdp2"  # the critic's, across its workers: "fsdp2" or "replicated" (critic_placement only)
    )
    resources: dict | None = None  # custom Ray resources per worker, e.g. {"node_b": 1}: pins a role to nodes

    @classmethod
    def from_config(cls, value: dict | None, field_name: str) -> Placement:
        value = dict(value or {})
        keys = {"num_workers", "num_gpus_per_worker", "num_cpus_per_worker", "resources"}
        if field_name == "critic_placement":
            keys.add("sharding")
        unknown = set(value) - keys
        if unknown:
            raise ValueError(f"{field_name} has unknown keys {sorted(unknown)}; use {', '.join(sorted(keys))}")
        placement = cls(**value)
        check_whole(f"{field_name}.num_workers", placement.num_workers, minimum=1, fix="use a whole number, e.g. 2")
        for name in ("num_gpus_per_worker", "num_cpus_per_worker"):
            check_non_negative(f"{field_name}.{name}", getattr(placement, name), fix="use a number >= 0, e.g. 1")
        custom = placement.resources
        if custom is not None and (
            not isinstance(custom, dict)
            or {"CPU", "GPU"} & set(custom)
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in custom.values())
        ):
            raise ValueError(
                f"{field_name}.resources={custom!r}: custom Ray resources per worker with amounts >= 0, e.g. "
                "{'node_b': 1}; CPUs and GPUs have their own keys"
            )
        if placement.sharding not in ("fsdp2", "replicated"):
            raise ValueError(
                f"{field_name}.sharding={placement.sharding!r}: use 'fsdp2' (the critic sharded across its "
                "workers) or 'replicated' (a whole critic on each worker)"
            )
        # GPUs are not checked here: on a cluster they may exist only on worker nodes. A placement the cluster
        # cannot satisfy fails as a RoleError when its placement group is not ready within ray_call_timeout.
        return placement


def _check_reachable(address: str, named_by: str, timeout: float = 10.0) -> None:
    """`ray.init` waits minutes on an address where nothing listens; a TCP connect answers in seconds."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if address in ("auto", "local") or not host or not port.isdigit():
        return  # Ray resolves these itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as error:
        raise RuntimeError(
            f"{named_by}: could not reach a Ray cluster ({type(error).__name__}: {error}). Fix: start one there "
            "(`ray start --head`), correct the address, or set ray_address=None (and unset RAY_ADDRESS) to start a "
            "local cluster"
        ) from error


def resolve_ray_address(address: str | None) -> tuple[str, str]:
    """(address for `ray.init`, the setting that named it). `None` is a cluster of this run's own, or the one
    `RAY_ADDRESS` names (as under `ray job submit`) — never Ray's own default, which attaches to whichever cluster
    `ray start` (or another job's test cluster) last recorded in /tmp/ray/ray_current_cluster on this machine."""
    if address is not None:
        return address, f"ray_address={address!r}"
    from_env = os.environ.get("RAY_ADDRESS", "")
    if from_env:
        return from_env, f"RAY_ADDRESS={from_env!r} (ray_address=None)"
    return "local", "ray_address=None"


def init_ray(address: str | None = None) -> None:
    """Connect to `address`, or start a local cluster (token auth off for it: local tests, no network)."""
    import ray

    if ray.is_initialized():
        return
    address, named_by = resolve_ray_address(address)
    if address == "local":
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    else:
        _check_reachable(address, named_by)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise RuntimeError(
            f"{named_by}: could not reach a Ray cluster ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Fix: start one there (`ray start --head`), correct "
            "the address, or set ray_address=None (and unset RAY_ADDRESS) to start a local cluster"
        ) from error


def check_cluster_fits(role: str, bundle: dict, num_workers: int) -> None:
    """Fail at once when the cluster can never hold this group (Ray would leave its placement pending until the
    timeout): more of a resource than all live nodes have together, or a worker larger than any one node."""
    import ray

    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    field = {"CPU": "num_cpus_per_worker", "GPU": "num_gpus_per_worker"}
    for resource, amount in bundle.items():
        total = sum(node.get(resource, 0) for node in nodes)
        largest = max((node.get(resource, 0) for node in nodes), default=0)
        if amount * num_workers > total or amount > largest:
            raise RoleError(
                f"{role} group asks for {amount * num_workers:g} {resource}s ({num_workers} worker(s) × "
                f"{role}_placement.{field.get(resource, resource)}={amount:g}), and the Ray cluster has "
                f"{total:g} in all (at most {largest:g} on one node). Fix: lower {role}_placement's "
                f"num_workers or {field.get(resource, resource)}, or add nodes with {resource}s"
            )


class RoleGroup:
    """One role's placement group and workers, with bounded remote calls.

    A stateless role (reward, reference) restarts a dead worker in its bundle and retries the call once, so a
    lost worker costs a reload, not the run. The critic's state (weights, optimizer) lives in its workers, so a dead
    critic worker stops the run with a `RoleError` naming the role; the last checkpoint resumes it.
    """

    def __init__(self, role: str, model_path: str, placement: Placement, settings, timeout: float = 300.0):
        from ray.util.placement_group import placement_group

        self.role, self.timeout = role, timeout
        self.model_path, self.placement, self.settings = model_path, placement, settings
        self.worker_class = settings.worker_class()  # the role's worker (`role_workers.RoleWorker`'s subclass)
        self.restartable = self.worker_class.stateless
        bundle = {"CPU": placement.num_cpus_per_worker, **(placement.resources or {})}
        if placement.num_gpus_per_worker:
            bundle["GPU"] = placement.num_gpus_per_worker
        self.workers = []
        self.placement_group = None
        check_cluster_fits(role, bundle, placement.num_workers)
        self.placement_group = placement_group([bundle] * placement.num_workers, strategy="PACK")
        try:
            self._call(self.placement_group.ready(), "placement")
            self.workers = [self._start_worker(index) for index in range(placement.num_workers)]
            self._start_workers()
        except BaseException:
            # A group that never started must not keep its (possibly pending) reservation: Ray would hold or grant
            # those resources to nobody for the rest of the job.
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        try:
            self._call([w.ping.remote() for w in self.workers], "start")
            if self.worker_class.uses_process_group and len(self.workers) > 1:
                address, port = self._call(self.workers[0].rendezvous_address.remote(), "rendezvous")
                world = len(self.workers)
                refs = [w.init_process_group.remote(i, world, address, port) for i, w in enumerate(self.workers)]
                self._call(refs, "process group")
        except RoleError as error:
            raise RoleError(
                f"{self.role} group could not start its workers for {self.model_path!r}: {error}"
            ) from error

    def _start_worker(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(self.worker_class).options(
            num_cpus=self.placement.num_cpus_per_worker,
            num_gpus=self.placement.num_gpus_per_worker,
            resources=dict(self.placement.resources or {}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            ),
            max_restarts=0,  # restarts are the group's decision (stateless roles only), not Ray's
        )
        return actor.remote(self.role, self.model_path, self.settings)

    @property
    def worker(self):
        return self.workers[0]

    def _call(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=self.timeout)
        except GetTimeoutError as error:
            raise RoleError(
                f"{self.role} group: {what} took longer than {self.timeout}s (ray_call_timeout)"
            ) from error
        except RayActorError as error:
            raise RoleError(f"{self.role} group: its worker died during {what}: {error}", worker_died=True) from error

    def call(self, method: str, *args):
        """`method` on the first worker (state, one-off queries)."""
        return self._call(getattr(self.worker, method).remote(*args), method)

    def call_all(self, method: str, *args):
        return self._call([getattr(w, method).remote(*args) for w in self.workers], method)

    def start_map(self, method: str, per_worker_args: list[tuple]):
        """`method` started on every worker, each with its own arguments; returns what collects the results
        (bounded, as every call). No retry: for a stateful role, whose calls must not run twice."""
        refs = [getattr(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args)]
        return lambda: self._call(refs, method)

    def map(self, method: str, per_worker_args: list[tuple]) -> list:
        """`method` on every worker, each with its own arguments; a stateless role restarts dead workers and
        retries once."""

        def run():
            return self._call([getattr(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args)], method)

        try:
            return run()
        except RoleError as error:
            if not (self.restartable and error.worker_died):
                raise
            restarted = self._restart_dead_workers()
            logger.warning(f"{self.role} group: restarted worker(s) {restarted} after: {error}. Retrying {method}.")
            return run()

    def _restart_dead_workers(self) -> list[int]:
        import ray
        from ray.exceptions import RayActorError

        restarted = []
        for index, worker in enumerate(self.workers):
            try:
                ray.get(worker.ping.remote(), timeout=self.timeout)
            except RayActorError:
                self.workers[index] = self._start_worker(index)
                restarted.append(index)
        self._call([self.workers[i].ping.remote() for i in restarted], "restart")
        return restarted

    def shutdown(self) -> None:
        """Kill the workers and free the placement group's resources (Ray keeps placement groups until removed)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is None:
            return
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self.placement_group)
        self.placement_group = None

    def __del__(self):
        try:
            import ray

            if ray.is_initialized():
                self.shutdown()
        except Exception:  # interpreter shutdown or a cluster already gone: nothing left to free
            pass
