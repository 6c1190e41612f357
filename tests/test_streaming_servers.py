"""Streaming rollout in training runs over real `trl-scale serve` processes (GRPO, PPO): every prompt group read is
trained once or still out at the end, none twice; no trained completion is older than the bound; slow answers are
delayed, not starved; a server killed mid-stream loses and duplicates nothing; a resume neither repeats nor skips.
Each prompt carries an `id` column, which TRL hands to the reward function with the row it trained on."""

import json
import threading
import time
from collections import Counter

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

import trl_scale
from trl_scale.toy import TOY_WORDS

from .helpers import cpu_args, record_generations, reload_checkpoint, saved_state, start_servers, token_parity_reward

pytest.importorskip("fastapi")

GROUP = 4


def id_dataset(count: int = 96) -> Dataset:
    """Distinct prompts, each with its own id."""
    return Dataset.from_list(
        [{"prompt": f"{TOY_WORDS[i % 40]} {TOY_WORDS[(i // 40) % 40]} {TOY_WORDS[7]}", "id": i} for i in range(count)]
    )


class TrainedIds:
    """A reward function that also records, per step, the ids of the rows it scores (the rows trained on)."""

    __name__ = "recorded_reward"

    def __init__(self):
        self.by_step: list[list[int]] = []

    def __call__(self, completion_ids, id, **kwargs):
        self.by_step.append(list(id))
        return token_parity_reward(completion_ids)

    def counts(self) -> Counter:
        return Counter(i for ids in self.by_step for i in ids)


def streaming_run(method, model_path, out, urls, recorder, **overrides):
    settings = dict(
        max_completion_length=6,
        max_steps=6,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_urls=urls,
        weight_sync_timeout=60,
        rollout_request_timeout=60,
        async_rollout_staleness=1,
        generation_kwargs={"seed": 0},
        shuffle_dataset=False,  # ids are read in order: what was skipped can be named
    )
    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    if method == "grpo":
        settings["num_generations"] = GROUP
    else:
        settings.update(num_ppo_epochs=1, num_mini_batches=1)
    peft_config = overrides.pop("peft_config", None)
    eval_dataset = overrides.pop("eval_dataset", None)
    return trainer_cls(
        model=model_path,
        reward_funcs=recorder,
        args=config_cls(**cpu_args(out, **{**settings, **overrides})),
        train_dataset=id_dataset(),
        eval_dataset=eval_dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=peft_config,
    )


class _DeadlineCounts(dict):
    """The stream's counts, setting `reached` once a batch waits for a group at its deadline."""

    def __init__(self, counts: dict):
        super().__init__(counts)
        self.reached = threading.Event()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if key == "waited_for_deadline" and value > 0:
            self.reached.set()


def slow_first_attempts(trainer, ids: set[int], seconds: float | None = None) -> list[int]:
    """The servers' answers for these prompts' first requests come late (a long answer): `seconds` late, or (None)
    held until a batch waits for them at their deadline, which forces that order however slow the machine's steps
    are. Returns the ids of the requests sent, in order."""
    generation = trainer.vllm_generation
    prompt_to_id = {}
    tokenize = generation.ahead.streamer.tokenize
    for row in id_dataset():
        prompt_to_id[tuple(tokenize([row["prompt"]])[0])] = row["id"]
    sent, complete = [], generation.client.complete
    counts = generation.ahead.streamer.counts = _DeadlineCounts(generation.ahead.streamer.counts)

    def complete_slowly(prompt, *args, **kwargs):
        row_id = prompt_to_id[tuple(prompt)]
        first = row_id not in sent
        sent.append(row_id)
        choices = complete(prompt, *args, **kwargs)
        if first and row_id in ids:
            if seconds is None:
                counts.reached.wait(timeout=120)
            else:
                time.sleep(seconds)
        return choices

    generation.client.complete = complete_slowly
    return sent


def versions_recorder(trainer):
    """Per generated batch: the sync count when it was trained, and each completion's (first, newest) span."""
    return record_generations(trainer, lambda generation: list(generation.steps.newest_record().version_spans))


def check_once_each(trainer, recorder, group: int) -> set[int]:
    """Every id trained is trained as one whole group, once; returns the ids trained."""
    counts = recorder.counts()
    assert set(counts.values()) == {group}, counts  # a group's rows together, and no group twice
    streamer = trainer.vllm_generation.ahead.streamer
    left = Counter(row["id"] for g in [*streamer.out, *streamer.pending] for row in g.rows)
    assert not set(left) & set(counts)  # what is still out was not trained
    return set(counts)


