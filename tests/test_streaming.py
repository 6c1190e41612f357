"""The streaming engine's invariants, with a stand-in for the servers whose answers finish when a test says so (the
losing orders forced, not waited for): nothing lost or trained twice, no group trained older than the bound, the
version taken when a request is sent, a long answer delayed but not starved, the window bounded, a resume that
neither repeats nor skips. Against real servers: tests/test_async_rollout.py and tests/test_real_vllm.py."""

import threading
import time

import pytest

from trl_scale.rollout.seeds import RequestSeeds
from trl_scale.rollout.streaming import StreamingRollout


class Servers:
    """Answers a group's request when `finish(prompt)` is called (or at once for prompts in `instant`)."""

    def __init__(self, instant=()):
        self.instant = set(instant)
        self.gates: dict[int, threading.Event] = {}
        self.sent: list[int] = []
        self.version = 1  # the sync count, as the trainer holds it: nothing is sent before the first sync
        self.lock = threading.Lock()
        self.max_out = 0
        self.out = 0

    def gate(self, prompt: int) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(prompt, threading.Event())

    def finish(self, *prompts: int) -> None:
        for prompt in prompts:
            self.gate(prompt).set()

    def send(self, prompt_ids, n, dispatched, identity=None):
        prompt = prompt_ids[0]
        dispatched()
        with self.lock:
            self.sent.append(prompt)
            ordinal = len(self.sent)  # which send this answer is from
            self.out += 1
            self.max_out = max(self.max_out, self.out)
        if prompt not in self.instant:
            assert self.gate(prompt).wait(timeout=30), f"prompt {prompt} never finished"
        with self.lock:
            self.out -= 1
        return [{"token_ids": [prompt, ordinal], "text": f"{prompt}"} for _ in range(n)], self.version


def batch(prompts, group=2):
    """Rows as TRL's sampler makes them: `group` consecutive copies of each prompt."""
    return [{"prompt": p, "column": f"answer-{p}"} for p in prompts for _ in range(group)]


def make(servers, staleness=1, groups_per_batch=2):
    return StreamingRollout(
        staleness,
        lambda prompts: [[p] for p in prompts],
        servers.send,
        groups_per_batch,
        version=lambda: servers.version,
    )


def wait_until(condition, what):
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what()
        time.sleep(0.01)


def wait_sent(servers, count):
    wait_until(lambda: len(servers.sent) >= count, lambda: servers.sent)


def test_groups_are_taken_as_they_finish_with_their_own_rows():
    servers = Servers()
    stream = make(servers, groups_per_batch=2)  # before the first batch: (k + 1) x 2 groups out
    stream.note_upcoming(batch([1, 2]))
    stream.note_upcoming(batch([3, 4]))
    wait_sent(servers, 4)
    servers.finish(4)  # the second batch's prompt finishes first, then one of the first batch's
    time.sleep(0.1)
    servers.finish(2)
    taken = stream.take(4)
    assert [row["prompt"] for row in taken.rows] == [4, 4, 2, 2]  # in the order they finished
    assert [row["column"] for row in taken.rows] == ["answer-4"] * 2 + ["answer-2"] * 2  # each row its own columns
    assert [c["token_ids"][0] for c in taken.choices] == [4, 4, 2, 2]
    assert taken.prompt_ids == [[4], [4], [2], [2]]
    stream.close()


def test_a_stream_closed_at_the_end_of_a_run_refuses_batches_and_reopens_for_the_next():
    """`train()` closes the stream at its end; a second `train()` reopens it (before, it waited forever for groups a
    closed stream would never send: found with real vLLM, `tests/test_fleet_vllm.py`)."""
    servers = Servers(instant=set(range(100)))
    stream = make(servers, groups_per_batch=1)
    stream.note_upcoming(batch([1]))
    stream.note_upcoming(batch([2]))
    assert sorted(row["prompt"] for row in stream.take(2).rows) in ([1, 1], [2, 2])  # which finished first: timing
    stream.close()
    with pytest.raises(RuntimeError, match="closed stream"):
        stream.take(2, timeout=5)
    stream.reopen()
    assert not stream.out and not stream.pending  # the closed run's groups are forgotten
    stream.note_upcoming(batch([7]))
    assert [row["prompt"] for row in stream.take(2, timeout=5).rows] == [7, 7]
    stream.close()


