"""Asynchronous rollout over real `trl-scale serve` processes: staleness 0 is the synchronous run, staleness k
trains only on completions at most k weight versions old (read from the versions each batch carries), most
batches come from requests sent while the trainer trained, and training still learns."""

import json
import time

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts

from .helpers import (
    cpu_args,
    record_generations,
    server_grpo,
    server_rloo_or_ppo,
    sft_counting_model,
    start_servers,
    step_logs,
)

pytest.importorskip("fastapi")


def _grpo(model_path, out, urls, **overrides):
    # The servers sample reproducibly (a seed per request), so runs are comparable; 6 steps.
    return server_grpo(model_path, out, urls, **{"max_steps": 6, "generation_kwargs": {"seed": 0}, **overrides})


def _record_versions(trainer):
    """Per generated batch: the sync count when it was trained on, and the versions its completions came from."""
    return record_generations(trainer, lambda generation: generation.steps.newest_record().versions)


def test_staleness_0_is_the_synchronous_run(servers, tiny_llama, tmp_path):
    urls = [s.url for s in servers]
    keys = ("loss", "reward", "grad_norm")
    sync = _grpo(tiny_llama, tmp_path / "sync", urls, max_steps=3)
    sync.train()
    zero = _grpo(tiny_llama, tmp_path / "zero", urls, max_steps=3, async_rollout_staleness=0)
    seen = _record_versions(zero)
    zero.train()
    assert zero.vllm_generation.ahead is None  # synchronous: nothing read ahead
    assert step_logs(zero, keys) == step_logs(sync, keys)
    assert all(set(versions) == {now} for now, versions in seen)  # every batch from the weights just synced


@pytest.mark.parametrize("staleness, steps_per_generation", [(1, 1), (2, 1), (1, 2)])
def test_no_trained_completion_is_older_than_the_bound(servers, tiny_llama, tmp_path, staleness, steps_per_generation):
    trainer = _grpo(
        tiny_llama,
        tmp_path,
        [s.url for s in servers],
        async_rollout_staleness=staleness,
        async_rollout_mode="ordered",
        steps_per_generation=steps_per_generation,  # a generation batch serves this many steps (TRL repeats it)
    )
    seen = _record_versions(trainer)
    trainer.train()
    generations = 6 // steps_per_generation
    assert len(seen) == generations
    ages = [now - version for now, versions in seen for version in versions]
    assert max(ages) <= staleness and min(ages) >= 0
    assert max(ages) == staleness  # the bound is reached: batches really were generated ahead
    prefetcher = trainer.vllm_generation.ahead.prefetcher
    assert prefetcher.served_from_prefetch >= generations - staleness  # all but the first came from prefetches
    # Nothing generated past the last step: every request sent was trained on, none is left running.
    assert not prefetcher.in_flight and prefetcher.served_from_prefetch + prefetcher.generated_now == generations
    assert len(step_logs(trainer, ("loss",))) == 6
    # the correction's ratios before TRL clips them are logged beside TRL's clipped ones (stale batches: not all 1)
    raw_max, clipped_max = "sampling/importance_sampling_ratio_raw/max", "sampling/importance_sampling_ratio/max"
    logs = [log for log in step_logs(trainer, (raw_max, clipped_max)) if log]  # the steps that generated
    assert len(logs) == generations and all(log[raw_max] >= log[clipped_max] - 1e-6 for log in logs)
    assert any(abs(log[raw_max] - 1.0) > 1e-3 for log in logs)


def _delayed(send, seconds: float):
    def delayed(*args, **kwargs):
        time.sleep(seconds)
        return send(*args, **kwargs)

    return delayed


def test_staleness_1_trains_the_same_numbers_however_generation_and_training_are_timed(servers, tiny_llama, tmp_path):
    """Issue 20: the async trajectory must not depend on load. One run as fast as it goes, one whose steps and
    requests are each delayed (generation then lands at other points of training, and the router spreads requests
    over the two servers differently): equal losses, rewards, grad norms and completion versions."""
    from transformers import TrainerCallback

    class SlowSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.2)

    keys = ("loss", "reward", "grad_norm")
    runs = {}
    for timing in ("fast", "delayed"):
        trainer = _grpo(
            tiny_llama,
            tmp_path / timing,
            [s.url for s in servers],
            async_rollout_staleness=1,
            async_rollout_mode="ordered",
        )
        if timing == "delayed":
            trainer.add_callback(SlowSteps())
            trainer.vllm_generation._request = _delayed(trainer.vllm_generation._request, 1.0)
        seen = _record_versions(trainer)
        trainer.train()
        runs[timing] = (step_logs(trainer, keys), seen)
    assert len(runs["fast"][0]) == 6 and runs["fast"] == runs["delayed"], runs


