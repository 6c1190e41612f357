"""Generation ahead of the trainer (asynchronous rollout): the prefetch (`prefetch.py`, "ordered") and the stream
(`streaming`), on the servers' client. Mixed into `ServerRolloutGeneration`, which it uses for the requests (`client`,
`settings`, the sync count and the LoRA adapter served); TRL's `generate` call for a batch is answered from a
streamed batch within `serving`. Tool-using rollouts stream whole conversations: a group's later turns are sent right
after its first (`converse`), each choice then carrying its conversation (`CONVERSATION_KEY`)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Protocol

from ..ranks import decide_on_leader
from .seeds import next_identity

CONVERSATION_KEY = "trl_scale_conversation"  # a streamed choice's whole conversation, its later turns included

# converse(rows, prompt_ids, completion_ids, logprobs, send_turns) -> one conversation per completion: a prompt
# group's later turns (its trainer rows, its prompt's ids, its first turn's completions and their sampler log-probs).
# send_turns(prompts) generates one turn for each prompt (token ids: the conversation so far) and returns the turns'
# (completion ids, sampler log-probs).
Converse = Callable[[list, list[int], list[list[int]], list[list[float]], Callable], list]


class ReadAhead(Protocol):
    """A read-ahead engine: told the trainer's upcoming generation batches, it generates them before they are
    trained (`READ_AHEAD_ENGINES`, one per `async_rollout_mode`)."""

    batches_ahead: int  # generation batches read ahead of the one being trained
    notes_first: bool  # the run's first generation batch is generated ahead too
    takes_groups: bool  # the trainer takes batches of whole finished groups from it (not TRL's generate call)

    def note_upcoming(self, batch: list) -> None: ...

    def before_sync(self) -> None:
        """A weight sync is about to start."""

    def state(self, batches_read_ahead: int) -> dict | None:
        """What a checkpoint keeps to resume exactly (None: nothing)."""

    def restore(self, state: dict) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self) -> None:
        """The run ended: nothing more is generated ahead (`reopen` starts again)."""

    def reopen(self) -> None: ...

    def shutdown(self) -> None:
        """This process generates no more: the engine's threads stop."""


def _ordered(
    generation, staleness: int, tokenize, groups_per_batch: int | None, converse, score, open_episode, rollout
) -> ReadAhead:
    """Up to `staleness` generation batches prefetched, each generated whole at the weights of its request. With
    episodes (environments) or a `rollout_func`, which only the stream's engine runs: that engine, ordered
    (`ordered_stream`). Later turns of plain tools are generated in the step (see `ServerRollout.tool_call_loop`)."""
    if generation.settings.asynchronous.takes_groups(open_episode is not None, rollout is not None):
        from .ordered_stream import OrderedStream

        return _stream(
            OrderedStream, generation, staleness, tokenize, groups_per_batch, converse, score, open_episode, rollout
        )
    from concurrent.futures import ThreadPoolExecutor

    from .prefetch import RolloutPrefetcher

    # Its own threads: a prefetch waits on the client's request pool, which must never wait on itself.
    pool = ThreadPoolExecutor(max_workers=max(1, staleness), thread_name_prefix="prefetch")
    request = functools.partial(_submit_spanned, pool, generation)
    stop_threads = functools.partial(pool.shutdown, wait=False, cancel_futures=True)
    return RolloutPrefetcher(staleness, tokenize, request, stop_threads=stop_threads)


def _submit_spanned(pool, generation, prompt_ids):
    batch = generation.seeds.next_batch()  # numbered when submitted (the trainer's thread), not when a thread runs it
    return pool.submit(generation.request_spanned, [list(p) for p in prompt_ids], batch)


def _streaming(
    generation, staleness: int, tokenize, groups_per_batch: int | None, converse, score, open_episode, rollout
) -> ReadAhead:
    """Prompt groups streamed through the servers, each trained once finished, within `staleness` syncs."""
    from .streaming import StreamingRollout

    if generation.weight_sync == "lora":  # running generations keep their adapter: keep it loaded
        generation.sync_mode.settings = replace(generation.sync_mode.settings, keep_adapters=staleness)
    return _stream(
        StreamingRollout, generation, staleness, tokenize, groups_per_batch, converse, score, open_episode, rollout
    )


def _stream(engine, generation, staleness: int, tokenize, groups_per_batch, converse, score, open_episode, rollout):
    """`engine` (the stream or its ordered form) on this generation's requests."""
    return engine(
        staleness,
        tokenize,
        generation.send_group,
        groups_per_batch or 1,
        version=lambda: generation.sync_count,
        converse=None if converse is None else functools.partial(generation.continue_conversations, converse),
        score=score,
        open_episode=open_episode,
        group_size=None if open_episode is None else open_episode.group_size,
        rollout=rollout,
    )