def test_nothing_is_lost_or_trained_twice_and_no_group_is_older_than_the_bound():
    servers = Servers(instant=set(range(100)) - {5, 11})  # two long answers among short ones
    threading.Timer(0.5, servers.finish, (5, 11)).start()
    stream = make(servers, staleness=1, groups_per_batch=3)
    trained, ages = [], []
    for step in range(10):
        stream.note_upcoming(batch([3 * step, 3 * step + 1, 3 * step + 2]))
    for step in range(8):
        servers.version = step + 1  # a sync before each batch
        taken = stream.take(6)
        trained += [row["prompt"] for row in taken.rows[::2]]
        ages += [servers.version - first for first, _ in taken.spans]
    assert len(trained) == len(set(trained)) == 24  # none twice
    assert max(ages) <= 1 and min(ages) >= 0
    assert {5, 11} <= set(trained)  # the long answers were waited for at their deadline ...
    assert stream.counts["waited_for_deadline"] >= 1 and stream.counts["dropped_stale"] == 0  # ... not dropped
    left = {g.prompt_ids[0] for g in [*stream.out, *stream.pending]}
    assert set(trained) | left == set(range(30)) and not set(trained) & left  # none lost
    stream.close()


def test_the_version_is_the_one_a_request_was_sent_at_not_the_one_it_finished_at():
    servers = Servers()
    stream = make(servers, staleness=2, groups_per_batch=1)
    stream.note_upcoming(batch([1]))
    wait_sent(servers, 1)
    servers.version = 2  # a sync lands while the answer is generating
    servers.finish(1)
    taken = stream.take(2)
    assert taken.spans == [(1, 2), (1, 2)]  # sent at 1 (its first token's weights), finished at 2
    stream.close()


def test_a_request_sent_with_older_weights_than_at_its_dispatch_takes_their_version():
    """LoRA: a request names the adapter the trainer served when it was built; dispatched after a sync it still
    runs on that adapter, whose version the answer reports (newest < version at dispatch): that is its version."""

    class OlderAdapter(Servers):
        def send(self, prompt_ids, n, dispatched, identity=None):
            named = self.version  # the adapter the request names
            self.version = named + 1  # a sync lands before the router dispatches it
            choices, _ = super().send(prompt_ids, n, dispatched)
            return choices, named

    servers = OlderAdapter(instant={1})
    stream = make(servers, staleness=2, groups_per_batch=1)
    stream.note_upcoming(batch([1]))
    taken = stream.take(2)
    assert taken.spans == [(1, 1), (1, 1)]
    stream.close()


