"""`weight_sync="nccl"`: one weight-transfer group over every server (vLLM's `/init_weight_transfer_engine`, then
per sync `/pause`, `/start_weight_update`, `/update_weights` with JSON `update_info` while the trainer broadcasts,
`/finish_weight_update`, `/reset_prefix_cache`, `/resume`), kept between syncs and rebuilt when its membership
changes. The sender is vLLM's NCCL engine's (CUDA) or trl-scale's gloo engine (`weight_transfer.py`)."""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass
from urllib.parse import urlparse

from ...logs import get_logger
from ...net import free_port, is_loopback
from ...routing import ServerState
from ..client import RolloutError
from .base import PolicyWeights, WeightSyncMode

logger = get_logger(__name__)


@dataclass
class TransferGroup:
    sender: object  # weight_transfer's sender: join(), send(), close(), wire()
    members: list[str]  # member URLs, in rank order


class GroupSync(WeightSyncMode):
    """See the module docstring."""

    name = "nccl"
    group: TransferGroup | None = None

    def sync(self, weights: PolicyWeights, version: str) -> None:
        """Every rank walks the parameters (gathering shards is a collective); the main process broadcasts them. The
        walk always runs to its end, also when the sync failed before its broadcast: the other ranks wait in its
        ZeRO-3/FSDP gathers until this rank has walked every parameter."""
        metadata = weights.metadata()
        params = weights.named_tensors()
        try:
            if weights.is_main:
                self._check_placement((name, shape) for name, _, shape in metadata)
                self.broadcast(metadata, params, version)
        finally:
            for _ in params:
                pass

    def broadcast(self, metadata: list[tuple[str, str, list[int]]], named_tensors: Iterable, version: str) -> None:
        """Every member gets `/update_weights` with the announced `update_info` while the trainer broadcasts
        `named_tensors` (in `metadata` order) once. The group is (re)built first when its membership changed: a
        server that came back, restarted (read from its version: no generation may have read it since), or joined."""
        timeout = self.settings.timeout
        live = self.client.live(timeout)
        if not live:
            raise RolloutError(f"weight sync: no server answers /health ({[s.url for s in self.client.servers]})")
        self.client.versions.refresh(self.client.submit)
        members = self.group.members if self.group else []
        current = self.client.versions.version
        restarted = [s for s in live if s.url in members and current is not None and s.version != current]
        if [s.url for s in live] != members or restarted:
            self.close_group()
            self.group = self._build_group(live)
        update_info = {
            "names": [name for name, _, _ in metadata],
            "dtype_names": [dtype for _, dtype, _ in metadata],
            "shapes": [list(shape) for _, _, shape in metadata],
        }
        took, failed = self._paused(
            live, lambda paused: self._update(paused, live, update_info, named_tensors, version)
        )
        self._finish("weight sync", version, took, failed)

    def _update(self, paused, live, update_info: dict, named_tensors: Iterable, version: str):
        timeout, post = self.settings.timeout, self.client.transport.post
        if len(paused) != len(live):
            raise RolloutError(f"weight sync: {len(live) - len(paused)} group member(s) did not pause")
        refused = self.client.each(paused, lambda s: post(s, "/start_weight_update", timeout, json={}), timeout)
        if refused:
            raise RolloutError(f"weight sync: /start_weight_update failed on {refused}; nothing was sent")
        load_timeout = self.client.load_timeout
        receiving = {
            s.url: self.client.submit(post, s, "/update_weights", load_timeout, {"update_info": update_info})
            for s in paused
        }
        failure = _broadcast(self.group.sender, named_tensors, receiving, self.client, time.monotonic() + load_timeout)
        if failure:
            self.close_group()
            raise RolloutError(
                f"weight broadcast abandoned: {failure}. Every rank finished its parameter walk; the next sync "
                "rebuilds the group without the servers that left"
            )

        def finish(server: ServerState) -> None:
            post(server, "/finish_weight_update", timeout, json={"weight_version": version})
            self._reset_prefix_cache(server)

        failed = self.client.each(paused, finish, timeout)
        return [s for s in paused if s.url not in failed], failed

    def _build_group(self, members: list[ServerState]) -> TransferGroup:
        from ..weight_transfer import group_layout, make_sender

        timeout = self.settings.timeout
        for server in members:
            response = self.client.transport.get(server, "/get_world_size", timeout=timeout)
            response.raise_for_status()
            server.world_size = int(response.json()["world_size"])
        world_size, offsets = group_layout([s.world_size for s in members])
        sender = make_sender(self.settings.backend, timeout)
        address, port = _trainer_address([s.url for s in members]), free_port()
        joining = {}
        for server, offset in zip(members, offsets):
            init_info = {"master_address": address, "master_port": port, "rank_offset": offset}
            init_info.update(world_size=world_size, **sender.wire())
            # It blocks in the rendezvous until the trainer joins: sent from a thread.
            joining[server.url] = self.client.submit(
                self.client.transport.post, server, "/init_weight_transfer_engine", timeout, {"init_info": init_info}
            )
        # A member that refuses the init (an older plugin, a bad layout) answers at once: fail then, naming it,
        # instead of waiting out the rendezvous (the abandoned join ends at its own timeout).
        joined = self.client.submit(sender.join, address, port, world_size)
        wait([joined, *joining.values()], timeout=timeout, return_when=FIRST_EXCEPTION)
        refused = {url: f.exception() for url, f in joining.items() if f.done() and f.exception() is not None}
        if refused:
            hint = ""
            if any("unpacked" in str(error) for error in refused.values()):
                hint = (
                    ": its trl-scale-vllm-plugin predates packed broadcasts. Fix: reinstall the plugin into vLLM's "
                    "environment (pip install ./vllm_plugin, or bash scripts/setup_vllm.sh)"
                )
            raise RolloutError(f"/init_weight_transfer_engine refused by {refused}{hint}")
        try:
            joined.result(timeout=0)
        except Exception as error:
            raise RolloutError(
                f"weight-transfer group of {world_size} ranks did not form within weight_sync_timeout={timeout}s "
                f"({error!r}); servers: {[s.url for s in members]}"
            ) from error
        for future in joining.values():
            future.result(timeout=timeout)
        logger.info("weight-transfer group: world size %d, offsets %s", world_size, dict(zip(joining, offsets)))
        return TransferGroup(sender, [s.url for s in members])

    def catch_up(self, server: ServerState, version: str) -> bool:
        return False  # a restarted member has no engine: the next sync rebuilds the group with it

    def close_group(self) -> None:
        if self.group is not None:
            self.group.sender.close()
        self.group = None

    def close(self) -> None:
        self.close_group()
        super().close()


