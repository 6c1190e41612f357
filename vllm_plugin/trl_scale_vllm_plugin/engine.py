"""The vLLM worker side of the `trl_scale_gloo` backend: vLLM 0.32's `WeightTransferEngine` contract
(`distributed/weight_transfer/base.py`), with the layerwise reload lifecycle its NCCL engine uses
(`nccl_engine.py`: start/finish wrap `initialize_layerwise_reload`/`finalize_layerwise_reload`, each received
bucket goes through one `model.load_weights`, packed or not as the trainer's init_info says)."""

from __future__ import annotations

import os

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from .gloo import BUFFER_BYTES, GlooInitInfo, GlooUpdateInfo, open_gloo_group, receive

# Seconds any collective of the group may take; a dead trainer fails the worker's receive instead of hanging it.
TIMEOUT = float(os.environ.get("TRL_SCALE_WEIGHT_TRANSFER_TIMEOUT", "300"))


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = self._store = None
        self.packed, self.buffer_bytes = False, BUFFER_BYTES

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # This worker's rank, as vLLM's NCCL engine computes it (nccl_common.worker_init_process_group).
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.shutdown()
        self.packed, self.buffer_bytes = init_info.packed, init_info.packed_buffer_size_bytes
        self.group, self._store = open_gloo_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            TIMEOUT,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which needs an accelerator; gloo is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("trl_scale_gloo weight transfer not initialized: call /init_weight_transfer_engine")
        try:
            for bucket in receive(self.group, update_info, TIMEOUT, self.packed, self.buffer_bytes):
                self.model.load_weights([(name, tensor.to(self.device)) for name, tensor in bucket])
        except Exception:
            self.shutdown()  # a member left mid-broadcast: this group is over, the trainer rebuilds it
            raise

    def shutdown(self) -> None:
        self.group = self._store = None
