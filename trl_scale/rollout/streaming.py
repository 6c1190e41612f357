"""Streaming rollout: the servers never idle, the trainer never waits for the longest answer of its batch.

With `async_rollout_mode="streaming"` (the default for `async_rollout_staleness = k ≥ 1`) the trainer's data is
read ahead (`LookaheadIterator`, k + 1 generation batches) and cut into prompt groups (the consecutive copies of one
prompt TRL's sampler makes: GRPO's `num_generations`). Each group is one request (`n` = its size) to whichever server
the router picks, and up to a window of groups ((k + 1) generation batches' worth) is out at a time: as soon as a
group finishes, the next is sent, so every server keeps generating while the trainer trains and while a long answer
runs. For each generation batch the trainer takes the groups that have *finished*, oldest weights first, in place of
the rows TRL read (their rows go with them, so reward functions see each completion's own columns); a long answer
still running is trained on in a later batch. With `converse` (tool-using rollouts) a group's later turns are
generated right after its first, in its thread, and it finishes when its last turn does.

The bound: a group's version is the weight sync count when its request was sent (its first token cannot be older;
a failover re-send is tagged anew), and it is never trained more than k syncs later. No more groups are out than
the batches up to a new group's deadline can take (`window`), and a group whose deadline has come is waited for: a
prompt whose answers are long delays its batch, it is never dropped nor starved of training. (What is left over
when more groups fall due at once than a batch takes is dropped, counted, and generated again, first in line.)
Syncs do not drain the servers: they pause between decoding steps (vLLM's `/pause?mode=keep`), load, and resume;
a running answer goes on with the new weights, and each completion records (first, newest) versions. So at
staleness k an answer has the time of k steps to finish; a step is never shorter than the longest answer it
trains divided by k.

Nothing is lost or trained twice: every row read is in exactly one group, a group leaves only when the trainer
takes it (rows trained once) or is dropped (and re-queued); a server that dies mid-request has the request re-sent
elsewhere by the router. Checkpoints carry the groups read and not yet trained (`state` / `restore`): a resume trains
each of them once and reads on where the run had read, so no prompt is repeated or skipped. At the end of the run
the groups still generating are abandoned (their answers were not needed).

The order in which groups finish depends on timing, so streaming runs are not reproducible bit for bit;
`async_rollout_mode="ordered"` (the prefetch in `prefetch.py`) is.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from .images import image_keys, image_urls, multimodal_prompts, row_images
from .seeds import identified, next_identity


@dataclass(eq=False)
class PromptGroup:
    """The consecutive copies of one prompt in the trainer's data: generated together, trained together."""

    index: int  # order of reading from the trainer's data
    rows: list  # the trainer's rows (each with its own columns for the reward functions)
    prompt_ids: list[int]
    images: tuple[str, ...] = ()  # its prompt's images (data URLs), rendered by a server when it is sent
    attempts: int = 0  # requests sent for it (a dropped group is sent again)
    first_version: int = -1  # the sync count when its request was sent: its first token's weights at the oldest
    newest_version: int = -1  # the newest weights any of its tokens can come from
    choices: list[dict] | None = None
    rewards: object = None  # what `reward` made of its finished answers (rewards in the stream), or None
    # with `open_episode`: the rows as its episode prepared them (what the trainer trains on) and their prompt ids
    episode_rows: list | None = None
    episode_prompt_ids: list[list[int]] | None = None
    error: BaseException | None = None
    future: Future | None = field(default=None, repr=False)
    finished_at: float = 0.0
    # set under the stream's lock with the attempt's outcome, in the notification a waiter wakes on (the Future
    # is marked done only after the attempt's function returns, so a waiter reading it could miss the wake-up)
    finished: bool = False

    @property
    def done(self) -> bool:
        return self.future is not None and self.finished


@dataclass(frozen=True)
class StreamedBatch:
    """A generation batch's worth of finished groups: their rows in place of the ones TRL read, one choice and one
    (first, newest) version span per row."""

    rows: list
    prompt_ids: list[list[int]]
    choices: list[dict]
    spans: list[tuple[int, int]]
    rewards: list | None = None  # with `reward`: each chosen group's rewards, in the batch's group order

    def answer(self, prompts) -> tuple[list[dict], list[tuple[int, int]]]:
        """The choices and version spans answering TRL's generate call for `prompts` (which must be the batch's)."""
        if [list(p) for p in prompts] != self.prompt_ids:
            raise RuntimeError(
                "streaming rollout: TRL asked for completions of other prompts than the streamed batch's: TRL's "
                "hook order is not the one trl-scale was built on (see trl_scale/seams)"
            )
        return self.choices, list(self.spans)


