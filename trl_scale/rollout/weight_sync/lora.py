"""`weight_sync="lora"`: only the adapter, as PEFT saves it, loaded by vLLM's `/v1/load_lora_adapter` under a new
name per sync (vLLM refuses a second load under one name unless in place, and keeps prefix blocks computed under the
old one); the superseded adapters are unloaded: ours from earlier syncs and from the run this one resumed (every name
with the `trl-scale-` prefix)."""

from __future__ import annotations

import os

from ...logs import get_logger
from ...routing import ServerState
from ..client import VERSION_PREFIX, RolloutError
from .base import PolicyWeights, WeightSyncMode

logger = get_logger(__name__)


def adapter_version(name: str) -> int:
    """The sync count an adapter's name carries (`<prefix><run>-<count>`)."""
    return int(name.rsplit("-", 1)[1])


def superseded(listed: list[str], current: str, keep: int) -> list[str]:
    """trl-scale's adapters a server lists that the sync to `current` unloads: every other run's, and this run's
    older ones but the newest `keep` (streaming generations still running on them)."""
    ours = [n for n in listed if n.startswith(VERSION_PREFIX) and n != current]
    run = current.rsplit("-", 1)[0]
    this_run = sorted((n for n in ours if n.rsplit("-", 1)[0] == run), key=adapter_version)
    kept = set(this_run[max(0, len(this_run) - keep) :]) if keep > 0 else set()
    return [n for n in ours if n not in kept]


class LoraSync(WeightSyncMode):
    name = "lora"
    current: str | None = None  # the directory of the adapter the servers hold (a restarted server loads it)

    def sync(self, weights: PolicyWeights, version: str) -> None:
        """Every rank gathers the adapter (a ZeRO-3 or FSDP2 policy holds only shards of it); the main process
        writes it as PEFT saves adapters and has the servers load it under `version`."""
        from safetensors.torch import save_file

        state, config = weights.adapter()
        if not weights.is_main:
            return
        path = self.settings.weight_dir.new_version(version)
        config.save_pretrained(path)
        save_file(state, os.path.join(path, "adapter_model.safetensors"))
        self.load(version, path)
        self.current = path
        self.settings.weight_dir.keep_only(path)

    def load(self, name: str, path: str) -> None:
        """Every live server loads the adapter at `path` as `name` (its version)."""
        live = self.client.live(self.settings.timeout)
        timeout = self.client.load_timeout + 2 * self.settings.timeout
        failed = self.client.each(live, lambda s: self._load(s, name, path), timeout)
        self._finish("weight sync (LoRA adapter)", name, [s for s in live if s.url not in failed], failed)

    def _load(self, server: ServerState, name: str, path: str) -> None:
        timeout = self.settings.timeout
        body = {"lora_name": name, "lora_path": path, "load_inplace": False}
        self.client.transport.post(server, "/v1/load_lora_adapter", self.client.load_timeout, json=body)
        listed = self.client.transport.get(server, "/v1/models", timeout=timeout).json()["data"][1:]
        for old in superseded([m["id"] for m in listed], name, self.settings.keep_adapters):
            try:
                self.client.transport.post(server, "/v1/unload_lora_adapter", timeout, json={"lora_name": old})
            except RolloutError as error:  # gone meanwhile: nothing to free
                logger.info("unloading adapter %s on %s: %s", old, server.url, error)

    def catch_up(self, server: ServerState, version: str) -> bool:
        """One restarted server loads the current adapter and rejoins without waiting for the next sync."""
        if self.current is None:
            return False
        self._load(server, version, self.current)
        self.client.versions.rejoin(server, version)
        return True

    def server_version(self, server: ServerState) -> str | None:
        """A server's version is the newest of our adapters it lists (none after a restart)."""
        response = self.client.transport.get(server, "/v1/models", timeout=5)
        response.raise_for_status()
        ids = [m["id"] for m in response.json()["data"][1:]]
        return next((i for i in reversed(ids) if i == self.client.versions.version), ids[-1] if ids else None)

    def close(self) -> None:
        self.current = None
        super().close()