# async_rollout_mode -> the engine that reads ahead (like the weight-sync modes' registry)
READ_AHEAD_ENGINES: dict[str, Callable[..., ReadAhead]] = {"ordered": _ordered, "streaming": _streaming}


class GenerationAhead:
    """`ServerRolloutGeneration`'s asynchronous half: reading the trainer's data ahead and generating it."""

    read_ahead: ReadAhead | None = None  # the engine, or None for a synchronous run
    shared_with = None  # the sequence-parallel group's process group: its rank 0 generates for it (`share_with`)
    takes_groups = False  # streaming rollout: this rank's batches come from the stream (its own, or its group's)
    converses = False  # streaming generates a group's later turns too (`enable_async(converse=...)`)
    _serving = None  # a streamed batch TRL's next generate() call is answered from
    _serving_rewards = None  # ... and its groups' rewards (computed in the stream), for the next reward call
    _evaluating = False  # generate calls are an evaluation's (`evaluating`)
    # The trainer's phase clock (`trl_scale.timeline.PhaseClock.phase`), where the timeline or phase timing is kept:
    # a weight sync and a wait for streamed groups are phases of the trainer's time.
    phase = staticmethod(lambda name: nullcontext())
    _version_lock: threading.Lock  # the generation's own (`ServerRolloutGeneration.__init__`)

    def enable_async(
        self,
        tokenize,
        groups_per_batch: int | None = None,
        converse: Converse | None = None,
        score=None,
        open_episode=None,
        rollout=None,
    ) -> None:
        """Asynchronous rollout (`settings.asynchronous`): the read-ahead engine of its mode reads the trainer's
        data ahead. `groups_per_batch` (streaming): the prompt groups one generation batch trains on. `converse`
        (streaming, tool-using rollouts): a group's later turns, run in the stream's thread right after its first
        turn (see `Converse`). `score` (streaming, rewards in the stream): (rows, prompt ids, choices) -> the
        group's rewards, run in the stream's thread once the group has finished. `open_episode` (streaming,
        environments): rows -> the group's episode, opened when it is sent (see `streaming.Episode`). `rollout`
        (streaming, a `rollout_func`): (rows, send, dispatched) -> the group's choices and newest version, made by
        the user's function instead of one request (see `streaming.Rollout`)."""
        asynchronous = self.settings.asynchronous
        build = READ_AHEAD_ENGINES[asynchronous.mode]
        staleness = asynchronous.staleness
        self.read_ahead = build(self, staleness, tokenize, groups_per_batch, converse, score, open_episode, rollout)
        self.takes_groups = self.read_ahead.takes_groups  # ordered episodes stream too (`_ordered`)
        self.converses = self.takes_groups and converse is not None

    @property
    def streamer(self):
        """The streaming engine (streaming rollout), or None."""
        return self.read_ahead if self.takes_groups else None

    @property
    def prefetcher(self):
        """The ordered prefetch engine, or None."""
        return None if self.takes_groups else self.read_ahead

    def send_group(
        self, prompt_ids: list[int], n: int, dispatched=None, identity: tuple | None = None
    ) -> tuple[list[dict], int]:
        """One prompt group's request (streaming): its choices and the newest weights its tokens can come from.
        With LoRA, a generation keeps the adapter it was sent with (a sync loads the next under a new name and
        leaves this one loaded): every token comes from that adapter's version. `identity`: which request of the
        run it is (`seeds.py`), drawn by a sender in another thread; else this thread's next."""
        sampling = self.seeds.sampling(self.settings.sampling, identity or next_identity())
        name, adapter_version = self._lora_served  # one read: the adapter named and its version agree
        # a sync cuts running answers: each continued after it
        continue_cut = self.settings.asynchronous.interrupt == "partial"
        choices = self._retried_after_fleet(
            lambda: self.client.complete(
                prompt_ids, n, name, on_dispatch=dispatched, continue_cut=continue_cut, **sampling
            )
        )
        if self.weight_sync == "lora":
            return choices, adapter_version
        return choices, self._newest_reachable()

    def continue_conversations(
        self, converse: Converse, rows: list, prompt_ids: list, choices: list[dict], *episode
    ) -> int:
        """A prompt group's later turns (`converse`), right after its first turn's `choices`: each turn one request
        per conversation, sent as a group's first turn is (routed, failed over, with the weights served then). Each
        choice then carries its whole conversation (`CONVERSATION_KEY`); returns the newest weights of the later
        turns (-1 with none). With an episode (environments), `prompt_ids` has one entry per row."""
        newest = [-1]

        def send_turns(prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
            identities = [next_identity() for _ in prompts]  # in the group's thread, in the conversations' order
            futures = [self.client.submit(self.send_group, list(p), 1, None, i) for p, i in zip(prompts, identities)]
            sent = [future.result() for future in futures]
            newest.extend(version for _, version in sent)
            return self.turn_outputs([turn[0] for turn, _ in sent])

        completion_ids, logprobs = self.turn_outputs(choices)
        conversations = converse(rows, prompt_ids, completion_ids, logprobs, send_turns, *episode)
        for choice, conversation in zip(choices, conversations, strict=True):
            choice[CONVERSATION_KEY] = conversation
        return max(newest)

    def take_streamed(self, num_rows: int, new_rows: list | None = None):
        """The next generation batch's worth of finished prompt groups (streaming; see `StreamingRollout.take`),
        after `new_rows` (dynamic sampling's top-up) joined the stream. Under sequence parallelism the group's
        rank 0 takes them from its stream and every rank of the group gets them."""

        def take():
            self._check_fleet()
            self.client.versions.refresh(self.client.submit, only_unchecked=True)
            if new_rows is not None:
                self.streamer.add(new_rows)
            return self.streamer.take(num_rows)

        with self.phase("wait for groups"):
            return decide_on_leader(take, self.shared_with)

    @contextmanager
    def evaluating(self):
        """Within the block, generate calls are an evaluation's: sent now, at the weights served, and never
        answered from a batch read ahead for training (an evaluation batch with a prefetched batch's prompts would
        take it, and the step that needed it would generate again)."""
        self._evaluating = True
        try:
            yield
        finally:
            self._evaluating = False

    @contextmanager
    def serving(self, streamed):
        """Within the block, TRL's `generate` call for this batch is answered from the streamed groups (their
        prompts must be the ones asked for), and its reward call from their rewards (`streamed_rewards`)."""
        self._serving, self._serving_rewards = streamed, streamed.rewards
        try:
            yield
        finally:
            self._serving = self._serving_rewards = None

    def streamed_rewards(self) -> list | None:
        """The served batch's rewards, computed in the stream (one per group, in order), once; None without."""
        rewards, self._serving_rewards = self._serving_rewards, None
        return rewards

    def read_ahead_metrics(self) -> dict[str, float]:
        """The engine's counts (see `StreamingRollout.metrics`) and, streaming, the cut answers continued."""
        metrics = self.read_ahead.metrics() if self.read_ahead is not None else {}
        if self.takes_groups:
            metrics["rollout/stream_answers_continued"] = float(self.client.answers_continued)
        return metrics

    def open_read_ahead(self) -> None:
        """The start of a run: an engine the last run closed reads and generates again."""
        if self.read_ahead is not None:
            self.read_ahead.reopen()

    def close_read_ahead(self) -> None:
        if self.read_ahead is not None:
            self.read_ahead.close()

    def request_spanned(self, prompts, batch: int) -> tuple[list[dict], int]:
        """`_request`, and the newest weight version its tokens can come from: the sync count when it finished (one
        more while a sync is under way, whose new weights a streaming sync lets it reach)."""
        choices = self._request(prompts, batch)
        return choices, self._newest_reachable()

    def _newest_reachable(self) -> int:
        """The newest weights a token finishing now can come from: the sync count, one more while a sync is under
        way (a streaming sync lets running generations reach its weights). One snapshot of the two, which
        `sync_weights` changes together: never the old count once the new weights may be served."""
        with self._version_lock:
            return self.sync_count + (1 if self._syncing else 0)

    def share_with(self, group, rank: int) -> None:
        """Sequence parallelism: the ranks of `group` (a process group; this rank is `rank` in it) train on the
        same batch, so its rank 0 alone requests, prefetches or streams completions, and hands them to the
        others (`take_streamed_shared`, `generate`)."""
        self.shared_with = group
        if rank == 0 or self.read_ahead is None:
            return
        self.read_ahead.shutdown()
        self.read_ahead = None

    def _streamed_choices(self, prompts) -> tuple[list[dict], list[tuple[int, int]]]:
        streamed, self._serving = self._serving, None  # answers one call
        if [list(p) for p in prompts] != streamed.prompt_ids:
            raise RuntimeError(
                "streaming rollout: TRL asked for completions of other prompts than the streamed batch's: TRL's hook "
                "order is not the one trl-scale was built on (see trl_scale/seams)"
            )
        return streamed.choices, list(streamed.spans)