def test_a_batch_whose_prompts_were_not_prefetched_is_generated_in_turn(servers, tiny_llama, tmp_path):
    """The prefetched request is matched by prompt ids: a batch that differs is generated now, never served the
    completions of other prompts."""
    urls = [s.url for s in servers]
    trainer = _grpo(tiny_llama, tmp_path, urls, async_rollout_staleness=1, async_rollout_mode="ordered", max_steps=3)
    prefetcher = trainer.vllm_generation.ahead.prefetcher
    tokenize = prefetcher.tokenize
    prefetcher.tokenize = lambda prompts: [ids + [7] for ids in tokenize(prompts)]  # never matches a real batch
    seen = _record_versions(trainer)
    trainer.train()
    assert prefetcher.served_from_prefetch == 0 and prefetcher.generated_now == 3
    assert all(set(versions) == {now} for now, versions in seen)


def test_async_rollout_needs_server_rollout(tmp_path):
    with pytest.raises(ValueError, match="async_rollout_staleness > 0 .* needs use_vllm=True, vllm_mode='server'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), async_rollout_staleness=1)
    with pytest.raises(ValueError, match="async_rollout_staleness=-1"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), async_rollout_staleness=-1)


# Nine 300-step runs (3 seeds x 3 modes, 60-130 s each on 2 cores) whose gap depends on load (issue 20): outside CI.
# In CI, the real-vLLM importance-sampling test and the prefetcher's bound test guard the same code. Its own time
# limit: the suite's 600 s is one test's, and these runs took 601 s under load (stopped by pytest-timeout).
@pytest.mark.learning
@pytest.mark.timeout(2400)
def test_staleness_1_learns_about_as_well_as_synchronous(tmp_path):
    """The reward gain (mean of the last 10 steps minus the first 10) of 300 steps of 32 samples after an SFT
    warm-up, averaged over 3 seeds: every run sees the same number of samples. Measured (2026-11-25, this machine):
    synchronous 0.70 / 0.37 / 0.25 (mean 0.44), ordered prefetch at staleness 1 0.61 / 0.31 / 0.26 (90 %),
    streaming 0.61 / 0.24 / 0.35 (91 %). One seed alone varies too much to judge (streaming 65 % to 141 % of
    synchronous). Margins, per the streaming issue: streaming gains at least 80 % of the synchronous gain, the
    ordered prefetch at least 60 %. The servers' requests are not seeded: a fixed `generation_kwargs` seed makes
    every request draw the same random numbers (each group of each step the same noise), which learned about half as
    much in every mode (synchronous 0.27 on seed 0)."""
    from trl_scale.toy import counting_reward
    from trl_scale.toy.tasks import COUNT_TARGET_LENGTH

    sft = sft_counting_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    servers = start_servers(sft, 2)
    gains = {"sync": [], "ordered": [], "streaming": []}
    try:
        for seed in (0, 2, 3):
            for name, staleness, mode in (("sync", 0, None), ("ordered", 1, "ordered"), ("streaming", 1, "streaming")):
                trainer = trl_scale.GRPOTrainer(
                    model=sft,
                    reward_funcs=counting_reward,
                    args=trl_scale.GRPOConfig(
                        **cpu_args(
                            tmp_path / f"run-{name}-{seed}",
                            per_device_train_batch_size=32,
                            num_generations=8,
                            max_completion_length=COUNT_TARGET_LENGTH,
                            max_steps=300,
                            lr_scheduler_type="constant",
                            use_vllm=True,
                            vllm_mode="server",
                            vllm_server_base_urls=[s.url for s in servers],
                            async_rollout_staleness=staleness,
                            async_rollout_mode=mode,
                            seed=seed,
                        )
                    ),
                    train_dataset=counting_prompts(8192, seed=seed),
                    processing_class=tokenizer,
                )
                trainer.train()
                rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
                assert len(rewards) == 300
                gains[name].append(sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10)
                print(json.dumps({"learning": name, "seed": seed, "gain": round(gains[name][-1], 4)}))
    finally:
        for server in servers:
            server.stop()
    mean = {name: sum(values) / len(values) for name, values in gains.items()}
    print(json.dumps({"learning": "mean", **{k: round(v, 4) for k, v in mean.items()}}))
    assert mean["sync"] > 0.15, gains  # the synchronous run learns (the baseline the margins are taken against)
    assert mean["streaming"] >= 0.8 * mean["sync"], gains
    assert mean["ordered"] >= 0.6 * mean["sync"], gains