@pytest.mark.parametrize("staleness", [1, 2])
def test_grpo_streams_every_group_once_within_the_bound_and_slow_answers_are_not_starved(
    servers, tiny_llama, tmp_path, staleness
):
    recorder = TrainedIds()
    trainer = streaming_run(
        "grpo", tiny_llama, tmp_path, [s.url for s in servers], recorder, async_rollout_staleness=staleness
    )
    assert trainer.vllm_generation.ahead.streamer is not None and trainer.vllm_generation.ahead.prefetcher is None
    slow = {1, 5}  # their answers are held until a batch waits for them at their deadline (as a long answer is)
    sent = slow_first_attempts(trainer, slow)
    seen = versions_recorder(trainer)
    trainer.train()
    trained = check_once_each(trainer, recorder, GROUP)
    assert len(trained) == 6 * 2  # 6 steps of 8 rows: 2 groups each
    ages = [now - first for now, spans in seen for first, _ in spans]
    assert len(seen) == 6 and max(ages) <= staleness and min(ages) >= 0
    assert all(first <= newest for _, spans in seen for first, newest in spans)
    assert slow <= trained  # delayed, not starved
    counts = trainer.vllm_generation.ahead.streamer.counts
    assert counts["dropped_stale"] == 0 and Counter(sent)[1] == Counter(sent)[5] == 1  # none sent twice
    if staleness == 1:
        assert counts["waited_for_deadline"] >= 1  # a batch waited for a slow answer
    logs = [h for h in trainer.state.log_history if "rollout/stream_groups_dropped_stale" in h]
    assert len(logs) == 6


@pytest.mark.parametrize("staleness", [1, 2])
def test_lora_streams_each_group_on_the_adapter_it_was_sent_with(servers, tiny_llama, tmp_path, staleness):
    """weight_sync='lora' streams: a sync loads the new adapter under a new name and a generation under way finishes
    on the adapter it was sent with, which stays loaded for `staleness` syncs. So every trained completion's tokens
    come from one version (first == newest), that of an adapter its request named, at most `staleness` syncs old;
    each group is trained once; and each server holds at most `staleness` + 1 of the run's adapters."""
    import requests
    from peft import LoraConfig

    recorder = TrainedIds()
    reload_checkpoint([s.url for s in servers], tiny_llama)  # the base the adapters land on (earlier runs synced)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = streaming_run(
        "grpo", tiny_llama, tmp_path, [s.url for s in servers], recorder, async_rollout_staleness=staleness,
        weight_sync="lora", peft_config=lora, learning_rate=1e-2,
    )  # fmt: skip
    generation = trainer.vllm_generation
    assert generation.ahead.streamer is not None and generation.syncer.mode.settings.keep_adapters == staleness
    named, complete = [], generation.client.complete

    def recording(prompt, n, model=None, *args, **kwargs):
        named.append(int(model.rsplit("-", 1)[1]))
        return complete(prompt, n, model, *args, **kwargs)

    generation.client.complete = recording
    seen = versions_recorder(trainer)
    trainer.train()
    check_once_each(trainer, recorder, GROUP)
    spans = [(now, first, newest) for now, batch in seen for first, newest in batch]
    assert len(seen) == 6 and all(first == newest for _, first, newest in spans)
    assert {first for _, first, _ in spans} <= set(named) and len(set(named)) >= 3
    assert all(0 <= now - first <= staleness for now, first, _ in spans)
    assert any(now > first for now, first, _ in spans)  # some trained after a newer adapter was loaded
    for server in servers:
        listed = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][1:]
        ours = [m["id"] for m in listed if m["id"].startswith(generation.syncer.version.rsplit("-", 1)[0])]
        assert len(ours) == staleness + 1, ours  # the current adapter and the `staleness` before it


def test_ppo_streams_within_the_bound(servers, tiny_llama, tmp_path):
    recorder = TrainedIds()
    trainer = streaming_run("ppo", tiny_llama, tmp_path, [s.url for s in servers], recorder, max_steps=4)
    seen = versions_recorder(trainer)
    trainer.train()
    check_once_each(trainer, recorder, 1)
    ages = [now - first for now, spans in seen for first, _ in spans]
    assert len(seen) == 4 and max(ages) <= 1 and min(ages) >= 0


