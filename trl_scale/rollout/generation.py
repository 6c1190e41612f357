"""`ServerRolloutGeneration`: the multi-server rollout client behind TRL's `vllm_generation` interface, so GRPO,
RLOO and PPO generate through it unchanged (`generate(...)` and `sync_weights()`).

It is TRL's `VLLMGeneration` with the single-server `VLLMClient` replaced: the parameter walk that gathers
ZeRO-3 shards, FSDP DTensors and merged PEFT weights under vLLM's names (`_iter_named_params`) is TRL's own.
Weight sync modes (`weight_sync`):

- `"nccl"`: one weight-transfer group over every server (vLLM's NCCL engine, which needs vLLM and CUDA in the
  trainer as TRL's does; `trl-scale serve` offers the same calls over gloo, so CPU trainers can use it there);
- `"shared_dir"`: safetensors under vLLM's names in a directory the servers read, reloaded with vLLM's
  `/collective_rpc reload_weights` (works from a CPU trainer against real vLLM);
- `"lora"`: the adapter only, a new name per sync, the superseded one unloaded;
- `"auto"`: `"nccl"` where every server offers an engine this trainer can drive, else `"shared_dir"`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from trl.generation.vllm_generation import VLLMGeneration

from ..logs import get_logger
from ..ranks import agree, broadcast_from_main, decide_on_leader, decide_on_main, gathered
from .ahead import CONVERSATION_KEY, GenerationAhead
from .client import SERVER_KEY, VERSION_PREFIX, RolloutClient, RolloutError
from .record import BatchRecords, GeneratedBatch
from .seeds import RequestSeeds
from .settings import RolloutSettings
from .weight_dir import WeightDirectory
from .weight_sync import PolicyWeights, SyncSettings, WeightSyncMode, choose_mode, weight_sync_for

logger = get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServersFit:
    """What the preflight found: the weight-sync mode the servers take, their engine backend ("nccl"), and the
    smallest context among them."""

    weight_sync: str
    backend: str | None
    max_model_len: int | None


class ServerRolloutGeneration(GenerationAhead, VLLMGeneration):
    def __init__(
        self,
        model,
        accelerator,
        processing_class,
        client: RolloutClient,
        settings: RolloutSettings,
        weight_dir: WeightDirectory | None = None,
        fleet=None,
    ):
        self.client = client
        self.settings = settings
        self.fleet = fleet  # managed servers (main process only): checked before each batch and sync
        self._sync_lock = threading.Lock()  # a sync and a restarted server's catch-up, one at a time
        if fleet is not None:
            fleet.on_moved = client.replace_url
            fleet.on_restarted = self.catch_up
        # Where shared_dir / lora syncs write (the main process's; None on the others): a directory of this run's own.
        self.weight_dir = weight_dir
        self.sync_mode: WeightSyncMode | None = None  # chosen in _init_vllm, from what the servers offer
        # The sampler's log-probs feed an importance-sampling correction: a choice without them is an error (TRL
        # would turn NaN into a ratio of 1, silently switching the correction off).
        self.require_logprobs = settings.require_logprobs
        self.server_max_model_len: int | None = None
        self._lora_served: tuple[str | None, int] = (None, 0)  # (lora_name, its sync count), swapped as one
        self.sync_count = 0
        self.records = BatchRecords()  # one per generated batch: its versions, sampler log-probs, conversations
        # a seed per request where generation_kwargs has one (`seeds.py`); batches numbered in the trainer's thread
        self.seeds = RequestSeeds.from_config(
            settings.sampling.get("seed"), settings.run_seed, getattr(accelerator, "process_index", 0)
        )
        # the sync count and the syncing flag change together (`_newest_reachable`); this generation's own: a class
        # lock made every trainer in a process wait on every other's syncs
        self._version_lock = threading.Lock()
        self.version: str | None = None  # the weights the servers serve, as the last sync named them
        # versions and adapter names never collide across runs or resumes
        self._run_id = settings.run_id or uuid.uuid4().hex[:8]
        super().__init__(
            model=model,
            accelerator=accelerator,
            processing_class=processing_class,
            mode="server",
            server_base_url=client.servers[0].url,
            server_timeout=settings.ready_timeout,
            max_completion_length=settings.max_completion_length,
            logprobs=0 if settings.logprobs else None,
        )

    # TRL's `_init_vllm` imports vLLM and builds its one-server client; ours waits for every server and checks
    # them against this run (`preflight`) before the first step.
    def _init_vllm(self) -> None:
        self.client.wait_until_ready(self.settings.ready_timeout)

        def preflight() -> ServersFit:
            try:
                return self._preflight()
            except Exception as error:  # a configuration problem, raised as one type on every rank
                raise ValueError(f"{type(error).__name__}: {error}") from error

        fit = decide_on_main(preflight)
        self.weight_sync, self.server_max_model_len = fit.weight_sync, fit.max_model_len
        if self.weight_sync == "nccl" and self.weight_dir is not None:  # "auto" chose a group: no directory needed
            self.weight_dir.release()
        pause_mode = "wait"  # a sync drains the servers, unless streaming, where it freezes or cuts running answers
        if self.settings.streaming:
            pause_mode = "keep" if self.settings.asynchronous.interrupt == "keep" else "abort"
        settings = SyncSettings(self.settings.weight_sync_timeout, self.weight_dir, fit.backend, pause_mode)
        self.sync_mode = weight_sync_for(self.weight_sync, self.client, settings)
        self.client.versions.reader = self.sync_mode.server_version

    def _preflight(self) -> ServersFit:
        """Every server inspected once; all problems raised together (one line each: server, flag, fix), warnings
        logged. Returns the weight-sync mode, the servers' engine backend for "nccl", and the smallest
        `max_model_len`."""
        from .preflight import RunNeeds, all_problems, check_vocabulary, inspect_all

        mode = self.settings.weight_sync
        model = self.accelerator.unwrap_model(self.model)
        peft_config = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
        needs = RunNeeds(
            weight_sync=mode,
            max_completion_length=self.settings.max_completion_length,
            importance_sampling=self.require_logprobs,
            sampling=self.settings.sampling,
            on_sampler_support=self.settings.on_sampler_support,
            lora_config=peft_config if mode == "lora" else None,
            vocab_size=model.config.get_text_config().vocab_size,
            streaming=self.settings.streaming,
        )
        reports = inspect_all(
            self.client.transport.get_url, self.client.transport.post_url, [s.url for s in self.client.servers]
        )
        for report in (r for r in reports if r.paused):  # no request would be answered there until a sync
            logger.warning("rollout server %s was paused (a trainer that ended during a weight sync leaves its "
                           "servers paused): resumed", report.url)  # fmt: skip
            self.client.transport.post_url(report.url, "/resume").raise_for_status()
            report.paused = False
        errors, warnings = all_problems(reports, needs)
        for report in reports:  # the one check that needs the policy: its vocabulary
            if report.reachable and needs.vocab_size:
                wrong_model = check_vocabulary(self.client.transport.complete_url, report, needs.vocab_size)
                errors += [wrong_model] if wrong_model else []
        backends = {r.weight_transfer for r in reports if r.reachable}
        if mode in ("nccl", "auto") and len(backends) > 1:
            errors.append(f"the servers offer different weight-transfer engines {sorted(map(str, backends))}")
        if errors:
            raise RolloutError(
                "the rollout servers cannot serve this run:\n  - " + "\n  - ".join(dict.fromkeys(errors))
            )
        for warning in dict.fromkeys(warnings):
            logger.warning(warning)
        lengths = [r.max_model_len for r in reports if r.max_model_len]
        backend = backends.pop() if len(backends) == 1 else None
        chosen = choose_mode(mode, backend)
        return ServersFit(chosen, backend if chosen == "nccl" else None, min(lengths) if lengths else None)

    # ---- generation -------------------------------------------------------------------------------------

    def _request(self, prompts, batch: int) -> list[list[dict]]:
        """One batch's completions from the servers: consecutive copies of a prompt (TRL's sampler puts a prompt's
        generations next to each other) go as one request with `n`, so the server batches them. Choices in order.
        `batch`: its number among the trainer's batches (each request's identity, with its place, for its seed)."""
        groups: list[list] = []
        for prompt in prompts:
            prompt = list(prompt)
            if groups and groups[-1][0] == prompt:
                groups[-1][1] += 1
            else:
                groups.append([prompt, 1])
        seeded = [self.seeds.sampling(self.settings.sampling, ("batch", batch, i)) for i in range(len(groups))]
        results = self.client.generate(
            [p for p, _ in groups], n=[n for _, n in groups], model=self.lora_name, per_request=seeded
        )
        return [choice for choices in results for choice in choices]

    def _request_from_fleet(self, prompts) -> list[dict]:
        batch = self.seeds.next_batch()
        return self._retried_after_fleet(lambda: self._request(prompts, batch))

    def _retried_after_fleet(self, request: Callable[[], T]) -> T:
        """`request()`; with managed servers, tried once more after the fleet has a server serving again: the only
        server can pass the fleet's check and die before the request reaches it."""
        try:
            return request()
        except RolloutError as error:
            if self.fleet is None:
                raise
            logger.warning("generation failed (%s); waiting for a managed server, then trying once more", error)
            self._check_fleet()
            return request()

    def close(self) -> None:
        """No more generation: the stream, the prefetch and the client's request threads stop (idle pool threads
        would otherwise keep a process that ends with `os._exit`, as the CLI's multi-process runs do, waiting)."""
        if self.read_ahead is not None:
            self.read_ahead.shutdown()
        self.client.close()

    def release_weight_dir(self) -> None:
        """Release what the sync mode holds (the weights it wrote, the directory's lock): the end of `train()`. The
        next sync takes it again."""
        with self._sync_lock:
            if self.sync_mode is not None:
                self.sync_mode.close()
            elif self.weight_dir is not None:
                self.weight_dir.release()

    @property
    def lora_name(self) -> str | None:
        """The adapter the servers serve now (`weight_sync="lora"`; None before its first sync, and otherwise)."""
        return self._lora_served[0]

    _syncing = False  # a weight sync is under way (streaming: running generations may reach its weights)

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        """Each rank sends its own prompts. With async rollout, a batch prefetched at most `staleness` syncs ago
        is served from its request, then the next batches are requested with the weights just synced."""
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("server rollout with images is not supported yet; use vLLM's own server mode")
        if self._serving is not None:
            choices, spans = self._streamed_choices(prompts)
        else:  # under sequence parallelism, one request per group: its ranks train on the same batch
            choices, spans = decide_on_leader(lambda: self._generated_choices(prompts), self.shared_with)
        completion_ids, logprobs = self.turn_outputs(choices)
        # a streamed tool-using group's conversations (its later turns were generated with it): the tool loop's
        conversations = tuple(choice.get(CONVERSATION_KEY) for choice in choices) if self.converses else None
        # TRL's RLOO drops the log-probs `generate` returns: its trl-scale correction reads them from the record
        self.records.add(GeneratedBatch(tuple(spans), tuple(logprobs), conversations))
        return generate_output(prompts, choices, completion_ids, logprobs)

    def turn_outputs(self, choices: list[dict]) -> tuple[list[list[int]], list[list[float]]]:
        """Each choice's completion ids and its tokens' sampler log-probs (NaN where none were asked for)."""
        completion_ids, logprobs = [], []
        for choice in choices:
            completion_ids.append(list(choice["token_ids"]))
            values = sampler_logprobs(choice) if self.logprobs is not None else None
            if values is None and self.require_logprobs:
                raise RolloutError(
                    f"{choice.get(SERVER_KEY, 'a server')} returned a completion without the log-probs asked for "
                    f"(logprobs=0): the importance-sampling correction needs them. Fix: serve with vLLM (or trl-scale "
                    "serve), whose /v1/completions returns them, or set vllm_importance_sampling_correction=False"
                )
            logprobs.append(values if values is not None else [float("nan")] * len(choice["token_ids"]))
        return completion_ids, logprobs

    def _generated_choices(self, prompts) -> tuple[list[dict], list[tuple[int, int]]]:
        """Generated now, or taken from a prefetched request ("ordered")."""
        self._check_fleet()
        reads_ahead = self.prefetcher is not None and not self._evaluating
        taken = self.prefetcher.take(prompts, self.sync_count) if reads_ahead else None
        if taken is not None:
            (choices, newest), version = taken
        else:
            choices, version = self._request_from_fleet(prompts), self.sync_count
            newest = version
        if self.prefetcher is not None:
            self.prefetcher.submit_upcoming(self.sync_count)
        return choices, [(version, newest)] * len(choices)

    def _check_fleet(self) -> None:
        """Managed servers: an error when none can serve any more; when they are the only servers and all are down
        but restarting, wait for one (the main process; the others wait in the sync's collectives)."""
        if self.fleet is None:
            return
        if len(self.client.servers) == self.fleet.spec.num_servers:
            self.fleet.wait_until_serving()
        else:
            self.fleet.check()

    # ---- weight sync ------------------------------------------------------------------------------------

    def catch_up(self, url: str) -> None:
        """A managed server that restarted serves its original weights: load the current ones into it now
        (`shared_dir`, `lora`), so it rejoins before the next sync. With a weight-transfer group (`nccl`) the next
        sync rebuilds the group with it; until then the router leaves it out. Never raises (a restart thread)."""
        with self._sync_lock:
            server = next((s for s in self.client.servers if s.url == url.rstrip("/")), None)
            if self.version is None or server is None or self.sync_mode is None:
                return  # before the first sync every server serves the initial weights
            try:
                if self.sync_mode.catch_up(server, self.version):
                    logger.warning("rollout server %s restarted and caught up to weights %s", url, self.version)
            except Exception as error:
                logger.warning("rollout server %s could not catch up (%r); the next sync brings it back", url, error)

    def sync_weights(self) -> None:
        """Push the policy's current weights to every server. Every rank walks the parameters (gathering shards
        is a collective); the main process sends. A failure on any rank fails the sync on every rank, naming that
        rank, instead of leaving the others waiting or going on. With managed servers a failed sync is tried once
        more, by every rank, after the fleet has a server serving again: one can pass the fleet's check and die
        before the weights reach it (its restart is then waited for, not taken for the end of the run)."""
        with self.phase("weight sync"):
            version = f"{VERSION_PREFIX}{self._run_id}-{self.sync_count + 1}"
            if self.read_ahead is not None:
                self.read_ahead.before_sync()
            with self._version_lock:
                self._syncing = True
            try:
                self._sync_with_retry(version)
            except BaseException:
                with self._version_lock:
                    self._syncing = False
                raise
            # one step: an answer finishing now reads the new count, not the old without the flag
            with self._version_lock:
                self.sync_count += 1
                self._syncing = False
            self.version = version
            if self.weight_sync == "lora":
                self._lora_served = (version, self.sync_count)
            self.client.versions.version = version  # every rank routes only to servers on this version

    def _sync_with_retry(self, version: str) -> None:
        try:
            self._sync_on_every_rank(version)
        except Exception as error:
            if not self.settings.managed:
                raise RolloutError(f"weight sync failed: {type(error).__name__}: {error}") from error
            logger.warning("weight sync failed (%s); waiting for a managed server, then trying once more", error)
            try:
                self._sync_on_every_rank(version)
            except Exception as again:
                raise RolloutError(f"weight sync failed: {type(again).__name__}: {again}") from again

    def _sync_on_every_rank(self, version: str) -> None:
        """One sync: every rank does its part (the parameter walk; the main process also sends), and a failure on
        any rank fails it on all of them, naming that rank (`agree`). Then every rank takes the main process's
        server list: a managed server restarted elsewhere has a new URL."""

        def this_rank() -> None:
            self._check_fleet()  # outside the lock: it may wait for a restart, whose catch-up takes the lock
            with self._sync_lock:
                self.sync_mode.sync(self._policy_weights(), version)

        agree(this_rank)
        current = [s.url for s in self.client.servers]
        for old, new in zip(current, broadcast_from_main(current)):
            if old != new:
                self.client.replace_url(old, new)

    def _policy_weights(self) -> PolicyWeights:
        """The policy's weights as the sync modes read them: TRL's walk under vLLM's names, and the adapter."""
        return PolicyWeights(
            named_tensors=self._iter_named_params,
            metadata=self._metadata,
            adapter=self._adapter,
            is_main=self.accelerator.is_main_process,
            models_in_use=lambda: set().union(*gathered(self.client.transport.models_in_use())),
        )

    def _metadata(self) -> list[tuple[str, str, list[int]]]:
        # The servers must know every tensor before the first is broadcast: walked once, then cached (as TRL does).
        if self._weight_metadata is None:
            self._weight_metadata = [
                (name, str(param.dtype).removeprefix("torch."), list(param.shape))
                for name, param in self._iter_named_params()
            ]
        return self._weight_metadata

    def _adapter(self) -> tuple[dict, object]:
        model = self.accelerator.unwrap_model(self.model)
        return adapter_state_dict(model), model.peft_config["default"]


