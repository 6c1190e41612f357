"""The one interface every weight-sync mode implements, and what they share.

A mode is built from the router (`RolloutClient`) and typed `SyncSettings`, owns its state (the weights directory,
the current copy, the weight-transfer group), and offers the same four methods:

- `sync(weights, version)`: on every rank (the parameter walk gathers shards; the main process also writes or sends),
  bring every live server to `version`, between a pause and a resume, and record which servers took it;
- `catch_up(server, version)`: on the main process, bring one restarted server to the current weights without
  waiting for the next sync (False where the mode cannot: the next sync rebuilds);
- `server_version(server)`: the version a server reports (the router keeps only current servers in the rotation);
- `close()`: what the mode holds, released (the end of `train()`; the next sync takes it again).

`PolicyWeights` is what a mode reads from the trainer: callables, so a mode never reaches into the trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from ...logs import get_logger
from ...routing import ServerState
from ..client import RolloutClient, RolloutError
from ..weight_dir import WeightDirectory
from ..weight_names import ServerWeights

logger = get_logger(__name__)


@dataclass(frozen=True)
class PolicyWeights:
    """The policy's weights as a sync reads them, on every rank."""

    named_tensors: Callable[[], Iterator]  # (vLLM name, whole tensor), one at a time; a collective walk
    metadata: Callable[[], list[tuple[str, str, list[int]]]]  # (name, dtype, shape) of every tensor, in walk order
    adapter: Callable[[], tuple[dict, object]] | None = None  # LoRA: (adapter tensors by PEFT name, its config)
    is_main: bool = True  # the process that talks to the servers
    # The models (LoRA adapters) completion requests out name, on every rank: each data-parallel rank sends its own.
    # A collective, as `adapter` is: every rank calls it, in the same order.
    models_in_use: Callable[[], set[str]] = set

    @classmethod
    def of_state_dict(cls, state: dict) -> PolicyWeights:
        """A whole state dict held by one process (tools, tests)."""
        metadata = [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]
        return cls(named_tensors=lambda: iter(state.items()), metadata=lambda: metadata)


@dataclass(frozen=True)
class SyncSettings:
    timeout: float = 120.0  # weight_sync_timeout: control calls, and each broadcast collective
    weight_dir: WeightDirectory | None = None  # shared_dir / lora: where this run writes (the main process's)
    backend: str | None = None  # nccl: the servers' weight-transfer engine
    # "wait": a sync drains the running generations first (each finishes with the weights it started with);
    # "keep": it freezes them between two decoding steps, and they go on with the new weights (streaming rollout)
    # "abort": it cuts them (vLLM returns the tokens so far), and the client continues each after the sync
    pause_mode: Literal["wait", "keep", "abort"] = "wait"
    # lora: superseded adapters left loaded (streaming: a generation keeps the adapter it started with, up to
    # `async_rollout_staleness` syncs)
    keep_adapters: int = 0
    # the servers' weights as their loader names them: every sync checks that each tensor it sends lands there
    held: ServerWeights | None = None