def _broadcast(sender, named_tensors: Iterable, receiving: dict, client, deadline: float) -> str | None:
    """Broadcast `named_tensors` while the servers' `/update_weights` calls (`receiving`, futures by URL) receive.

    The parameter walk (`named_tensors`: ZeRO-3/FSDP gathers, collectives the other trainer ranks are in) runs here
    and always to its end; the sender runs on its own thread and is handed one tensor at a time, each still inside
    its gather until sent. So a receiver that fails, a broadcast that stalls (NCCL's has no timeout) or `deadline`
    passing abandons the sender without leaving any rank waiting. Returns what went wrong, or None."""
    handoff: queue.Queue = queue.Queue(maxsize=1)
    sent: queue.Queue = queue.Queue()

    def feed():
        while (item := handoff.get()) is not None:
            yield item
            sent.put(True)  # the sender asked for the next tensor: this one is out

    sending = client.submit(sender.send, feed())

    def trouble() -> str | None:
        failed = {url: f.exception() for url, f in receiving.items() if f.done() and f.exception() is not None}
        if failed:
            return f"/update_weights failed on {failed}"
        if sending.done() and sending.exception() is not None:
            return f"the trainer's broadcast failed ({sending.exception()!r})"
        if time.monotonic() > deadline:
            return "the broadcast did not finish within weight_load_timeout"
        return None

    failure = None
    for item in named_tensors:
        if failure is not None:
            continue  # keep walking: the other ranks' gathers need this one
        handoff.put(item)
        while failure is None:
            try:
                sent.get(timeout=0.05)
                break
            except queue.Empty:
                failure = trouble()
    try:
        handoff.put_nowait(None)
    except queue.Full:
        pass  # the sender is stuck with a tensor: it is abandoned
    while failure is None and not (sending.done() and all(f.done() for f in receiving.values())):
        failure = trouble()
        time.sleep(0.02)
    return failure or trouble()


def _trainer_address(urls: list[str]) -> str:
    """The address the servers reach the trainer at: loopback when they all run here, else the local address of
    the route to the first server."""
    hosts = [urlparse(url).hostname or "" for url in urls]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((hosts[0], 80))  # no packet is sent: this only picks the outgoing interface
        return probe.getsockname()[0]
