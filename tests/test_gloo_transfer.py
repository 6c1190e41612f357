"""The `trl_scale_gloo` weight transfer's wire (`trl_scale_vllm_plugin.gloo`, the code real vLLM's plugin, `trl-scale
serve` and the trainer run): buckets cut by vLLM's packed rule, every tensor delivered bit for bit packed or not
(mixed dtypes, offsets a wider type cannot view, a scalar, a non-contiguous tensor), a receiver that loads nothing
before its bucket's broadcasts are over (so no member waits on another's load), and a server refusing the init
named at once. Real gloo groups over 127.0.0.1, three ranks in threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from trl_scale_vllm_plugin.gloo import GlooInitInfo, GlooUpdateInfo, buckets, open_gloo_group, receive, send

from .helpers import free_port, plain_http_server

TIMEOUT = 20.0


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "odd": torch.tensor([True, False, True]),  # 3 bytes: what follows starts off every wider alignment
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ids": torch.arange(7, dtype=torch.int64),
        "transposed": torch.randn(4, 6).t(),  # not contiguous on the sender
        "fp32": torch.randn(33),
    }


class Counting:
    """A gloo group that counts its broadcasts."""

    def __init__(self, group):
        self.group, self.broadcasts = group, 0

    def broadcast(self, *args):
        self.broadcasts += 1
        return self.group.broadcast(*args)


def _groups(world_size: int = 3) -> tuple[list, list]:
    """Counting groups of every rank, and their stores (kept alive as long as the groups)."""
    port, opened = free_port(), [None] * world_size

    def join(rank: int) -> None:
        opened[rank] = open_gloo_group("127.0.0.1", port, rank, world_size, TIMEOUT)

    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    return [Counting(group) for group, _store in opened], [store for _group, store in opened]


def _update(tensors: dict[str, torch.Tensor]) -> GlooUpdateInfo:
    return GlooUpdateInfo(
        names=list(tensors),
        dtype_names=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        shapes=[list(t.shape) for t in tensors.values()],
    )


def test_buckets_close_once_they_hold_more_than_the_limit():
    """vLLM's packed rule (`packed_tensor.py`): a tensor joins the open bucket, which closes once it holds more than
    the limit; a tensor larger than the limit closes its bucket alone."""
    assert buckets([4, 4, 4], 6) == [range(0, 2), range(2, 3)]
    assert buckets([10, 1, 1], 6) == [range(0, 1), range(1, 3)]
    assert buckets([3, 3], 6) == [range(0, 2)]
    assert buckets([3, 3, 1], 6) == [range(0, 3)]  # holding exactly the limit keeps it open
    assert buckets([], 6) == []


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("limit", [40, 1024**3])
def test_every_tensor_arrives_bit_for_bit_in_the_announced_buckets(packed, limit):
    """Two receivers and the sender: each receiver gets every tensor with its name, dtype, shape and bits, in buckets
    cut as `buckets` cuts them; packed, one broadcast per bucket, unpacked one per tensor."""
    tensors = _tensors()
    update = _update(tensors)
    groups, stores = _groups()
    got: dict[int, list] = {}

    def receiver(rank: int) -> None:
        got[rank] = list(receive(groups[rank], update, TIMEOUT, packed, limit))

    threads = [threading.Thread(target=receiver, args=(rank,), daemon=True) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    send(groups[0], iter(tensors.values()), TIMEOUT, packed, limit)
    for thread in threads:
        thread.join(TIMEOUT)
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    expected_buckets = [[update.names[i] for i in bucket] for bucket in buckets(sizes, limit)]
    assert (len(expected_buckets) > 1) == (limit == 40)
    for rank in (1, 2):
        assert [[name for name, _ in bucket] for bucket in got[rank]] == expected_buckets
        for name, tensor in (item for bucket in got[rank] for item in bucket):
            sent = tensors[name]
            assert tensor.dtype == sent.dtype and tensor.shape == sent.shape, name
            assert torch.equal(tensor, sent), name
        assert groups[rank].broadcasts == (len(expected_buckets) if packed else len(tensors))
    assert groups[0].broadcasts == groups[1].broadcasts
    del stores


@pytest.mark.parametrize("packed", [True, False])
def test_a_receiver_takes_a_whole_bucket_before_loading_any_of_it(packed):
    """The sender's broadcasts of a bucket never wait on a receiver loading part of it: here the receiver's load
    waits until the sender has returned. Loading each tensor between broadcasts (before the fix) held the sender,
    and every other server, at the second tensor until this load ended: a deadlock here, ended by the timeout."""
    tensors = _tensors()
    update = _update(tensors)
    groups, stores = _groups(2)
    sender_done, loaded = threading.Event(), []

    def receiver() -> None:
        for bucket in receive(groups[1], update, 5.0, packed):
            sender_done.wait(10)
            loaded.append([name for name, _ in bucket])

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    try:
        send(groups[0], iter(tensors.values()), 5.0, packed)
    finally:
        sender_done.set()
        thread.join(TIMEOUT)
    assert loaded == [list(tensors)]
    del stores


def test_the_init_info_takes_vllms_packed_fields_and_checks_the_bucket_size():
    info = GlooInitInfo("127.0.0.1", 1, 1, 2, packed=True, packed_buffer_size_bytes=4096)
    assert info.packed and info.packed_buffer_size_bytes == 4096
    for bad in (0, -1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="packed_buffer_size_bytes=.*whole number of bytes >= 1"):
            GlooInitInfo("127.0.0.1", 1, 1, 2, packed=True, packed_buffer_size_bytes=bad)


def test_a_server_refusing_packed_broadcasts_is_named_at_once_with_the_fix():
    """A server whose plugin predates packed broadcasts answers the init with an error at once: the sync fails then,
    naming it and the fix, instead of waiting out the rendezvous (weight_sync_timeout)."""
    from trl_scale.rollout import RolloutClient, RolloutError
    from trl_scale.rollout.weight_sync import GroupSync, SyncSettings

    refusal = b'{"detail":"the trl_scale_gloo engine takes unpacked broadcasts: send packed=false"}'
    routes = {"/get_world_size": (200, b'{"world_size": 1}'), "/init_weight_transfer_engine": (400, refusal)}
    with plain_http_server(200, b"{}", routes) as url:
        client = RolloutClient([url], request_timeout=60)
        sync = GroupSync(client, SyncSettings(timeout=60, backend="trl_scale_gloo"))
        started = time.monotonic()
        try:
            with pytest.raises(RolloutError, match=r"refused by .*unpacked.*reinstall the plugin"):
                sync._build_group(client.servers)
        finally:
            client.close()
        assert time.monotonic() - started < 15