def test_ppo_trains_on_prefetched_rollouts_within_the_bound(servers, tiny_llama, tmp_path):
    extra = {"num_ppo_epochs": 1, "num_mini_batches": 1}
    urls = [s.url for s in servers]
    trainer = server_rloo_or_ppo(
        "ppo",
        tiny_llama,
        tmp_path,
        urls,
        max_steps=4,
        async_rollout_staleness=1,
        async_rollout_mode="ordered",
        **extra,
    )
    seen = _record_versions(trainer)
    trainer.train()
    ages = [now - version for now, versions in seen for version in versions]
    assert len(seen) == 4 and max(ages) == 1 and min(ages) >= 0
    assert trainer.vllm_generation.ahead.prefetcher.served_from_prefetch == 3


def test_stale_completions_without_an_off_policy_correction_are_refused(tmp_path):
    """GRPO or RLOO with the importance-sampling correction off would train prefetched completions uncorrected."""
    import trl_scale

    server = dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"], use_cpu=True, bf16=False
    )
    for config_cls in (trl_scale.GRPOConfig, trl_scale.RLOOConfig):
        with pytest.raises(ValueError, match="vllm_importance_sampling_correction=False nothing corrects"):
            config_cls(
                output_dir=str(tmp_path),
                async_rollout_staleness=1,
                vllm_importance_sampling_correction=False,
                **server,
            )
        config_cls(output_dir=str(tmp_path), async_rollout_staleness=1, **server)  # corrected: accepted
    with pytest.raises(ValueError, match="RLOO's loss is per sequence. Fix: 'sequence_mask' or 'sequence_truncate'"):
        trl_scale.RLOOConfig(output_dir=str(tmp_path), vllm_importance_sampling_mode="token_truncate", **server)
    # a synchronous RLOO run corrects nothing: TRL's numbers (its servers' log-probs feed the mismatch figures only)
    assert not trl_scale.RLOOConfig(output_dir=str(tmp_path), **server).corrects_sampler_logprobs


def test_rloo_async_weights_each_sequence_by_its_importance_ratio(servers, tiny_llama, tmp_path, monkeypatch):
    """TRL's RLOO has no off-policy correction; trl-scale's weights each prefetched sequence's loss by
    exp(old_logps - sum of the servers' log-probs of its tokens), truncated at clip_max, by scaling its advantage
    (exactly the loss's weight: RLOO's per-sequence loss is linear in a positive factor of the advantage). Red when
    the correction is skipped or the ratio inverted; stale batches make some weights differ from 1."""
    import trl

    seen = []
    score = trl.RLOOTrainer._generate_and_score_completions

    def recording(self, inputs):
        batch = score(self, inputs)  # TRL's batch, before trl-scale's correction
        seen.append((batch["advantages"].clone(), list(self.vllm_generation.steps.newest_record().sampler_logprobs)))
        return batch

    monkeypatch.setattr(trl.RLOOTrainer, "_generate_and_score_completions", recording)
    trainer = server_rloo_or_ppo(
        "rloo",
        tiny_llama,
        tmp_path,
        [s.url for s in servers],
        max_steps=5,
        learning_rate=3e-2,  # the policy moves between syncs: prefetched batches are visibly stale
        async_rollout_staleness=1,
        vllm_importance_sampling_mode="sequence_truncate",
        generation_kwargs={"seed": 0},
    )
    corrected = []
    outer = trainer._generate_and_score_completions

    def keep(inputs):
        batch = outer(inputs)
        corrected.append({k: batch[k].clone() for k in ("advantages", "old_logps", "completion_mask")})
        return batch

    trainer._generate_and_score_completions = keep
    trainer.train()
    assert len(seen) == len(corrected) == 5
    weights = []
    for (advantages, sampler), batch in zip(seen, corrected):
        mask = batch["completion_mask"]
        sampling = torch.zeros(mask.shape)
        for i, values in enumerate(sampler):
            sampling[i, : len(values)] = torch.tensor(values[: mask.size(1)])
        expected = torch.exp(batch["old_logps"] - (sampling * mask).sum(1)).clamp(max=3.0)
        assert torch.allclose(batch["advantages"], advantages * expected, atol=1e-6)
        weights.append(expected)
    assert max((w - 1).abs().max().item() for w in weights) > 1e-2  # stale batches were corrected ...
    assert (weights[0] - 1).abs().max() < 1e-3  # ... and the first, generated on-policy, was not


