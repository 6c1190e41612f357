"""vLLM's weight-transfer routes (dev mode: `/init_weight_transfer_engine`, `/start_weight_update`,
`/update_weights`, `/finish_weight_update`) over trl-scale's gloo engine, the code real vLLM runs with trl-scale's
plugin (`trl_scale_vllm_plugin.gloo`): one member per rank of this server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anyio
import torch
from fastapi import FastAPI, HTTPException, Request
from trl_scale_vllm_plugin.gloo import BACKEND as GLOO_BACKEND
from trl_scale_vllm_plugin.gloo import GlooInitInfo, GlooUpdateInfo, open_gloo_group, receive

from .protocol import FinishRequest, json_body
from .served import ServedModel


def add_weight_routes(app: FastAPI, served: ServedModel) -> None:
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request):
        init_info = (await json_body(request)).get("init_info")
        if init_info is None:
            raise HTTPException(400, "Missing 'init_info' in request body")
        try:  # the same init_info as the vLLM plugin's engine takes
            info = GlooInitInfo(**init_info)
        except (TypeError, ValueError) as error:
            raise HTTPException(400, f"Invalid init_info for {GLOO_BACKEND}: {error}") from error
        ranks = served.settings.world_size
        if info.rank_offset + ranks > info.world_size:
            last = info.rank_offset + ranks - 1
            raise HTTPException(400, f"ranks {info.rank_offset}..{last} do not fit a group of {info.world_size}")
        return await anyio.to_thread.run_sync(open_engine, served, info)

    @app.post("/start_weight_update")
    def start_weight_update():
        served.updating = True
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(request: Request):
        update_info = (await json_body(request)).get("update_info")
        if update_info is None:
            raise HTTPException(400, "Missing 'update_info' in request body")
        if served.engine is None:
            raise HTTPException(400, "no weight-transfer engine: call /init_weight_transfer_engine first")
        if not served.updating:
            raise HTTPException(400, "call /start_weight_update before /update_weights")
        try:
            update = GlooUpdateInfo(**update_info)
        except (TypeError, ValueError) as error:
            raise HTTPException(400, f"Invalid update_info for {GLOO_BACKEND}: {error}") from error
        served.load_state_dict(await anyio.to_thread.run_sync(receive_weights, served, update))
        return {"message": "Weights updated"}

    @app.post("/finish_weight_update")
    def finish_weight_update(request: FinishRequest | None = None):
        served.updating = False
        if request is not None and request.weight_version is not None:
            served.weight_version = request.weight_version
        return {"message": "Weight update finished"}


def open_engine(served: ServedModel, info: GlooInitInfo) -> dict:
    """Join the trainer's group with one member per rank of this server (a TP x DP vLLM server has that many)."""
    address, port, offset, total = info.master_address, int(info.master_port), info.rank_offset, info.world_size
    ranks, timeout = served.settings.world_size, served.settings.weight_transfer_timeout
    with ThreadPoolExecutor(ranks) as pool:
        opened = list(pool.map(lambda r: open_gloo_group(address, port, offset + r, total, timeout), range(ranks)))
    served.engine = [group for group, _ in opened]
    served.engine_layout = {
        "rank_offset": offset,
        "world_size": total,
        "packed": info.packed,
        "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
    }
    return {"message": "Weight transfer initialized"}


def receive_weights(served: ServedModel, update: GlooUpdateInfo) -> dict[str, torch.Tensor]:
    """Every rank receives the broadcast; rank 0's tensors go into this (unsharded) model."""
    engine, timeout = served.engine, served.settings.weight_transfer_timeout
    wire = served.engine_layout["packed"], served.engine_layout["packed_buffer_size_bytes"]
    try:
        with ThreadPoolExecutor(len(engine)) as pool:
            per_rank = list(pool.map(lambda group: _received(group, update, timeout, *wire), engine))
    except Exception as error:  # a member left mid-broadcast: this group is over
        # Only this group: the trainer may have abandoned it and opened a new one before this receive failed.
        if served.engine is engine:
            served.engine = None
        raise HTTPException(500, f"weight broadcast failed: {error}") from error
    return per_rank[0]


def _received(group, update: GlooUpdateInfo, timeout: float, packed: bool, limit: int) -> dict[str, torch.Tensor]:
    return {name: tensor for bucket in receive(group, update, timeout, packed, limit) for name, tensor in bucket}