# send(prompt_ids, n, dispatched) -> (choices, newest version): blocking; calls dispatched() right before each
# request goes on the wire (again on a failover), so the group's version is taken when it is sent, not queued.
# send(prompt_ids, n, dispatched, identity=None): one request, its identity for its seed (`seeds.py`) when it is
# sent from a thread other than its group's
Send = Callable[..., tuple[list[dict], int]]
# rollout(rows, send, dispatched) -> (one choice per row, newest version or -1): a user's generation loop for one
# group (TRL's `rollout_func`), sending through `send`; -1 when nothing it sent was seen (then: up to now).
Rollout = Callable[[list, Send, Callable[[], None]], tuple[list[dict], int]]


class StreamingRollout:
    """Keeps up to `window` prompt groups generating on the servers, and hands the trainer finished ones."""

    notes_first = True  # the first generation batch is streamed too (the prefetch generates it in turn)
    takes_groups = True  # the trainer takes its batches of finished groups from it (`take`)

    def __init__(
        self,
        staleness: int,
        tokenize: Callable[[list], list[list[int]]],
        send: Send,
        groups_per_batch: int,
        version: Callable,
        converse: Callable[[list, list[int], list[dict]], int] | None = None,
        reward: Callable[[list, list[int], list[dict]], object] | None = None,
        open_episode: Callable[[list], Episode] | None = None,
        group_size: int | None = None,
        rollout: Rollout | None = None,
    ):
        if staleness < 1:
            raise ValueError(f"streaming needs async_rollout_staleness >= 1, got {staleness}")
        self.staleness = staleness
        self.batches_ahead = staleness + 1  # generation batches read ahead of the one being trained
        self.tokenize = tokenize  # the trainer's rows' prompts -> prompt token ids, as the trainer tokenizes them
        self.send = send
        self.groups_per_batch = groups_per_batch  # groups one generation batch trains on
        self.version = version  # () -> the current sync count
        # (rows, prompt ids, choices) -> the newest version of a group's later turns, generated right after its first
        # (tool-using rollouts; the choices then carry the conversations); None: one turn
        self.converse = converse
        # (rows, prompt ids, choices) -> the group's rewards, computed as soon as it finishes (rewards in the stream)
        self.reward = reward  # a finished group's rewards, computed in the stream (None: in the step)
        # rows -> the group's episode (environments): opened when the group is sent, closed once it is scored
        self.open_episode = open_episode
        self.group_size = group_size  # rows per group when groups are not cut by prompt (environments)
        self.rollout = rollout  # a group's choices made by the user's rollout_func instead of one request
        self._scoring = 0  # groups finished generating, their rewards being computed
        self._taken_at = -1  # the version of the last batch taken
        self.pending: deque[PromptGroup] = deque()  # read, not sent (dropped ones go first)
        self.out: list[PromptGroup] = []  # sent, not taken (generating or finished)
        self._changed = threading.Condition()
        self._pool = self._new_pool()
        self._read = 0  # groups read so far (their index)
        self._skip_notes = 0  # generation batches read before a resume's checkpoint: their groups are restored
        self._closed = False
        self.counts = {"dropped_stale": 0, "waited_for_deadline": 0}

    # ---- reading the trainer's data --------------------------------------------------------------------------

    def before_sync(self) -> None:
        pass  # running answers go on across the sync (frozen or cut by the sync mode's pause)

    def note_upcoming(self, batch: list) -> None:
        """A generation batch read ahead from the trainer's data: cut into prompt groups, queued, sent as the
        window allows."""
        if self._skip_notes:
            self._skip_notes -= 1  # already read before the checkpoint this run resumed from
            return
        self.add(batch)

    def add(self, rows: list) -> None:
        """Rows queued after what was read (a generation batch of the trainer's data, or dynamic sampling's top-up)."""
        images = row_images(rows) or [None] * len(rows)
        prompt_ids = self.tokenize(multimodal_prompts(rows, images))  # with images: what TRL's step tokenizes
        if self.group_size is None:  # a run of one prompt with the same images (equal ids may hold other images)
            groups = _groups(rows, prompt_ids, image_keys(images))
        else:
            groups = _chunks(rows, prompt_ids, self.group_size)
        with self._changed:
            first = 0  # the group's first row in `rows`
            for group_rows, ids in groups:
                self.pending.append(PromptGroup(self._read, group_rows, ids, image_urls(images[first])))
                self._read += 1
                first += len(group_rows)
        self.pump()

    @property
    def window(self) -> int:
        """Groups that may be out now: as many as the batches within a new group's deadline take. A group sent now
        (at version V) is trained by the batch taken at V + k at the latest; the batches at V (unless already
        taken) .. V + k take `groups_per_batch` each, oldest first, so one more group out would be too old when its
        turn came, even with every answer short. Between a sync and its batch: (k + 1) batches' worth; after it, k."""
        batches = self.staleness + (0 if self._taken_at == self.version() else 1)
        return batches * self.groups_per_batch

    def pump(self) -> None:
        """Send queued groups while fewer than `window` are out; nothing before the run's first weight sync (version
        1): until then the servers hold whatever weights they were started with or another run left there."""
        with self._changed:
            if self.version() < 1:
                return
            while self.pending and len(self.out) < self.window and not self._closed:
                self._dispatch(self.pending.popleft())

    def _dispatch(self, group: PromptGroup) -> None:
        group.attempts += 1
        attempt = group.attempts  # an abandoned attempt that finishes later must not write into a newer one
        group.choices, group.rewards, group.error, group.first_version = None, None, None, self.version()
        group.finished = False
        group.episode_rows = group.episode_prompt_ids = None

        def dispatched() -> None:
            if group.attempts == attempt:
                group.first_version = self.version()

        def run():
            try:
                wanted = lambda: group.attempts == attempt and not self._closed  # noqa: E731 (read as the run goes)
                with identified("group", group.index, attempt):  # its requests' seeds (`seeds.py`)
                    outcome, error = self._attempt(group, dispatched, wanted), None
            except BaseException as failure:  # handed to the trainer when it takes this group
                outcome, error = _Outcome(), failure
            with self._changed:
                if group.attempts == attempt:
                    group.choices, group.rewards = outcome.choices, outcome.rewards
                    group.newest_version = outcome.newest
                    group.episode_rows, group.episode_prompt_ids = outcome.rows, outcome.prompt_ids
                    group.error, group.finished = error, True
                    if 0 <= outcome.sent_with < group.first_version:  # (LoRA) an adapter older than its dispatch
                        group.first_version = outcome.sent_with
                    group.finished_at = time.monotonic()
                self._changed.notify_all()

        group.future = self._pool.submit(run)
        self.out.append(group)

    def _attempt(self, group: PromptGroup, dispatched: Callable[[], None], wanted: Callable[[], bool]) -> _Outcome:
        """One attempt at a group, in a stream thread: its episode opened (environments), its first turn sent, its
        later turns (`converse`), its rewards (`reward`), the episode closed. An attempt abandoned meanwhile (dropped,
        or the run ended) stops before its later turns and its rewards: no tool or reward function is called for
        answers nobody will train on."""
        episode = self.open_episode(group.rows) if self.open_episode is not None else None
        try:
            if self.rollout is not None:
                rows, prompt_ids, more = group.rows, list(group.prompt_ids), ()
                choices, newest = self.rollout(rows, self.send, dispatched)
                newest = newest if newest >= 0 else self.version()  # it sent nothing we saw: up to now
            elif episode is None:
                rows, prompt_ids, more = group.rows, list(group.prompt_ids), ()
                with_images = {"images": group.images, "index": group.index} if group.images else {}
                choices, newest = self.send(prompt_ids, len(rows), dispatched, **with_images)
            else:
                rows, prompt_ids, more = episode.rows, episode.prompt_ids, (episode,)
                choices, newest = _send_each(self.send, prompt_ids, dispatched, episode.images, group.index)
            sent_with = newest  # (LoRA) the adapter its first turn named
            if self.converse is not None and wanted():  # its later turns, before the group finishes
                newest = max(newest, self.converse(rows, prompt_ids, choices, *more))
            rewards = None
            if self.reward is not None and wanted():
                with self._changed:
                    self._scoring += 1
                try:
                    rewards = self.reward(rows, prompt_ids, choices, *more)
                finally:
                    with self._changed:
                        self._scoring -= 1
        finally:
            if episode is not None:
                episode.close()
        if episode is None:
            return _Outcome(choices, rewards, newest, sent_with)
        return _Outcome(choices, rewards, newest, sent_with, rows, [list(ids) for ids in prompt_ids])

    # ---- taking a batch ----------------------------------------------------------------------------------------

    def take(self, num_rows: int, timeout: float | None = None) -> StreamedBatch:
        """`num_rows` rows of finished groups for the batch trained at the current version: the groups whose deadline
        is now (waited for), then the oldest finished. Drops (and re-queues) what is too old."""
        version = self.version()
        oldest = version - self.staleness  # the oldest version a trained token may have
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self.counts["waited_for_deadline"] += sum(not g.done for g in self.out if g.first_version == oldest)
            while True:
                if self._closed:  # a stream closed at the end of a run waits for nothing (`reopen` starts anew)
                    raise RuntimeError("streaming rollout: a batch was asked of a closed stream (the run had ended)")
                self._drop_older_than(oldest)
                self.pump()
                chosen = self._choose(num_rows, oldest)
                if chosen is not None:
                    break
                if not self.out and not self.pending:
                    raise RuntimeError(
                        f"streaming rollout: {num_rows} rows wanted and no group left to generate (read "
                        f"{self._read}); the trainer's data ran out before its last step"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"streaming rollout: no batch of {num_rows} rows within {timeout:g}s")
                self._changed.wait(timeout=1.0)
            for group in chosen:
                self.out.remove(group)
                if group.error is not None:
                    raise group.error
            self._taken_at = version
        self.pump()
        return StreamedBatch(
            rows=[row for g in chosen for row in (g.episode_rows or g.rows)],
            prompt_ids=[list(ids) for g in chosen for ids in (g.episode_prompt_ids or [g.prompt_ids] * len(g.rows))],
            choices=[c for g in chosen for c in g.choices],
            spans=[(g.first_version, g.newest_version) for g in chosen for _ in g.rows],
            rewards=None if self.reward is None else [g.rewards for g in chosen],
        )

    def _drop_older_than(self, oldest: int) -> None:
        """Groups whose first token would train older than the bound, finished or not: dropped and queued again,
        first (in read order). The window keeps this from happening to a group that is waited for at its deadline;
        it happens to what is left over when more groups fall due at once than a batch takes."""
        stale = [g for g in self.out if g.first_version < oldest]
        for group in sorted(stale, key=lambda g: g.index, reverse=True):
            self.out.remove(group)  # one still generating is abandoned: its answer is not waited for
            self.counts["dropped_stale"] += 1
            group.future = None
            self.pending.appendleft(group)

    def _choose(self, num_rows: int, oldest: int) -> list[PromptGroup] | None:
        """The groups for this batch, or None until they have finished: the groups whose deadline is now (sent at
        the oldest version allowed: waited for, oldest read first), then finished groups, oldest version first,
        then first finished."""
        due, rows = [], 0
        for group in sorted((g for g in self.out if g.first_version == oldest), key=lambda g: g.index):
            if rows + len(group.rows) <= num_rows:
                due.append(group)
                rows += len(group.rows)
        if not all(g.done for g in due):
            return None
        finished = [g for g in self.out if g.done and g not in due]
        finished.sort(key=lambda g: (g.first_version, g.finished_at))
        chosen = list(due)
        for group in finished:
            if rows == num_rows:
                break
            if rows + len(group.rows) <= num_rows:
                chosen.append(group)
                rows += len(group.rows)
        return chosen if rows == num_rows else None

    # ---- checkpoints and the end of the run ------------------------------------------------------------------

    def state(self, batches_read_ahead: int) -> dict:
        """What a checkpoint needs: every group read and not yet trained (in read order) and how many generation
        batches of the trainer's data were read ahead of the step (a resume reads past them)."""
        with self._changed:
            groups = sorted([*self.out, *self.pending], key=lambda g: g.index)
            return {
                "rows": [g.rows for g in groups],
                "prompt_ids": [g.prompt_ids for g in groups],
                "batches_read_ahead": batches_read_ahead,
            }

    def restore(self, state: dict) -> None:
        """Resume: the saved groups are queued first; the first `batches_read_ahead` generation batches the resumed
        data gives were read (and queued or trained) before the checkpoint, so they are not read again."""
        with self._changed:
            for rows, ids in zip(state["rows"], state["prompt_ids"]):
                self.pending.append(PromptGroup(self._read, rows, ids))
                self._read += 1
            self._skip_notes = state["batches_read_ahead"]

    def metrics(self) -> dict[str, float]:
        with self._changed:
            generating = sum(not g.done for g in self.out)
            return {
                "rollout/stream_groups_generating": float(generating),
                "rollout/stream_groups_finished_waiting": float(len(self.out) - generating),
                "rollout/stream_groups_dropped_stale": float(self.counts["dropped_stale"]),
                "rollout/stream_groups_waited_for_deadline": float(self.counts["waited_for_deadline"]),
                **self._reward_metrics(),
            }

    def _reward_metrics(self) -> dict[str, float]:
        if self.reward is None:
            return {}
        # generating until its rewards are in: the groups scoring now are counted among the generating ones
        metrics = {"rollout/stream_groups_scoring": float(self._scoring)}
        metrics.update(getattr(self.reward, "metrics", dict)())
        return metrics

    def close(self) -> None:
        """The end of the run: nothing more is sent; groups still generating are abandoned (not waited for)."""
        with self._changed:
            self._closed = True
            self.pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        self.close()  # its threads stop with the stream
        getattr(self.reward, "close", lambda: None)()

    def reopen(self) -> None:
        """Another run (a second `train()`, which reads its data anew): what the closed one read and did not train
        is forgotten, as TRL's own run forgets its last rollout; reading starts again. A no-op on an open stream."""
        with self._changed:
            if not self._closed:
                return
            self.out.clear()  # abandoned: an answer still coming writes into a group no longer held
            self.pending.clear()
            self._taken_at, self._skip_notes, self._closed = -1, 0, False
            self._pool = self._new_pool()

    def _new_pool(self) -> ThreadPoolExecutor:
        # One thread per request out, and room for abandoned ones still generating (a dropped group's first attempt
        # holds its thread until its server answers): the pool starts threads only as they are needed.
        workers = 8 * (self.staleness + 1) * self.groups_per_batch + 8
        return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stream")