def test_a_long_answer_is_waited_for_at_its_deadline_not_dropped():
    servers = Servers(instant=set(range(2, 20)))  # 1 is a long answer
    stream = make(servers, staleness=1, groups_per_batch=1)
    stream.note_upcoming(batch([1, 2, 3]))
    stream.note_upcoming(batch([4, 5, 6]))
    taken = stream.take(2)  # version 1: 1 and 2 were sent; 2 has finished
    assert [r["prompt"] for r in taken.rows] == [2, 2]
    servers.version = 2  # 1 (sent at 1) is due now: the batch waits for it rather than take 3
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("taken", stream.take(2)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # waiting for the long answer
    servers.finish(1)
    waiter.join(timeout=10)
    assert [r["prompt"] for r in result["taken"].rows] == [1, 1] and result["taken"].spans[0][0] == 1
    assert stream.counts["waited_for_deadline"] == 1 and stream.counts["dropped_stale"] == 0
    assert servers.sent.count(1) == 1
    stream.close()


def test_a_group_older_than_the_bound_is_dropped_and_sent_again_first():
    """Only what the window cannot prevent (here: two syncs with no batch between) is ever too old."""
    servers = Servers(instant=set(range(2, 20)))  # 1 is a long answer
    stream = make(servers, staleness=1, groups_per_batch=1)
    stream.note_upcoming(batch([1, 2, 3]))
    stream.note_upcoming(batch([4, 5, 6]))
    stream.take(2)  # version 1: 2
    servers.version = 3  # 1, sent at 1, would train two versions old
    taken = stream.take(2)
    assert 1 not in [r["prompt"] for r in taken.rows] and stream.counts["dropped_stale"] == 1
    order = [g.prompt_ids[0] for g in [*stream.out, *stream.pending] if g.prompt_ids[0] in (1, 4, 5, 6)]
    assert order[0] == 1  # sent again before what was queued
    wait_until(lambda: servers.sent.count(1) >= 2, lambda: servers.sent)  # the re-send reaches the stand-in
    servers.version = 4  # due: waited for; the answer used is the re-send's, not the abandoned attempt's
    servers.finish(1)
    taken = stream.take(2)
    resent = [i + 1 for i, p in enumerate(servers.sent) if p == 1][1]
    assert [r["prompt"] for r in taken.rows] == [1, 1] and taken.spans[0][0] == 3
    assert [c["token_ids"][1] for c in taken.choices] == [resent] * 2
    stream.close()


def test_no_group_is_sent_that_would_be_too_old_by_its_turn():
    """A group sent at version V is trained by the batch at V + k at the latest: no more are out than the batches
    up to then take (with every answer short, one more would go stale waiting its turn)."""
    servers = Servers()
    stream = make(servers, staleness=1, groups_per_batch=3)
    for step in range(4):
        stream.note_upcoming(batch([10 * step + i for i in range(3)]))
    wait_sent(servers, 6)  # before the first batch: the batches at 0 and 1 take 6
    time.sleep(0.2)
    assert len(servers.sent) == 6
    servers.finish(0, 1, 2)
    stream.take(6)  # the batch at 0 is taken: only the batch at 1 is left for a group sent now, and 3 are out
    time.sleep(0.2)
    assert len(servers.sent) == 6 and len(stream.out) == 3
    servers.version = 2
    servers.finish(10, 11, 12)
    stream.take(6)  # the sync: the batches at 1 and 2 take the groups sent now
    wait_sent(servers, 9)
    assert servers.max_out <= 6 and stream.counts["dropped_stale"] == 0
    servers.finish(*range(40))
    stream.close()


def test_a_failed_request_fails_the_batch_that_takes_it():
    def send(prompt_ids, n, dispatched, identity=None):
        dispatched()
        raise RuntimeError("no rollout server answered")

    stream = StreamingRollout(1, lambda prompts: [[p] for p in prompts], send, 1, version=lambda: 1)
    stream.note_upcoming(batch([1]))
    with pytest.raises(RuntimeError, match="no rollout server answered"):
        stream.take(2, timeout=10)
    stream.close()


def test_a_resume_trains_what_was_read_and_not_trained_once_and_reads_on_past_it():
    servers = Servers(instant=set(range(100)) - {1})
    stream = make(servers, staleness=1, groups_per_batch=2)
    for step in range(3):
        stream.note_upcoming(batch([2 * step, 2 * step + 1]))
    trained = [r["prompt"] for r in stream.take(4).rows[::2]]  # 1 still running
    state = stream.state(batches_read_ahead=2)
    stream.close()
    resumed_servers = Servers(instant=set(range(100)))
    resumed = make(resumed_servers, staleness=1, groups_per_batch=2)
    resumed.restore(state)
    for step in range(1, 5):  # the resumed data starts at the step's batch: the first two were read already
        resumed.note_upcoming(batch([2 * step, 2 * step + 1]))
    for _ in range(3):
        trained += [r["prompt"] for r in resumed.take(4).rows[::2]]
    assert sorted(trained) == list(range(8)) and len(trained) == len(set(trained))
    resumed.close()


def test_nothing_is_sent_before_the_runs_first_weight_sync():
    """Before it the servers hold the weights they were started with, or another run's: a completion sampled then
    would carry a version that names none of this run's weights."""
    servers = Servers(instant=set(range(10)))
    servers.version = 0
    stream = make(servers, staleness=1, groups_per_batch=2)
    stream.note_upcoming(batch([1, 2]))
    time.sleep(0.2)
    assert servers.sent == []
    servers.version = 1  # the trainer's first sync, before its first batch
    taken = stream.take(4)
    assert sorted(r["prompt"] for r in taken.rows[::2]) == [1, 2] and {f for f, _ in taken.spans} == {1}
    stream.close()


class Calls:
    """A stand-in whose every request is its own call: answered when the test says (`answer(ordinal)`), and whose
    `dispatched` callback the test can run again, as the client does when it fails a request over to another
    server."""

    def __init__(self):
        self.calls: list[dict] = []
        self.lock = threading.Lock()
        self.version = 1

    def send(self, prompt_ids, n, dispatched, identity=None):
        call = {"prompt": prompt_ids[0], "dispatched": dispatched, "answer": threading.Event()}
        with self.lock:
            self.calls.append(call)
            call["ordinal"] = len(self.calls)
        dispatched()
        assert call["answer"].wait(timeout=30), f"call {call['ordinal']} never answered"
        return [{"token_ids": [call["prompt"], call["ordinal"]]} for _ in range(n)], self.version

    def of(self, prompt):
        return [c for c in self.calls if c["prompt"] == prompt]


def test_an_abandoned_attempt_neither_retags_nor_overwrites_the_resend():
    """A group dropped as too old is sent again; its first attempt is abandoned but still running. Forced, in the
    losing order: that attempt fails over (its dispatch callback runs again) after the re-send was tagged, and it
    answers after the re-send did. The group keeps the re-send's version and answer."""
    calls = Calls()
    stream = StreamingRollout(1, lambda prompts: [[p] for p in prompts], calls.send, 1, version=lambda: calls.version)
    stream.note_upcoming(batch([1, 2, 3]))
    wait_until(lambda: len(calls.of(1)) == 1 and len(calls.of(2)) == 1, lambda: calls.calls)
    calls.of(2)[0]["answer"].set()
    stream.take(2)  # version 1: prompt 2
    (group,) = [g for g in stream.out if g.prompt_ids[0] == 1]
    abandoned = group.future
    calls.version = 3

    def answer_3_once_sent():
        wait_until(lambda: calls.of(3), lambda: calls.calls)
        calls.of(3)[0]["answer"].set()

    threading.Thread(target=answer_3_once_sent, daemon=True).start()
    taken = stream.take(2)  # version 3: prompt 1, sent at 1, is too old: dropped and sent again (at 3)
    assert [r["prompt"] for r in taken.rows] == [3, 3] and stream.counts["dropped_stale"] == 1
    wait_until(lambda: len(calls.of(1)) == 2, lambda: calls.calls)
    first, resend = calls.of(1)
    assert group.first_version == 3
    calls.version = 4
    first["dispatched"]()  # the abandoned attempt fails over at version 4 ...
    assert group.first_version == 3  # ... and does not re-tag the re-send
    resend["answer"].set()
    wait_until(lambda: group.done, lambda: group)
    first["answer"].set()  # the abandoned attempt answers last ...
    abandoned.result(timeout=10)  # ... and has written whatever it would write
    taken = stream.take(2)  # version 4: due
    assert [c["token_ids"] for c in taken.choices] == [[1, resend["ordinal"]]] * 2  # the re-send's answer
    assert taken.spans[0][0] == 3
    stream.close()


def _generation_with_held_sync():
    """A `ServerRolloutGeneration` reduced to its version book (its syncer): the sync holds until `release` is
    set."""
    from types import SimpleNamespace

    from trl_scale.rollout.generation import ServerRolloutGeneration
    from trl_scale.rollout.syncer import WeightSyncer

    events = {"in_sync": threading.Event(), "release": threading.Event()}

    class Held(WeightSyncer):
        def _sync_with_retry(self, weights, check_fleet, version):
            events["in_sync"].set()
            assert events["release"].wait(timeout=10)

    generation = object.__new__(ServerRolloutGeneration)
    generation.settings = SimpleNamespace(streaming=True)
    client = SimpleNamespace(versions=SimpleNamespace(version=None))
    generation.client, generation.fleet = client, None
    generation.accelerator = SimpleNamespace(is_main_process=True)
    generation.syncer = Held(client, "r", None, managed=False)  # its own locks (its __init__ makes them)
    generation.syncer.mode = SimpleNamespace(name="shared_dir")
    generation.seeds = RequestSeeds(None)
    return generation, events


def test_an_answer_finishing_during_a_sync_records_the_syncs_weights_in_its_span():
    """Forced: the answer comes back while a sync is under way (a streaming sync lets it reach the new weights),
    so its span's newest version is the sync's."""
    generation, events = _generation_with_held_sync()
    answer = threading.Event()

    def request(prompts, batch, images=None):
        assert answer.wait(timeout=10)
        return [{"token_ids": [1]}]

    generation._request = request
    spanned = {}
    requester = threading.Thread(target=lambda: spanned.update(result=generation.request_spanned([[1]], 0)))
    requester.start()
    syncer = threading.Thread(target=generation.sync_weights)
    syncer.start()
    assert events["in_sync"].wait(timeout=10)
    answer.set()  # finishes while the sync is under way
    requester.join(timeout=10)
    assert spanned["result"][1] == 1
    events["release"].set()
    syncer.join(timeout=10)
    assert generation.sync_count == 1 and generation.syncer.newest_reachable() == 1


def test_the_version_book_never_shows_the_old_count_once_the_sync_is_over():
    """Forced: a reader asks for the newest version at the very moment the sync clears its flag. It must read the
    new count (before: the flag dropped first and the count rose after, so it read the old one)."""
    generation, events = _generation_with_held_sync()
    events["release"].set()
    seen = []
    readers = []
    cls = type(generation.syncer)

    def set_flag(self, value):
        self.__dict__["_syncing"] = value
        if value is False:  # a generation finishing at this instant, on another thread
            reader = threading.Thread(target=lambda: seen.append(self.newest_reachable()))
            reader.start()
            reader.join(timeout=0.2)
            readers.append(reader)

    cls.syncing = property(lambda self: self.__dict__.get("_syncing", False), set_flag)
    generation.sync_weights()
    for reader in readers:
        reader.join(timeout=10)
    assert seen == [1]


def test_a_tool_conversations_later_turns_count_in_its_version_span():
    """With `converse` (tool-using rollouts) a group finishes when its last turn does: its span's newest version is
    its later turns' newest, here two syncs after its first turn's."""
    calls = Calls()
    turns_started = threading.Event()
    later_turns_done = threading.Event()

    def converse(rows, prompt_ids, choices):
        turns_started.set()
        assert later_turns_done.wait(timeout=10)
        return 3  # the newest weights of its later turns

    stream = StreamingRollout(
        1, lambda prompts: [[p] for p in prompts], calls.send, 1, version=lambda: calls.version, converse=converse
    )
    stream.note_upcoming(batch([1]))
    wait_until(lambda: calls.of(1), lambda: calls.calls)
    calls.of(1)[0]["answer"].set()  # the first turn, at version 1
    assert turns_started.wait(timeout=10)
    (group,) = stream.out
    assert not group.done  # not finished while its later turns run
    later_turns_done.set()
    taken = stream.take(2, timeout=10)
    assert taken.spans == [(1, 3), (1, 3)]
    stream.close()


class _FuturesDoneLate:
    """A thread pool whose futures are marked done only when the test says so: the stream must learn that a group
    finished from the attempt itself (before, `take` read the Future, which its executor marks done only after the
    attempt's function has returned and notified, so a waiter woken by that notification could miss it, sleep on)."""

    def __init__(self):
        self.futures = []
        self.release = threading.Event()

    def submit(self, function):
        from concurrent.futures import Future

        future = Future()

        def run():
            function()
            self.release.wait(timeout=30)
            future.set_result(None)

        threading.Thread(target=run, daemon=True).start()
        self.futures.append(future)
        return future

    def shutdown(self, **kwargs):
        self.release.set()


def test_a_finished_group_is_seen_before_its_future_is_marked_done():
    servers = Servers(instant={1})
    stream = make(servers, groups_per_batch=1)
    late = _FuturesDoneLate()
    stream._pool = late
    stream.note_upcoming(batch([1]))
    taken = stream.take(2, timeout=5)  # TimeoutError when `take` waits on the Future
    assert [row["prompt"] for row in taken.rows] == [1, 1] and not late.futures[0].done()
    stream.close()


def make_ordered(servers, staleness=1, groups_per_batch=2):
    from trl_scale.rollout.ordered_stream import OrderedStream

    return OrderedStream(
        staleness,
        lambda prompts: [[p] for p in prompts],
        servers.send,
        groups_per_batch,
        version=lambda: servers.version,
    )


def test_ordered_batches_take_the_groups_in_read_order_whatever_finishes_first():
    servers = Servers()
    stream = make_ordered(servers, groups_per_batch=2)
    stream.note_upcoming(batch([1, 2]))
    stream.note_upcoming(batch([3, 4]))
    wait_sent(servers, 4)
    servers.finish(4, 3, 2)  # the first read (1) is the last to finish
    taken = []
    threading.Thread(target=lambda: taken.append(stream.take(4))).start()
    time.sleep(0.2)
    assert not taken  # it waits for 1, and does not take 3 or 4 (finished) in its place
    servers.finish(1)
    wait_until(lambda: taken, lambda: "the batch was never taken")
    assert [row["prompt"] for row in taken[0].rows] == [1, 1, 2, 2]
    assert [row["prompt"] for row in stream.take(4).rows] == [3, 3, 4, 4]
    stream.close()


def test_an_ordered_sync_waits_for_every_group_out():
    """Each group generated whole by the weights it was sent with: the sync starts only once every group out has
    finished (the streaming engine lets it land inside them)."""
    servers = Servers(instant={1, 2})
    stream = make_ordered(servers, groups_per_batch=1)
    for prompt in (1, 2, 3):
        stream.note_upcoming(batch([prompt]))
    assert [row["prompt"] for row in stream.take(2).rows] == [1, 1]
    stream.before_sync()  # nothing out is running (2 has finished): returns at once
    servers.version = 2
    assert [row["prompt"] for row in stream.take(2).rows] == [2, 2]
    wait_sent(servers, 3)  # sent at the take, after the sync
    synced = threading.Event()
    threading.Thread(target=lambda: (stream.before_sync(), synced.set())).start()
    assert not synced.wait(timeout=0.3)  # group 3 is still out
    servers.finish(3)
    assert synced.wait(timeout=10)
    streaming = make(Servers(), groups_per_batch=1)
    streaming.note_upcoming(batch([9]))
    streaming.before_sync()  # returns at once with group 9 out
    stream.close()
    streaming.close()