class WeightSyncMode(ABC):
    """See the module docstring."""

    name: ClassVar[str]

    def __init__(self, client: RolloutClient, settings: SyncSettings | None = None):
        self.client = client
        self.settings = settings or SyncSettings()
        self._missed: set[str] = set()  # servers the last syncs did not reach (said once, not at every sync)

    @abstractmethod
    def sync(self, weights: PolicyWeights, version: str) -> None: ...

    @abstractmethod
    def catch_up(self, server: ServerState, version: str) -> bool: ...

    def server_version(self, server: ServerState) -> str | None:
        return self.client.weight_version(server)

    def close(self) -> None:
        if self.settings.weight_dir is not None:
            self.settings.weight_dir.release()

    # ---- shared steps -----------------------------------------------------------------------------------

    def _check_placement(self, sent) -> None:
        """Every (name, shape) this sync sends lands on a weight the servers hold, and each of theirs gets one (the
        main process, before anything is sent): a name the server's loader does not know is skipped there
        silently, so it is refused here, named."""
        if self.settings.held is not None:
            self.settings.held.check(sent, f"weight sync ({self.name})")

    def _paused(self, servers: list[ServerState], work: Callable[[list[ServerState]], object]):
        """`/pause`, `work(paused servers)`, then `/resume` on every paused server, also when the work failed.
        "wait" lets the generations a server has started finish with the weights they started with; "keep" freezes
        them and they finish with the new weights (a completion sampled from two versions, each token's sampler
        log-prob that of the weights that drew it; which tokens came from which depends on timing); "abort" cuts
        them (answered with the tokens so far; the client continues each after the sync: a partial rollout). Requests
        not yet admitted wait for the resume in every mode.
        `work` returns ``(servers that took the weights, {url: why not})``; so does this, with the servers that
        refused the pause among the second (a server that answers but refuses `/pause` is named with its status,
        not taken for a server that is down)."""
        timeout = self.settings.timeout
        refused = self.client.each(servers, self._pause, timeout)
        paused = [s for s in servers if s.url not in refused]
        try:
            took, failed = work(paused)
        except RolloutError as error:
            if refused:  # the work may need every server (a group): say which refused the pause, and why
                raise RolloutError(f"{error}; refused /pause: {refused}") from error
            raise
        finally:
            self.client.each(paused, lambda s: self.client.transport.post(s, "/resume", timeout), timeout)
        return took, {**refused, **failed}

    def _pause(self, server: ServerState) -> None:
        if self.settings.pause_mode in ("keep", "abort"):  # returns at once, between two decoding steps
            try:
                self.client.transport.post(server, f"/pause?mode={self.settings.pause_mode}", self.settings.timeout)
            except RolloutError as error:
                if self.settings.pause_mode == "keep" and " answered 422" in str(error):
                    raise RolloutError(
                        f"{error}. This server does not take /pause?mode=keep (freezing running answers across a "
                        "sync). Fix: async_rollout_interrupt='partial' (running answers are cut at a sync and "
                        "continued after it), or a vLLM whose /pause takes mode=keep"
                    ) from error
                raise
            return
        # It returns once the server's running generations have finished: bounded as one generation is.
        generation = self.client.generation_timeout
        self.client.transport.post(server, "/pause?mode=wait", None if generation is None else 30.0 + generation)

    def _reset_prefix_cache(self, server: ServerState) -> None:
        """vLLM V1 keeps prefix caching on: blocks computed with the old weights must not be reused. A reset vLLM
        refuses (`success: false`, blocks still held) is an error, not a silent reuse. Generations frozen by a "keep"
        pause go on with the new weights either way (`tests/test_real_vllm.py`)."""
        response = self.client.transport.post(server, "/reset_prefix_cache", self.settings.timeout)
        try:
            success = response.json().get("success", True)
        except (ValueError, AttributeError):  # an older server answers with no body
            success = True
        if success is False:
            raise RolloutError(
                f"{server.url}: vLLM did not reset its prefix cache after the weight change (blocks still held), so "
                "new requests could reuse keys and values of the old weights"
            )

    def _finish(self, what: str, version: str, took: list[ServerState], failed: dict[str, str]) -> None:
        """Record the new version; servers that did not take it stay out of the rotation until a sync does."""
        self.client.versions.record_sync(version, took)
        if not took:
            why = "; ".join(f"{url}: {reason}" for url, reason in failed.items())
            raise RolloutError(
                f"{what} reached no server: {why or 'none answers /health (all servers down)'} "
                f"(weight_sync_timeout={self.settings.timeout}s)"
            )
        missed = {s.url for s in self.client.servers if s not in took}
        if missed - self._missed:
            logger.warning(
                "%s did not reach %s (%s); they stay out of the rotation until a sync reaches them",
                what,
                sorted(missed - self._missed),
                failed,
            )
        if self._missed - missed:
            logger.info("%s reached %s again; back in the rotation", what, sorted(self._missed - missed))
        self._missed = missed
