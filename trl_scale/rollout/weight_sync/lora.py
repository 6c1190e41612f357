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
    """An adapter's directory outlives its sync: vLLM evicts an adapter from its cache when it loads another
    (`--max-cpu-loras`, by default `--max-loras`: 1) and reads it again from its directory for the next request
    naming it, and a directory gone then kills the server's engine. So a directory is deleted only once its adapter
    is unloaded and no request out names it (a streaming generation abandoned by the stream may still run on it)."""

    name = "lora"
    current: str | None = None  # the directory of the adapter the servers hold (a restarted server loads it)

    def sync(self, weights: PolicyWeights, version: str) -> None:
        """Every rank gathers the adapter (a ZeRO-3 or FSDP2 policy holds only shards of it); the main process
        writes it as PEFT saves adapters and has the servers load it under `version`."""
        from safetensors.torch import save_file

        state, config = weights.adapter()
        named_elsewhere = weights.models_in_use()
        if not weights.is_main:
            return
        if self.settings.held is not None:
            self.settings.held.check_adapter(state)
        path = self.settings.weight_dir.new_version(version)
        config.save_pretrained(path)
        save_file(state, os.path.join(path, "adapter_model.safetensors"))
        self.load(version, path)
        self.current = path
        self._delete_unread(version, named_elsewhere)

    def _delete_unread(self, version: str, named_elsewhere: set[str]) -> None:
        """Delete the directories of this run's adapters the sync to `version` unloaded (`superseded`, the rule
        `_load` unloads by) that no request out names, here or on another rank (`named_elsewhere`, read as the sync
        began); the others wait for a later sync, or the end of the run. A directory is named as its adapter."""
        on_disk = {os.path.basename(path): path for path in self.settings.weight_dir.written}
        unloaded = set(superseded(list(on_disk), version, self.settings.keep_adapters))
        named = named_elsewhere | self.client.transport.models_in_use()
        self.settings.weight_dir.keep_only(*(p for n, p in on_disk.items() if n not in unloaded or n in named))

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
        """The end of the run: its directories go once no request out names their adapters (generations the stream
        abandoned end within one answer's time; vLLM drops a request whose connection closes, as at exit)."""
        on_disk = {os.path.basename(path) for path in self.settings.weight_dir.written}
        named = self.client.transport.wait_unused(on_disk, self.settings.timeout)
        if named:
            logger.warning(
                "weight sync (LoRA adapter): requests naming %s still out after weight_sync_timeout=%gs; deleting "
                "their directories anyway (a server that evicted one of these adapters cannot read it again)",
                sorted(named),
                self.settings.timeout,
            )
        self.current = None
        super().close()
