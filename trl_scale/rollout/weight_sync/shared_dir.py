"""`weight_sync="shared_dir"`: safetensors under vLLM's names in a directory every server reads (this run's own,
`WeightDirectory`), loaded with vLLM's `/collective_rpc reload_weights`, between a pause and a resume."""

from __future__ import annotations

import os

from ...routing import ServerState
from .base import PolicyWeights, WeightSyncMode


class SharedDirSync(WeightSyncMode):
    name = "shared_dir"
    current: str | None = None  # the directory of the weights the servers hold (a restarted server loads it)

    def sync(self, weights: PolicyWeights, version: str) -> None:
        from safetensors.torch import save_file

        state = {}
        for name, tensor in weights.named_tensors():
            if weights.is_main:  # a copy: a gathered ZeRO-3 parameter is released when the walk moves on
                state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if not weights.is_main:
            return
        self._check_placement((name, tensor.shape) for name, tensor in state.items())
        # A fresh directory per sync, written completely before any server reads it; this run's previous one is
        # removed once the servers have loaded it (nothing the run did not write).
        directory = self.settings.weight_dir.new_version(f"weights-{version}")
        save_file(state, os.path.join(directory, "model.safetensors"))
        self.reload(directory, version)
        self.current = directory
        self.settings.weight_dir.keep_only(directory)

    def reload(self, path: str, version: str) -> None:
        """Every live server reloads the weights saved at `path` (its own parameter names), paused meanwhile."""

        def work(paused: list[ServerState]):
            failed = self.client.each(paused, lambda s: self._reload(s, path, version), self._load_timeout())
            return [s for s in paused if s.url not in failed], failed

        took, failed = self._paused(self.client.live(self.settings.timeout), work)
        self._finish("weight sync (shared directory)", version, took, failed)

    def _load_timeout(self) -> float:
        return self.client.load_timeout + 2 * self.settings.timeout

    def _reload(self, server: ServerState, path: str, version: str) -> None:
        body = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        self.client.transport.post(server, "/collective_rpc", self.client.load_timeout, json=body)
        self.client.transport.post(
            server, "/update_weight_version", self.settings.timeout, json={"new_version": version}
        )
        self._reset_prefix_cache(server)

    def catch_up(self, server: ServerState, version: str) -> bool:
        """One server that restarted (so is out of the rotation, with nothing in flight) loads the current weights
        and rejoins without waiting for the next sync."""
        if self.current is None:
            return False
        self._reload(server, self.current, version)
        self.client.versions.rejoin(server, version)
        return True

    def close(self) -> None:
        self.current = None
        super().close()