def test_a_server_killed_mid_stream_loses_and_duplicates_nothing(tiny_llama, tmp_path):
    own = start_servers(tiny_llama, 2)
    try:
        recorder = TrainedIds()
        trainer = streaming_run(
            "grpo", tiny_llama, tmp_path, [s.url for s in own], recorder, max_steps=8, rollout_request_timeout=30
        )

        class KillOne(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 3:
                    own[0].stop()  # requests out on it fail over to the other server

        trainer.add_callback(KillOne())
        trainer.train()
        trained = check_once_each(trainer, recorder, GROUP)
        assert len(trained) == 8 * 2 and own[0].process.poll() is not None
    finally:
        for server in own:
            if server.process.poll() is None:
                server.stop()


def test_a_resume_trains_each_group_read_before_the_checkpoint_once(servers, tiny_llama, tmp_path):
    urls = [s.url for s in servers]
    first = TrainedIds()
    trainer = streaming_run(
        "grpo", tiny_llama, tmp_path, urls, first, max_steps=6, save_strategy="steps", save_steps=3
    )
    slow_first_attempts(trainer, {2}, seconds=1.5)  # one group is still out at the checkpoint
    trainer.train()
    assert saved_state(tmp_path / "checkpoint-3", "server_rollout") is not None
    first.by_step = first.by_step[:3]  # what was trained up to the checkpoint
    second = TrainedIds()
    resumed = streaming_run("grpo", tiny_llama, tmp_path / "resumed", urls, second, max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    before, after = first.counts(), second.counts()
    assert set(before.values()) == set(after.values()) == {GROUP}
    assert not set(before) & set(after)  # nothing trained twice across the resume
    assert len(before) == len(after) == 3 * 2
    # nothing read twice (a group trained before the checkpoint, or restored from it, is not read again) ...
    streamer = resumed.vllm_generation.ahead.streamer
    left = Counter(row["id"] for g in [*streamer.out, *streamer.pending] for row in g.rows)
    assert set(left.values()) <= {GROUP} and not set(left) & (set(before) | set(after))
    # ... and nothing skipped: the groups trained are the first ones read, but for those still out at the end
    assert set(range(12)) <= set(before) | set(after) | set(left)
    # resumed with another group size, its read-ahead groups would be joined two by two: refused, before a step
    regrouped = streaming_run(
        "grpo", tiny_llama, tmp_path / "regrouped", urls, TrainedIds(), max_steps=6, num_generations=GROUP // 2
    )
    with pytest.raises(ValueError, match=rf"with num_generations={GROUP}; this run has num_generations={GROUP // 2}"):
        regrouped.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def test_a_streaming_resume_inside_a_generation_window_trains_each_group_once(servers, tiny_llama, tmp_path):
    """Streaming with a generation spanning 2 optimizer steps: checkpoint-3 lies inside a window (its step 4 from
    the saved rollout buffer). Across the resume each group read is trained once, whole: none twice (the buffer's
    groups are not taken from the stream again), none lost (the groups the stream held are restored)."""
    urls = [s.url for s in servers]
    window = dict(steps_per_generation=2, max_steps=6)
    first = TrainedIds()
    trainer = streaming_run("grpo", tiny_llama, tmp_path, urls, first, save_strategy="steps", save_steps=3, **window)
    trainer.train()
    assert saved_state(tmp_path / "checkpoint-3", "server_rollout") is not None
    assert len(first.by_step) == 3  # one reward call per generation (2 steps each)
    first.by_step = first.by_step[:2]  # the generations trained up to the checkpoint: steps 1-2 and 3-4
    second = TrainedIds()
    resumed = streaming_run("grpo", tiny_llama, tmp_path / "resumed", urls, second, **window)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    before, after = first.counts(), second.counts()
    assert set(before.values()) == set(after.values()) == {GROUP}
    assert not set(before) & set(after), (sorted(before), sorted(after))  # nothing trained twice
    assert len(before) == 2 * len(after) == 2 * 2 * 8 // GROUP  # the third generation after the resume, whole
    streamer = resumed.vllm_generation.ahead.streamer
    left = Counter(row["id"] for g in [*streamer.out, *streamer.pending] for row in g.rows)
    assert set(range(12)) <= set(before) | set(after) | set(left)  # nothing skipped


def test_dynamic_sampling_tops_up_from_the_stream_within_the_bound(servers, tiny_llama, tmp_path):
    """Even ids get equal rewards (no signal): each trained group has one, the top-ups come from the stream (taken
    finished, within the staleness bound), and the trained groups are whole."""

    def even_flat(completion_ids, id, **kwargs):
        varied = [(sum((i + 1) * t for i, t in enumerate(ids)) % 97) / 97 for ids in completion_ids]
        return [0.5 if row_id % 2 == 0 else v for row_id, v in zip(id, varied)]

    trainer = streaming_run(
        "grpo",
        tiny_llama,
        tmp_path,
        [s.url for s in servers],
        even_flat,
        max_steps=4,
        dynamic_sampling=True,
        dynamic_sampling_max_oversampling=8.0,
    )
    trained = []  # per step: (sync count, ids, version spans) of the rows TRL's step scored

    def recording_rewards(inputs, prompts, completions, completion_ids_list):
        generation = trainer.vllm_generation
        trained.append(
            (generation.sync_count, [r["id"] for r in inputs], list(generation.steps.newest_record().version_spans))
        )
        return type(trainer)._calculate_rewards(trainer, inputs, prompts, completions, completion_ids_list)

    trainer._calculate_rewards = recording_rewards  # TRL's step calls it on the chosen rows only
    generation, takes = trainer.vllm_generation, []
    take_streamed = generation.ahead.take_streamed
    generation.ahead.take_streamed = lambda num_rows, **kw: takes.append(num_rows) or take_streamed(num_rows, **kw)
    trainer.train()
    assert len(trained) == 4 and len(takes) > 4  # top-ups taken from the stream, not generated apart
    for now, ids, spans in trained:
        assert all(i % 2 == 1 for i in ids), ids  # the flat (even) groups were dropped
        groups = [ids[k : k + GROUP] for k in range(0, len(ids), GROUP)]
        assert all(len(set(group)) == 1 for group in groups) and len(set(ids)) == len(groups)  # whole groups
        assert len(spans) == len(ids) and all(0 <= now - first <= 1 for first, _ in spans)
    assert [h["frac_reward_zero_std"] for h in trainer.state.log_history if "loss" in h] == [0.0] * 4
    dropped = [h["dynamic_sampling/groups_dropped"] for h in trainer.state.log_history if "loss" in h]
    assert sum(dropped) > 0


def test_an_ordered_resume_inside_a_generation_window_neither_repeats_nor_skips(servers, tiny_llama, tmp_path):
    """Ordered read-ahead with a generation batch spanning 2 steps: checkpoint-3 lies inside the batch of steps 3-4.
    The resumed run trains step 4 on the saved rollout and then generates the batch of steps 5-6 for the same
    prompts as the uninterrupted run: none again, none skipped (rewards are scored when a batch is trained)."""
    urls = [s.url for s in servers]
    window = dict(async_rollout_mode="ordered", steps_per_generation=2, save_strategy="steps", save_steps=3)
    uninterrupted = TrainedIds()
    streaming_run("grpo", tiny_llama, tmp_path / "full", urls, uninterrupted, max_steps=6, **window).train()
    assert len(uninterrupted.by_step) == 3 and len(set(uninterrupted.counts())) == 3 * 4  # 4 groups per batch
    resumed_ids = TrainedIds()
    resumed = streaming_run("grpo", tiny_llama, tmp_path / "resumed", urls, resumed_ids, max_steps=6, **window)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed_ids.by_step == [uninterrupted.by_step[2]]
    assert resumed.state.global_step == 6


class TrainedAndEvaluated(TrainedIds):
    """`TrainedIds` for the training step's rows; an evaluation's rows and rewards kept apart (`evaluated`)."""

    def __init__(self):
        super().__init__()
        self.trainer, self.evaluated = None, []

    def __call__(self, completion_ids, id, **kwargs):
        rewards = token_parity_reward(completion_ids)
        if self.trainer.model.training:
            self.by_step.append(list(id))
        else:
            self.evaluated.append((list(id), rewards))
        return rewards


EVAL_IDS = range(400, 404)  # prompts of their own (id_dataset's first 96 never make them)


@pytest.mark.parametrize("mode", ["synchronous", "ordered", "streaming"])
def test_evaluation_during_training_generates_at_the_current_weights_apart_from_training(
    servers, tiny_llama, tmp_path, mode
):
    """TRL's `eval_strategy` with server rollout: each evaluation's completions are generated then, through the
    router, by the weights just trained (the sampler's log-probs equal the policy's), its pass@k per reward function
    is the plain computation over the rewards it got, and no evaluation prompt is trained nor taken from what was
    read ahead for training (ordered: the prefetch served training batches only; streaming: every group once)."""
    from .test_evaluation import plain_pass_rates

    recorder = TrainedAndEvaluated()
    modes = {"synchronous": {"async_rollout_staleness": 0}, "ordered": {"async_rollout_mode": "ordered"}}
    trainer = streaming_run(
        "grpo",
        tiny_llama,
        tmp_path,
        [s.url for s in servers],
        recorder,
        eval_strategy="steps",
        eval_steps=3,
        num_generations_eval=GROUP,
        per_device_eval_batch_size=GROUP * len(EVAL_IDS),
        eval_pass_at_k=[1, GROUP],
        eval_success_threshold=0.5,
        eval_dataset=id_dataset(max(EVAL_IDS) + 1).select(EVAL_IDS),
        **modes.get(mode, {}),
    )
    recorder.trainer = trainer
    trainer.train()
    logs = [log for log in trainer.state.log_history if "eval_reward" in log]
    assert len(logs) == len(recorder.evaluated) == 2  # after steps 3 and 6, one batch each
    for log, (ids, rewards) in zip(logs, recorder.evaluated):
        assert sorted(ids) == sorted(i for i in EVAL_IDS for _ in range(GROUP))
        assert log["eval_sampling/sampling_logp_difference/max"] <= 1e-4, log  # the weights just trained
        for k in (1, GROUP):
            expected = plain_pass_rates(rewards, GROUP, k, 0.5)
            assert log[f"eval_rewards/recorded_reward/pass@{k}"] == pytest.approx(expected, abs=1e-6), (k, log)
    trained = set(recorder.counts())
    assert len(trained) == 6 * 2 and not trained & set(EVAL_IDS)
    if mode == "streaming":
        check_once_each(trainer, recorder, GROUP)
    if mode == "ordered":  # the prefetch was asked for the 6 training batches only, and served them
        prefetch = trainer.vllm_generation.ahead.prefetcher
        assert prefetch.served_from_prefetch + prefetch.generated_now == 6, vars(prefetch)
        assert prefetch.served_from_prefetch >= 5


def test_a_streaming_runs_timeline_accounts_for_its_steps_with_token_ages_and_busy_servers(
    servers, tiny_llama, tmp_path
):
    """`rollout_timeline` on a streaming run: the trace accounts for every step (its trainer lanes sum to the step's
    wall time, measured apart), waiting for groups and weight syncs among them, each server's requests on its lane;
    the PNG is drawn; each step logs its tokens' ages (within the bound, summing to 1) and each server's busy
    fraction. A group-aged token recorded as fresh, or a phase counted twice, turns it red."""
    from .test_timeline import StepEnds, check_trace_accounts_for_steps

    recorder = TrainedIds()
    urls = [s.url for s in servers]
    trainer = streaming_run("grpo", tiny_llama, tmp_path, urls, recorder, rollout_timeline=True)
    ends = StepEnds()
    trainer.add_callback(ends)
    seen = record_generations(
        trainer,
        lambda generation: [
            (span, len(lp))
            for span, lp in zip(
                generation.steps.newest_record().version_spans, generation.steps.newest_record().sampler_logprobs
            )
        ],
    )
    trainer.train()
    recorded = check_trace_accounts_for_steps(tmp_path, ends.ends, 6)
    assert any(s["lanes"].get("wait for groups", 0) > 0 for s in recorded)
    assert all(s["lanes"].get("weight sync", 0) > 0 for s in recorded)
    trace = json.loads((tmp_path / "timeline" / "trace.json").read_text())
    groups = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    requests_by_server = Counter(
        groups[e["pid"]] for e in trace["traceEvents"] if e["ph"] == "b" and e["cat"] == "request"
    )
    assert set(requests_by_server) == set(urls), requests_by_server
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == len(seen) == 6
    for log, (now, completions) in zip(logs, seen):
        ages = [log[f"rollout/token_age/{age}"] for age in (0, 1)]
        assert sum(ages) == pytest.approx(1.0) and "rollout/token_age/over_bound" not in log
        old_tokens = sum(tokens for (first, _), tokens in completions if now - first == 1)
        assert ages[1] == pytest.approx(old_tokens / sum(tokens for _, tokens in completions)), (log, completions)
        busy = [log["rollout/busy_fraction/server0"], log["rollout/busy_fraction/server1"]]
        assert all(0.0 <= b <= 1.0 for b in busy), busy
    assert any(log["rollout/token_age/1"] > 0 for log in logs)  # streamed groups were trained a sync later
    assert max(log["rollout/busy_fraction/server0"] + log["rollout/busy_fraction/server1"] for log in logs) > 0.2
