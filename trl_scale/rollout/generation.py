"""`ServerRolloutGeneration`: the multi-server rollout client behind TRL's `vllm_generation` interface, so GRPO,
RLOO and PPO generate through it unchanged (`generate(...)` and `sync_weights()`).

It is TRL's `VLLMGeneration` with the single-server `VLLMClient` replaced: the parameter walk that gathers
ZeRO-3 shards, FSDP DTensors and merged PEFT weights (`_iter_named_params`) is TRL's own, its names made the
checkpoint's (`weight_names.CheckpointNamedWalk`).
Weight sync modes (`weight_sync`):

- `"nccl"`: one weight-transfer group over every server (vLLM's NCCL engine, which needs vLLM and CUDA in the
  trainer as TRL's does; `trl-scale serve` offers the same calls over gloo, so CPU trainers can use it there);
- `"shared_dir"`: safetensors under vLLM's names in a directory the servers read, reloaded with vLLM's
  `/collective_rpc reload_weights` (works from a CPU trainer against real vLLM);
- `"lora"`: the adapter only, a new name per sync, the superseded one unloaded;
- `"auto"`: `"nccl"` where every server offers an engine this trainer can drive, else `"shared_dir"`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

from trl.generation.vllm_generation import VLLMGeneration

from ..checkpoint_names import conversion_model
from ..logs import get_logger
from ..ranks import decide_on_leader, decide_on_main, gathered
from .ahead import CONVERSATION_KEY, READ_AHEAD_ENGINES, Converse, ReadAheadRollout
from .choices import generate_output, sampled_routes, sampler_logprobs
from .client import SERVER_KEY, RolloutClient, RolloutError
from .images import image_keys, image_urls
from .record import GeneratedBatch
from .seeds import RequestSeeds, next_identity
from .settings import RolloutSettings
from .step_state import StepScope
from .syncer import WeightSyncer
from .weight_dir import WeightDirectory
from .weight_names import CheckpointNamedWalk, ServerWeights, buffer_names, server_weights
from .weight_sync import PolicyWeights, SyncSettings, choose_mode, weight_sync_for

logger = get_logger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class ServersFit:
    """What the preflight found: the weight-sync mode the servers take, their engine backend ("nccl"), and the
    smallest context among them."""

    weight_sync: str
    backend: str | None
    max_model_len: int | None
    held: ServerWeights | None = None  # the servers' weights, as their loader names them (None: not readable here)


class ServerRolloutGeneration(CheckpointNamedWalk, VLLMGeneration):
    """TRL's generation interface over trl-scale's client. It holds a weight syncer (`syncer`: the servers'
    weights, their version and count) and, for an asynchronous run, a read-ahead rollout (`ahead`: the engine of
    its mode and what TRL's calls take from it); it makes the requests both use."""

    ahead: ReadAheadRollout | None = None  # asynchronous rollout (`enable_async`); None: synchronous
    shared_with = None  # the sequence-parallel group's process group: its rank 0 generates for it (`share_with`)
    # The trainer's phase clock (`trl_scale.timeline.PhaseClock.phase`, given by the constructor): a weight sync and a
    # wait for streamed groups are phases of the trainer's time.
    phase = staticmethod(lambda name: nullcontext())

    def __init__(
        self,
        model,
        accelerator,
        processing_class,
        client: RolloutClient,
        settings: RolloutSettings,
        weight_dir: WeightDirectory | None = None,
        fleet=None,
        phase=None,
        steps: StepScope | None = None,
    ):
        if phase is not None:
            self.phase = phase
        self.client = client
        self.settings = settings
        self.fleet = fleet  # managed servers (main process only): checked before each batch and sync
        self.syncer = WeightSyncer(client, settings.run_id or uuid.uuid4().hex[:8], weight_dir, settings.managed)
        if fleet is not None:  # a restarted server: at its new address, brought to the weights served now
            fleet.listen(on_moved=client.replace_url, on_restarted=self.syncer.catch_up)
        # The sampler's log-probs feed an importance-sampling correction: a choice without them is an error (TRL
        # would turn NaN into a ratio of 1, silently switching the correction off).
        self.require_logprobs = settings.require_logprobs
        self.server_max_model_len: int | None = None
        # the run's step states: a batch's record goes to its build's, a streamed batch is taken from it
        self.steps = steps if steps is not None else StepScope()
        # a seed per request where generation_kwargs has one (`seeds.py`); batches numbered in the trainer's thread
        self.seeds = RequestSeeds.from_config(
            settings.sampling.get("seed"), settings.run_seed, getattr(accelerator, "process_index", 0)
        )
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
        self.server_max_model_len = fit.max_model_len
        weight_dir = self.syncer.weight_dir
        if fit.weight_sync == "nccl" and weight_dir is not None:  # "auto" chose a group: no directory needed
            weight_dir.release()
        pause_mode = "wait"  # a sync drains the servers, unless streaming, where it freezes or cuts running answers
        keep_adapters = 0  # LoRA: the adapters running generations may still use stay loaded (streaming)
        if self.settings.streaming:
            pause_mode = "keep" if self.settings.asynchronous.interrupt == "keep" else "abort"
            keep_adapters = self.settings.asynchronous.staleness
        settings = SyncSettings(
            self.settings.weight_sync_timeout, weight_dir, fit.backend, pause_mode, keep_adapters, held=fit.held
        )
        self.syncer.choose(weight_sync_for(fit.weight_sync, self.client, settings))

    def _preflight(self) -> ServersFit:
        """Every server inspected once; all problems raised together (one line each: server, flag, fix), warnings
        logged. Returns the weight-sync mode, the servers' engine backend for "nccl", and the smallest
        `max_model_len`."""
        from .preflight import RunNeeds, all_problems, check_tokenizer, check_vocabulary, inspect_all

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
            routes=self.settings.routing_replay,
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
        from transformers import ProcessorMixin

        tokenizer = self.processing_class  # a processor holds one
        tokenizer = tokenizer.tokenizer if isinstance(tokenizer, ProcessorMixin) else tokenizer
        for report in (r for r in reports if r.reachable):  # the checks that need the policy: vocabulary, tokenizer
            transport = self.client.transport
            if needs.vocab_size:
                errors += [p for p in (check_vocabulary(transport.complete_url, report, needs.vocab_size),) if p]
            errors += [p for p in (check_tokenizer(transport.prompt_ids_url, report, tokenizer),) if p]
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
        # what a sync must land on: the checkpoint a server loaded where it is readable here, else the policy's own
        paths = [r.model_path for r in reports if r.reachable] + [conversion_model(model).name_or_path]
        held = server_weights(paths, buffer_names(conversion_model(model)))
        return ServersFit(chosen, backend if chosen == "nccl" else None, min(lengths) if lengths else None, held)

    # ---- generation -------------------------------------------------------------------------------------

    def _request(self, prompts, batch: int, images=None) -> list[list[dict]]:
        """One batch's completions from the servers: consecutive copies of a prompt (TRL's sampler puts a prompt's
        generations next to each other) go as one request with `n`, so the server batches them. Choices in order.
        `batch`: its number among the trainer's batches (each request's identity, with its place, for its seed).
        `images` (TRL's, one entry per row): each group's images rendered once into features that go with its
        request (a copy's images are its prompt's: equal ids with other images are another group)."""
        images = images if images is not None else [None] * len(prompts)
        groups: list[list] = []
        for row, (prompt, key) in enumerate(zip(prompts, image_keys(images), strict=True)):
            prompt = list(prompt)
            if groups and groups[-1][0] == prompt and groups[-1][2] == key:
                groups[-1][1] += 1
            else:
                groups.append([prompt, 1, key, row])
        seeded = [self.seeds.sampling(self.settings.sampling, ("batch", batch, i)) for i in range(len(groups))]
        # each group's own dict (without a seed, `sampling` hands back one dict for all of them)
        seeded = [
            {**extra, "features": self.client.render(list(image_urls(images[row])), row)} if key else extra
            for extra, (_, _, key, row) in zip(seeded, groups)
        ]
        results = self.client.generate(
            [g[0] for g in groups], n=[g[1] for g in groups], model=self.syncer.lora_name, per_request=seeded
        )
        return [choice for choices in results for choice in choices]

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
        if self.ahead is not None:
            self.ahead.shutdown()
        self.client.close()

    @property
    def sync_count(self) -> int:
        """The weight syncs done (the servers serve the weights of the last)."""
        return self.syncer.count

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        """Each rank sends its own prompts. With async rollout, a batch prefetched at most `staleness` syncs ago
        is served from its request, then the next batches are requested with the weights just synced."""
        images = images if images is not None and any(row for row in images) else None
        ahead, state = self.ahead, self.steps.current
        streamed = state.streamed.take_if_given() if state is not None else None
        if streamed is not None:  # streaming: each group's images went with its request
            choices, spans = streamed.answer(prompts)
        else:  # under sequence parallelism, one request per group: its ranks train on the same batch
            choices, spans = decide_on_leader(lambda: self._generated_choices(prompts, images), self.shared_with)
        completion_ids, logprobs = self.turn_outputs(choices)
        # a streamed tool-using group's conversations (its later turns were generated with it): the tool loop's
        converses = ahead is not None and ahead.converses
        conversations = tuple(choice.get(CONVERSATION_KEY) for choice in choices) if converses else None
        # TRL's RLOO drops the log-probs `generate` returns: its trl-scale correction reads them from the record
        servers = tuple(choice.get(SERVER_KEY) for choice in choices)
        if state is not None:
            routes = sampled_routes(choices)
            state.records.add(GeneratedBatch(tuple(spans), tuple(logprobs), conversations, servers, routes))
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

    def _generated_choices(self, prompts, images=None) -> tuple[list[dict], list[tuple[int, int]]]:
        """Generated now, or taken from a prefetched request ("ordered"); `images`: TRL's, per row (synchronous)."""
        self._check_fleet()
        prefetcher = self.ahead.prefetcher if self.ahead is not None else None
        reads_ahead = prefetcher is not None and not self.ahead.evaluating_now
        taken = prefetcher.take(prompts, self.sync_count, images) if reads_ahead else None
        if taken is not None:
            (choices, newest), version = taken
        else:
            batch = self.seeds.next_batch()
            choices = self._retried_after_fleet(lambda: self._request(prompts, batch, images))
            version = newest = self.sync_count
        if prefetcher is not None:
            prefetcher.submit_upcoming(self.sync_count)
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

    # ---- asynchronous rollout: the read-ahead engine, and the requests it makes --------------------------------

    def enable_async(
        self,
        tokenize,
        groups_per_batch: int | None = None,
        converse: Converse | None = None,
        reward=None,
        open_episode=None,
        rollout=None,
    ) -> ReadAheadRollout:
        """Asynchronous rollout (`settings.asynchronous`): the read-ahead engine of its mode, built from
        `READ_AHEAD_ENGINES` by the mode's name, reads the trainer's data ahead. `groups_per_batch` (streaming): the
        prompt groups one generation batch trains on. `converse` (streaming, tool-using rollouts): a group's later
        turns, run in the stream's thread right after its first turn (see `Converse`). `reward` (rewards in the
        stream): (rows, prompt ids, choices) -> the group's rewards, run in the stream's thread once the group has
        finished. `open_episode` (environments): rows -> the group's episode, opened when it is sent (see
        `streaming.Episode`). `rollout` (a `rollout_func`): (rows, send, dispatched) -> the group's choices and
        newest version, made by the user's function instead of one request (see `streaming.Rollout`)."""
        mode, staleness = self.settings.asynchronous.mode, self.settings.asynchronous.staleness
        engine = READ_AHEAD_ENGINES[mode](
            self, staleness, tokenize, groups_per_batch, converse, reward, open_episode, rollout
        )

        def before_take() -> None:  # the fleet checked, the servers' versions refreshed
            self._check_fleet()
            self.client.versions.refresh(self.client.submit, only_unchecked=True)

        self.ahead = ReadAheadRollout(
            engine, converse is not None, before_take, lambda name: self.phase(name), self.shared_with
        )
        return self.ahead

    def share_with(self, group, rank: int) -> None:
        """Sequence parallelism: the ranks of `group` (a process group; this rank is `rank` in it) train on the
        same batch, so its rank 0 alone requests, prefetches or streams completions, and hands them to the
        others."""
        self.shared_with = group
        if self.ahead is not None:
            self.ahead.share_with(group, rank)

    def send_group(
        self,
        prompt_ids: list[int],
        n: int,
        dispatched=None,
        identity: tuple | None = None,
        images: tuple[str, ...] = (),
        index: int = -1,
        features: dict | None = None,
    ) -> tuple[list[dict], int]:
        """One prompt group's request (streaming): its choices and the newest weights its tokens can come from.
        With LoRA, a generation keeps the adapter it was sent with (a sync loads the next under a new name and
        leaves this one loaded): every token comes from that adapter's version. `identity`: which request of the
        run it is (`seeds.py`), drawn by a sender in another thread; else this thread's next. `images` (data URLs):
        rendered once for the request (unless their `features` are given), and kept by a cut answer's
        continuation; `index`: the group's, for errors."""
        sampling = self.seeds.sampling(self.settings.sampling, identity or next_identity())
        if images:
            features = features if features is not None else self.client.render(list(images), index)
            sampling = {**sampling, "features": features}
        name, adapter_version = self.syncer.lora_served  # one read: the adapter named and its version agree
        # a sync cuts running answers: each continued after it
        continue_cut = self.settings.asynchronous.interrupt == "partial"
        choices = self._retried_after_fleet(
            lambda: self.client.complete(
                prompt_ids, n, name, on_dispatch=dispatched, continue_cut=continue_cut, **sampling
            )
        )
        if self.syncer.name == "lora":
            return choices, adapter_version
        return choices, self.syncer.newest_reachable()

    def continue_conversations(
        self, converse: Converse, rows: list, prompt_ids: list, choices: list[dict], *episode
    ) -> int:
        """A prompt group's later turns (`converse`), right after its first turn's `choices`: each turn one request
        per conversation, sent as a group's first turn is (routed, failed over, with the weights served then). Each
        choice then carries its whole conversation (`CONVERSATION_KEY`); returns the newest weights of the later
        turns (-1 with none). With an episode (environments), `prompt_ids` has one entry per row. A turn of a
        conversation with images (`send_turns`' `images`: each prompt's, then those its tools answered with) carries
        them again: they sit where they sat in its earlier turns, so the features rendered once for a set of images
        serve every later turn that holds the same."""
        newest, encoded, rendered = [-1], {}, {}  # a row's images as data URLs (by their objects), their features

        def urls_of(row: list | None) -> tuple[str, ...]:
            # each turn hands the conversation's same image objects: encoded once per group, not once per turn. The
            # entry holds the objects, so their ids are not reused by a later image (a tool's, after a rollback)
            key = tuple(map(id, row or ()))
            if key not in encoded:
                encoded[key] = (list(row or ()), image_urls(row))
            return encoded[key][1]

        def send_turns(prompts: list[list[int]], images: list | None = None) -> tuple[list, list]:
            identities = [next_identity() for _ in prompts]  # in the group's thread, in the conversations' order
            urls = [urls_of(row) for row in images or [None] * len(prompts)]
            for row_urls in set(urls) - set(rendered) - {()}:
                rendered[row_urls] = self.client.render(list(row_urls), -1)
            futures = [
                self.client.submit(self.send_group, list(p), 1, None, i, u, -1, rendered.get(u))
                for p, i, u in zip(prompts, identities, urls)
            ]
            sent = [future.result() for future in futures]
            newest.extend(version for _, version in sent)
            return self.turn_outputs([turn[0] for turn, _ in sent])

        completion_ids, logprobs = self.turn_outputs(choices)
        conversations = converse(rows, prompt_ids, completion_ids, logprobs, send_turns, *episode)
        for choice, conversation in zip(choices, conversations, strict=True):
            choice[CONVERSATION_KEY] = conversation
        return max(newest)

    def request_spanned(self, prompts, batch: int, images=None) -> tuple[list[dict], int]:
        """`_request`, and the newest weight version its tokens can come from: the sync count when it finished (one
        more while a sync is under way, whose new weights a streaming sync lets it reach)."""
        choices = self._request(prompts, batch, images)
        return choices, self.syncer.newest_reachable()

    # ---- weight sync (TRL's interface; the syncer does it) ---------------------------------------------------

    def sync_weights(self) -> None:
        """Push the policy's current weights to every server (`WeightSyncer.sync`), the read-ahead engine told
        first (the ordered prefetch waits for the requests already sent)."""
        with self.phase("weight sync"):
            if self.ahead is not None and self.ahead.engine is not None:
                self.ahead.engine.before_sync()
            self.syncer.sync(self._policy_weights(), self._check_fleet)

    def _policy_weights(self) -> PolicyWeights:
        """The policy's weights as the sync modes read them: TRL's walk under vLLM's names, and the adapter."""

        def metadata() -> list[tuple[str, str, list[int]]]:
            # The servers must know every tensor before the first is broadcast: walked once, then cached (as TRL).
            if self._weight_metadata is None:
                self._weight_metadata = [
                    (name, str(param.dtype).removeprefix("torch."), list(param.shape))
                    for name, param in self._iter_named_params()
                ]
            return self._weight_metadata

        def adapter() -> tuple[dict, object]:
            model = self.accelerator.unwrap_model(self.model)
            return adapter_state_dict(model), model.peft_config["default"]

        return PolicyWeights(
            named_tensors=self._iter_named_params,
            metadata=metadata,
            adapter=adapter,
            is_main=self.accelerator.is_main_process,
            models_in_use=lambda: set().union(*gathered(self.client.transport.models_in_use())),
        )


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