def test_streaming_mode_is_refused_where_nothing_would_stream(tmp_path):
    server = dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"], use_cpu=True, bf16=False
    )
    with pytest.raises(ValueError, match="async_rollout_staleness=0 none does. Fix: async_rollout_staleness=1"):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), async_rollout_mode="streaming", **server)
    lora = trl_scale.GRPOConfig(output_dir=str(tmp_path), async_rollout_staleness=1, weight_sync="lora", **server)
    assert lora.async_rollout_mode == "streaming"  # a generation finishes on the adapter it started with
    with pytest.raises(ValueError, match="async_rollout_mode='fast': use 'ordered' or 'streaming'"):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), async_rollout_staleness=1, async_rollout_mode="fast", **server)
    config = trl_scale.GRPOConfig(
        output_dir=str(tmp_path), async_rollout_staleness=1, async_rollout_mode="streaming", **server
    )
    from trl_scale.rollout.settings import RolloutSettings

    assert RolloutSettings.from_config(config, logprobs=True, require_logprobs=True, run_id="r").streaming
    with pytest.raises(ValueError, match="async_rollout_interrupt='abort': use 'keep' .* or 'partial'"):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), async_rollout_interrupt="abort", **server)
    partial = trl_scale.GRPOConfig(
        output_dir=str(tmp_path), async_rollout_staleness=1, async_rollout_interrupt="partial", **server
    )
    settings = RolloutSettings.from_config(partial, logprobs=True, require_logprobs=True, run_id="r")
    assert settings.asynchronous.interrupt == "partial"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, r"with async_rollout_staleness=0 a sync waits for every answer, so none is cut. Fix: async_rollout_stal"),
        (
            {"async_rollout_staleness": 1, "async_rollout_mode": "ordered"},
            r"async_rollout_mode='ordered': ordered read-ahead lets the answers .* never cut\). Fix: "
            r"async_rollout_mode='streaming', or async_rollout_interrupt='keep'",
        ),
        (
            {"async_rollout_staleness": 1, "weight_sync": "lora"},
            r"weight_sync='lora': a LoRA sync loads the new adapter .* so none is cut. Fix: "
            r"async_rollout_interrupt='keep'",
        ),
    ],
)
def test_partial_rollout_is_refused_where_no_sync_cuts_an_answer(fields, message, tmp_path):
    """`async_rollout_interrupt="partial"` where it would do nothing: an error naming the setting and the fix."""
    server = dict(
        use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"], use_cpu=True, bf16=False
    )
    with pytest.raises(ValueError, match=message):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), async_rollout_interrupt="partial", **server, **fields)


def test_the_prefetcher_never_serves_a_batch_older_than_the_bound():
    """The bound itself: a request made at version v is served at versions v .. v + staleness and regenerated
    after; a batch is matched by its prompt ids only."""
    from concurrent.futures import Future

    from trl_scale.rollout.prefetch import RolloutPrefetcher

    def done(value):
        future = Future()
        future.set_result(value)
        return future

    for staleness in (1, 2):
        prefetcher = RolloutPrefetcher(
            staleness, lambda prompts: prompts, lambda ids, images: done(f"result of {ids}")
        )
        for age in range(4):
            prefetcher.note_upcoming([{"prompt": [age, age]}])
            prefetcher.submit_upcoming(version=10)
            taken = prefetcher.take([[age, age]], version=10 + age)
            if age <= staleness:
                assert taken == (f"result of {[[age, age]]}", 10), (staleness, age, taken)
            else:
                assert taken is None, (staleness, age, taken)
        assert prefetcher.take([[9, 9]], version=10) is None  # never requested
        assert prefetcher.served_from_prefetch == staleness + 1 and prefetcher.generated_now == 4 - staleness


def test_each_async_rollout_mode_has_its_read_ahead_engine_behind_one_interface():
    """`async_rollout_mode` picks the engine from READ_AHEAD_ENGINES (as `weight_sync` picks its mode): each
    implements the whole `ReadAhead` interface the trainer uses (save, restore, log, open, close, sync)."""
    import typing

    from trl_scale.rollout.ahead import READ_AHEAD_ENGINES, ReadAhead
    from trl_scale.rollout.prefetch import RolloutPrefetcher
    from trl_scale.rollout.settings import AsyncMode
    from trl_scale.rollout.streaming import StreamingRollout

    assert set(READ_AHEAD_ENGINES) == set(typing.get_args(AsyncMode)) == {"ordered", "streaming"}
    interface = {name for name in vars(ReadAhead) if not name.startswith("_")}
    from trl_scale.rollout.ordered_stream import OrderedStream

    for engine in (RolloutPrefetcher, StreamingRollout, OrderedStream):
        missing = {name for name in interface if not hasattr(engine, name) and name not in ("batches_ahead",)}
        assert not missing, f"{engine.__name__} lacks {missing}"