def adapter_state_dict(model) -> dict:
    """The default adapter's tensors under PEFT's saved names, whole and on CPU. Under ZeRO-3 its partitions are
    gathered, under FSDP2 its DTensors: collectives, so every rank calls this, in the same order."""
    from contextlib import nullcontext

    from peft import get_peft_model_state_dict

    partitioned = [p for name, p in model.named_parameters() if "lora_" in name and hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    else:
        gather = nullcontext()
    with gather:
        state = get_peft_model_state_dict(model)
        whole = {}
        for name, tensor in state.items():
            if hasattr(tensor, "full_tensor"):  # an FSDP2 shard
                tensor = tensor.full_tensor()
            whole[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return whole


def sampler_logprobs(choice: dict) -> list[float] | None:
    """The sampled tokens' log-probs of one vLLM choice, one per completion token, or None where the server sent
    none (or not one per token)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(values, list) or len(values) != len(choice["token_ids"]) or any(v is None for v in values):
        return None
    return [float(v) for v in values]


def generate_output(prompts, choices: list[dict], completion_ids: list[list[int]], logprobs: list[list[float]]):
    """TRL's `VLLMGeneration.generate` return for `choices` (their `turn_outputs`): prompt ids, completion ids, and
    per-token log-probs and token ids, each token's a one-entry list as vLLM's `logprobs=0` gives them."""
    return (
        [list(p) for p in prompts],
        completion_ids,
        [[[v] for v in row] for row in logprobs],
        [[[t] for t in choice["token_ids"]] for choice in choices],
    )
