"""Managed vLLM servers on a Ray cluster: one `ServerHost` actor per server, in a placement group of its own.

Each actor reserves its server's resources (`managed_server_gpus` GPUs, `managed_server_resources`: CPUs and custom
resources that pin servers to nodes), so servers, the critic, reward and reference groups never share a GPU unless
their bundles say so. The actor starts the server as a subprocess on its node (the same `LocalServer` as local
placement, bound to the node's address) with a reaper of its own: when Ray kills the actor, or its node's raylet
goes, the server's process group goes with it. `ServerFleet` supervises the handles as it does local ones; a dead
actor is replaced in its bundle, which Ray reschedules on a node with room when the node is gone.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from ..distributed.ray_backend import RoleError, check_cluster_fits
from ..logs import get_logger
from ..net import answers_health, free_port
from .local import LocalServer, Reaper
from .spec import FleetSpec, server_command, server_environment

logger = get_logger(__name__)


class ServerHost:
    """Ray actor: runs one vLLM server on its node and answers for it."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.reaper = Reaper()
        self.server: LocalServer | None = None

    def start(self, index: int, port: int | None) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        if port is None or not _port_free(host, port):  # a restart keeps its address where it can
            port = free_port(host)
        log_path = Path(tempfile.gettempdir()) / f"trl-scale-server-{index}-{port}.log"
        # Ray set CUDA_VISIBLE_DEVICES for this actor's GPUs: the server inherits it.
        self.server = LocalServer(
            server_command(self.spec, host, port),
            server_environment(self.spec, None),
            host,
            port,
            log_path,
            self.reaper,
        )
        return self.server.url

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def returncode(self) -> int | None:
        return self.server.returncode()

    def log_tail(self, chars: int = 2000) -> str:
        return self.server.log_tail(chars) if self.server else ""

    def pids(self) -> list[int]:
        return [self.server.process.pid] if self.server else []

    def stop(self, remove_log: bool = False) -> None:
        if self.server is not None:
            self.server.stop(remove_log=remove_log)
        self.reaper.close()


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False


class RayServer:
    """The fleet's handle on one `ServerHost` actor."""

    def __init__(self, actor, url: str, timeout: float):
        self.actor, self.url, self.timeout = actor, url, timeout

    def returncode(self):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(self.actor.returncode.remote(), timeout=min(30.0, self.timeout))
        except RayActorError as error:
            return f"its Ray actor died ({type(error).__name__})"
        except GetTimeoutError:
            return None  # busy or slow to answer: judged again on the next poll

    def ready(self) -> bool:
        return answers_health(self.url)

    def log_tail(self, chars: int = 2000) -> str:
        import ray

        try:
            return ray.get(self.actor.log_tail.remote(chars), timeout=10)
        except Exception:
            return "(its actor is gone; so is its log)"

    def node_id(self) -> str:
        import ray

        return ray.get(self.actor.node_id.remote(), timeout=30)

    def stop(self, grace: float = 20.0, remove_log: bool = False) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(remove_log), timeout=grace + 40)
        except Exception:  # dead already, or stuck: the kill below and the actor's reaper finish it
            pass
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass

    def describe(self) -> str:
        return f"{self.url} (Ray actor {self.actor._actor_id.hex()[:12]})"


class RayLauncher:
    """`managed_server_placement="ray"`: one placement group with a bundle per server (strategy SPREAD: servers on
    different nodes where the cluster allows); server i's actor lives in bundle i."""

    def __init__(self, spec: FleetSpec, resources: dict | None = None, timeout: float = 300.0):
        from ray.util.placement_group import placement_group

        self.spec, self.timeout = spec, timeout
        bundle = {"CPU": 1.0, **(resources or {})}
        if spec.gpus_per_server:
            bundle["GPU"] = float(spec.gpus_per_server)
        self.bundle = bundle
        check_cluster_fits("managed_server", bundle, spec.num_servers)
        self.placement_group = placement_group([bundle] * spec.num_servers, strategy="SPREAD")
        self.ports: dict[int, int] = {}
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(self.placement_group.ready(), timeout=timeout)
        except GetTimeoutError as error:
            self.close()
            raise RoleError(
                f"managed servers: a placement of {spec.num_servers} x {bundle} was not ready within "
                f"ray_call_timeout={timeout:g}s. Fix: lower managed_servers or managed_server_resources, or add nodes"
            ) from error

    def launch(self, index: int) -> RayServer:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = (
            ray.remote(ServerHost)
            .options(
                num_cpus=self.bundle.get("CPU", 0),
                num_gpus=self.bundle.get("GPU", 0),
                resources={k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=index
                ),
                max_restarts=0,  # the fleet restarts servers (bounded, logged), not Ray
            )
            .remote(self.spec)
        )
        try:
            url = ray.get(actor.start.remote(index, self.ports.get(index)), timeout=self.timeout)
        except Exception as error:
            ray.kill(actor, no_restart=True)
            raise RoleError(f"managed server {index}: its Ray actor could not start the server: {error}") from error
        self.ports[index] = int(url.rsplit(":", 1)[1])
        return RayServer(actor, url, self.timeout)

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:  # the cluster is gone already
                pass
            self.placement_group = None
