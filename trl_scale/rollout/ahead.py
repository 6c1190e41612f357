"""Generation ahead of the trainer (asynchronous rollout): the prefetch (`prefetch.py`, "ordered") and the stream
(`streaming`), on the servers' client. `ServerRolloutGeneration` holds a `ReadAheadRollout` (its `ahead`) for an
asynchronous run and gives the engines its requests (`send_group`, `request_spanned`); TRL's `generate` call for a
batch is answered from a streamed batch the step's state serves (`StepState.serve`). Tool-using rollouts stream whole
conversations: a group's later turns are sent right after its first (`converse`), each choice then carrying its
conversation (`CONVERSATION_KEY`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

from ..ranks import decide_on_leader

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
    generation, staleness: int, tokenize, groups_per_batch: int | None, converse, reward, open_episode, rollout
) -> ReadAhead:
    """Up to `staleness` generation batches prefetched, each generated whole at the weights of its request. With
    episodes (environments) or a `rollout_func`, which only the stream's engine runs: that engine, ordered
    (`ordered_stream`). Later turns of plain tools are generated in the step (see `ServerRollout.tool_call_loop`)."""
    if generation.settings.asynchronous.takes_groups(open_episode is not None, rollout is not None):
        from .ordered_stream import OrderedStream

        return _stream(
            OrderedStream, generation, staleness, tokenize, groups_per_batch, converse, reward, open_episode, rollout
        )
    from concurrent.futures import ThreadPoolExecutor

    from .prefetch import RolloutPrefetcher

    # Its own threads: a prefetch waits on the client's request pool, which must never wait on itself.
    pool = ThreadPoolExecutor(max_workers=max(1, staleness), thread_name_prefix="prefetch")
    request = functools.partial(_submit_spanned, pool, generation)
    stop_threads = functools.partial(pool.shutdown, wait=False, cancel_futures=True)
    return RolloutPrefetcher(staleness, tokenize, request, stop_threads=stop_threads)


def _submit_spanned(pool, generation, prompt_ids, images=None):
    batch = generation.seeds.next_batch()  # numbered when submitted (the trainer's thread), not when a thread runs it
    return pool.submit(generation.request_spanned, [list(p) for p in prompt_ids], batch, images)


def _streaming(
    generation, staleness: int, tokenize, groups_per_batch: int | None, converse, reward, open_episode, rollout
) -> ReadAhead:
    """Prompt groups streamed through the servers, each trained once finished, within `staleness` syncs."""
    from .streaming import StreamingRollout

    # (LoRA: running generations keep their adapter, loaded: the sync settings keep `staleness` adapters)
    return _stream(
        StreamingRollout, generation, staleness, tokenize, groups_per_batch, converse, reward, open_episode, rollout
    )


def _stream(engine, generation, staleness: int, tokenize, groups_per_batch, converse, reward, open_episode, rollout):
    """`engine` (the stream or its ordered form) on this generation's requests."""
    return engine(
        staleness,
        tokenize,
        generation.send_group,
        groups_per_batch or 1,
        version=lambda: generation.syncer.count,
        converse=None if converse is None else functools.partial(generation.continue_conversations, converse),
        reward=reward,
        open_episode=open_episode,
        group_size=None if open_episode is None else open_episode.group_size,
        rollout=rollout,
    )


# async_rollout_mode -> the engine that reads ahead (like the weight-sync modes' registry)
READ_AHEAD_ENGINES: dict[str, Callable[..., ReadAhead]] = {"ordered": _ordered, "streaming": _streaming}


class ReadAheadRollout:
    """Generation ahead of the trainer, held by TRL's generation interface (`ServerRolloutGeneration.ahead`) for an
    asynchronous run: the read-ahead engine of its mode, built from `READ_AHEAD_ENGINES` (keyed by the engine's
    name: "ordered", "streaming"), and an evaluation's requests sent now (`evaluating`). A streamed batch taken
    here answers TRL's calls through the step's state (`StepState.serve`)."""

    def __init__(
        self, engine: ReadAhead | None, converses: bool, before_take: Callable[[], None], phase, shared_with=None
    ):
        self.engine = engine  # None on a sequence-parallel group's other ranks (`share_with`)
        self.takes_groups = engine.takes_groups  # ordered episodes stream too (`_ordered`)
        self.converses = self.takes_groups and converses  # streaming generates a group's later turns too
        self.shared_with = shared_with  # the sequence-parallel group: its rank 0 reads ahead for it
        self._before_take = before_take  # the fleet checked and the servers' versions refreshed
        self._phase = phase  # the trainer's phase clock, as the generation has it when called
        self.evaluating_now = False  # generate calls are an evaluation's (`evaluating`)

    @property
    def streamer(self):
        """The streaming engine (streaming rollout), or None."""
        return self.engine if self.takes_groups else None

    @property
    def prefetcher(self):
        """The ordered prefetch engine, or None."""
        return None if self.takes_groups else self.engine

    def take_streamed(self, num_rows: int, new_rows: list | None = None):
        """The next generation batch's worth of finished prompt groups (streaming; see `StreamingRollout.take`),
        after `new_rows` (dynamic sampling's top-up) joined the stream. Under sequence parallelism the group's
        rank 0 takes them from its stream and every rank of the group gets them."""

        def take():
            self._before_take()
            if new_rows is not None:
                self.streamer.add(new_rows)
            return self.streamer.take(num_rows)

        with self._phase("wait for groups"):
            return decide_on_leader(take, self.shared_with)

    @contextmanager
    def evaluating(self):
        """Within the block, generate calls are an evaluation's: sent now, at the weights served, and never
        answered from a batch read ahead for training (an evaluation batch with a prefetched batch's prompts would
        take it, and the step that needed it would generate again)."""
        self.evaluating_now = True
        try:
            yield
        finally:
            self.evaluating_now = False

    def metrics(self, answers_continued: int) -> dict[str, float]:
        """The engine's counts (see `StreamingRollout.metrics`) and, streaming, the cut answers continued."""
        metrics = self.engine.metrics() if self.engine is not None else {}
        if self.takes_groups:
            metrics["rollout/stream_answers_continued"] = float(answers_continued)
        return metrics

    def open(self) -> None:
        """The start of a run: an engine the last run closed reads and generates again."""
        if self.engine is not None:
            self.engine.reopen()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def share_with(self, group, rank: int) -> None:
        """Sequence parallelism: the ranks of `group` train on the same batch, so its rank 0 alone prefetches or
        streams completions and hands them to the others."""
        self.shared_with = group
        if rank != 0 and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
