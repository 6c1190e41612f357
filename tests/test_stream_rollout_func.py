"""TRL's `rollout_func`, streamed (GRPO over real `trl-scale serve` processes): called once per prompt group in the
stream's threads, never in the step; its generation calls (`trainer.vllm_generation.generate`, TRL's interface) are
routed and failed over (a server killed under it), and each group's version span runs from its first request to its
last (a second turn forced past a sync records the newer version); every group trained once, within the bound; its
extra keys reach the reward functions row by row; the settings it cannot run with are refused naming the fix."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer, TrainerCallback

import trl_scale
from trl_scale.routing import LeastOutstandingRouting

from .helpers import cpu_args, slowed_unevenly, start_servers, step_logs, token_parity_reward
from .test_streaming_servers import GROUP, TrainedIds, check_once_each, id_dataset

pytest.importorskip("fastapi")


class TwoTurns:
    """A user's generation loop: a first turn for the group, then a second turn per row continuing from its first
    answer (both turns the model's: `env_mask` 1), each through `trainer.vllm_generation.generate`. Rows whose id is
    in `hold` wait between the turns for the next weight sync (forcing a group whose tokens span two versions)."""

    def __init__(self, hold: set[int]):
        self.hold = hold
        self.calls: list[tuple[str, int]] = []  # (thread, id)
        self.held: list[int] = []  # ids whose second turn came after a sync
        self.stop = threading.Event()  # the run ended: nothing to wait for

    def __call__(self, prompts: list, trainer) -> dict:
        generation = trainer.vllm_generation
        row_id = int(prompts[0].split("#")[-1])
        self.calls.append((threading.current_thread().name, row_id))
        ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
        prompt_ids, first, first_logprobs, _ = generation.generate(ids, None, trainer.num_generations)
        if row_id in self.hold:
            synced = generation.sync_count
            while generation.sync_count == synced and not self.stop.wait(0.05):
                pass
            if generation.sync_count > synced:
                self.held.append(row_id)
        completion_ids, logprobs = [], []
        for prompt, turn, turn_logprobs in zip(prompt_ids, first, first_logprobs):
            _, second, second_logprobs, _ = generation.generate([prompt + turn], None, 1)
            completion_ids.append(turn + second[0])
            logprobs.append([v[0] for v in turn_logprobs] + [v[0] for v in second_logprobs[0]])
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "env_mask": [[1] * len(c) for c in completion_ids],
            "first_length": [len(turn) for turn in first],  # a list: one value per row
            "rollout_id": row_id,  # a scalar: TRL broadcasts it over the call's rows
        }


def hashed_dataset(count: int = 96):
    """`id_dataset` with each row's id readable from its prompt (a rollout_func sees prompts only)."""
    return id_dataset(count).map(lambda row: {"prompt": f"{row['prompt']} #{row['id']}"})


class Checked(TrainedIds):
    """Records the ids trained; checks the rollout's extra keys and each batch's version spans as TRL hands them."""

    def __init__(self):
        super().__init__()
        self.generation = None
        self.spans: list[tuple[int, list]] = []

    def __call__(self, completion_ids, id, first_length, rollout_id, **kwargs):
        assert list(rollout_id) == list(id)  # each row got its own group's scalar
        assert all(0 < n <= len(c) for n, c in zip(first_length, completion_ids))
        self.spans.append((self.generation.sync_count, list(self.generation.steps.newest_record().version_spans)))
        return super().__call__(completion_ids, id)


def kill_under_a_request(trainer, server) -> tuple[threading.Event, list[str]]:
    """Once armed, the next request the rollout_func sends to `server` finds it killed (`kill -9` right before the
    request goes out): that request must fail over to the other server. Returns the arming event and the errors of
    the requests sent to the killed server (the router's own count of a server's failures is of consecutive ones: a
    request answered before the kill and released after it resets it)."""
    transport, armed, lock = trainer.vllm_generation.client.transport, threading.Event(), threading.Lock()
    completions, failed = transport.completions, []

    def completions_or_kill(target, payload, timeout, before_resend=None):
        with lock:
            if armed.is_set() and target.url == server.url and server.process.poll() is None:
                server.process.kill()
                server.process.wait(timeout=10)
        try:
            return completions(target, payload, timeout, before_resend)
        except Exception as error:
            if target.url == server.url:
                failed.append(repr(error))
            raise

    transport.completions = completions_or_kill
    return armed, failed


def rollout_func_trainer(model, out, servers, recorder, rollout, **overrides):
    """Streaming GRPO (staleness 1) over `servers` with `rollout` as its rollout_func, `recorder` its reward."""
    settings = dict(
        num_generations=GROUP,
        max_completion_length=4,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=[s.url for s in servers],
        async_rollout_staleness=1,
        rollout_request_timeout=30,
        weight_sync_timeout=60,
        shuffle_dataset=False,
    )
    trainer = trl_scale.GRPOTrainer(
        model=model,
        reward_funcs=recorder,
        args=trl_scale.GRPOConfig(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=hashed_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model),
        rollout_func=rollout,
    )
    recorder.generation = trainer.vllm_generation
    return trainer


def test_a_streamed_rollout_func_runs_per_group_in_the_stream_routed_and_version_tagged(tiny_llama, tmp_path):
    own = start_servers(tiny_llama, 2)
    rollout, recorder = TwoTurns(hold={4, 5, 6}), Checked()
    try:
        trainer = rollout_func_trainer(tiny_llama, tmp_path, own, recorder, rollout, max_steps=8)
        armed, failed = kill_under_a_request(trainer, own[0])
        # Least outstanding, ties to the server that served fewer: server 0 gets one of the next two requests after
        # the arming (the latency policy may send every later request to the other server, and then nothing meets
        # the kill: seen in the suite)
        trainer.vllm_generation.client.rotation.policy = LeastOutstandingRouting()

        class Arm(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    armed.set()

        trainer.add_callback(Arm())
        trainer.train()
        rollout.stop.set()
    finally:
        for server in own:
            if server.process.poll() is None:
                server.stop()
    trained = check_once_each(trainer, recorder, GROUP)
    assert len(trained) == 8 * 2
    # called once per group sent, always in the stream's threads, never in the step
    assert {thread.split("_")[0] for thread, _ in rollout.calls} == {"stream"}, rollout.calls
    assert trained <= {row_id for _, row_id in rollout.calls}
    # routed: a request met the killed server and failed over (the run trained every step), the rest went elsewhere
    client = trainer.vllm_generation.client
    assert failed and client.servers[1].served > client.servers[0].served, (failed, client.servers)
    # version-tagged: within the bound, and a group whose second turn came after a sync spans both versions
    for now, spans in recorder.spans:
        assert len(spans) == 2 * GROUP and all(first <= newest <= now and now - first <= 1 for first, newest in spans)
    held_trained = set(rollout.held) & trained
    assert held_trained, (rollout.held, trained)
    batches = [(ids, spans) for ids, (_, spans) in zip(recorder.by_step, recorder.spans)]
    for ids, spans in batches:
        for row_id, (first, newest) in zip(ids, spans):
            if row_id in held_trained:
                assert newest > first, (row_id, first, newest)


def test_an_ordered_rollout_func_trains_the_same_numbers_however_timed(tiny_llama, tmp_path):
    """`async_rollout_mode="ordered"` runs the rollout_func in the stream's engine, reproducibly (a sync waits for
    every group out, batches take groups in read order): a run as fast as it goes and one slowed unevenly train the
    same rows with the same losses, rewards and grad norms; each group's turns all of one version, within the bound."""
    own = start_servers(tiny_llama, 2)
    runs = {}
    try:
        for delayed in (False, True):
            rollout, recorder = TwoTurns(hold=set()), Checked()
            trainer = rollout_func_trainer(
                tiny_llama,
                tmp_path / str(delayed),
                own,
                recorder,
                rollout,
                max_steps=4,
                async_rollout_mode="ordered",
                generation_kwargs={"seed": 0},  # each request sampled reproducibly (trl-scale serve seeds it)
            )
            if delayed:
                slowed_unevenly(trainer)
            trainer.train()
            assert {thread.split("_")[0] for thread, _ in rollout.calls} == {"stream"}, rollout.calls
            assert len(check_once_each(trainer, recorder, GROUP)) == 4 * 2
            spans = [(now, span) for now, batch in recorder.spans for span in batch]
            assert all(first == newest and 0 <= now - first <= 1 for now, (first, newest) in spans), spans
            assert any(now - first == 1 for now, (first, _) in spans)  # generated ahead
            runs[delayed] = (step_logs(trainer, ("loss", "reward", "grad_norm")), recorder.by_step)
    finally:
        for server in own:
            server.stop()
    assert runs[True] == runs[False]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"stream_rewards": True}, r"stream_rewards=True with a rollout_func.*Fix: stream_rewards=None"),
        ({"dynamic_sampling": True}, r"dynamic_sampling=True with a streamed rollout_func.*Fix: dynamic_sampling="),
    ],
)
def test_what_a_streamed_rollout_func_cannot_run_with_is_refused(tiny_llama, tmp_path, fields, match):
    """Refused at construction, before any server is reached (none listens at this URL)."""
    args = trl_scale.GRPOConfig(
        **cpu_args(
            tmp_path,
            num_generations=GROUP,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_urls=["http://127.0.0.1:9"],
            async_rollout_staleness=1,
            **fields,
        )
    )
    with pytest.raises(ValueError, match=match):
        trl_scale.GRPOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            args=args,
            train_dataset=hashed_dataset(),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
            rollout_func=TwoTurns(hold=set()),
        )