@dataclass(frozen=True)
class _Outcome:
    """What one attempt at a group produced (nothing, when it failed)."""

    choices: list[dict] | None = None
    rewards: object = None
    newest: int = -1
    sent_with: int = -1
    rows: list | None = None  # an episode's rows and prompt ids (environments)
    prompt_ids: list[list[int]] | None = None


class Episode(Protocol):
    """A group's episode (environments, `open_episode`): its rows as trained (each prompt after its environment's
    reset) and their prompt ids; closed once the group is scored (its environments go back to their pool)."""

    rows: list
    prompt_ids: list[list[int]]
    images: list | None  # each row's images (in its prompt), or None

    def close(self) -> None: ...


def _send_each(
    send: Send, prompt_ids: list[list[int]], dispatched, images: list | None = None, index: int = -1
) -> tuple[list[dict], int]:
    """An episode's rows, whose prompts may differ (each environment's reset): one request per run of equal prompts
    with the same images (`images`: each row's), sent at once; the choices in row order, and the newest weights any
    of them can come from. `index`: the group's, for errors."""
    images = images or [None] * len(prompt_ids)
    runs = []
    for rows, ids in _groups(list(range(len(prompt_ids))), prompt_ids, image_keys(images)):
        urls = image_urls(images[rows[0]])
        runs.append((list(ids), len(rows), {"images": urls, "index": index} if urls else {}))
    if len(runs) == 1:
        ids, n, with_images = runs[0]
        return send(ids, n, dispatched, **with_images)
    identities = [next_identity() for _ in runs]  # drawn here, in the group's thread, in row order
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="stream-episode") as pool:
        sent = list(pool.map(lambda run, i: send(run[0], run[1], dispatched, i, **run[2]), runs, identities))
    return [choice for choices, _ in sent for choice in choices], max(newest for _, newest in sent)


def _chunks(batch: list, prompt_ids: list[list[int]], size: int):
    """(rows, prompt ids) of each `size` consecutive rows: TRL's copies of one prompt, whatever their prompts say
    (an environment's rows may carry no prompt: its reset makes it)."""
    for start in range(0, len(batch), size):
        yield batch[start : start + size], list(prompt_ids[start])


def _groups(batch: list, prompt_ids: list[list[int]], keys: list | None = None):
    """(rows, prompt ids) of each run of consecutive rows with the same prompt ids (and the same `keys`: images)."""
    keys = keys or [None] * len(batch)
    start = 0
    for end in range(1, len(batch) + 1):
        if end == len(batch) or list(prompt_ids[end]) != list(prompt_ids[start]) or keys[end] != keys[start]:
            yield batch[start:end], list(prompt_ids[start])
            start = end
