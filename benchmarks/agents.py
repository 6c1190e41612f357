"""Slow rewards: GRPO step time when a verifier takes about as long as generating, against real vLLM servers.

Three modes on the same model, data, seed and servers, runs alternated: the synchronous run (staleness 0, what TRL
does), streaming at staleness 1 with the rewards computed in the step (TRL's `_calculate_rewards` after the batch is
taken), and streaming with the rewards computed in the stream (`stream_rewards=True`: each prompt group scored as soon
as it finishes, off the step).

The verifier: `--latency` seconds per completion, one completion after another within a call (a unit-test run per
answer, or a remote judge answering one request at a time), then the counting reward; it waits (sleeps), as a
verifier in another process or machine does, so calls on several threads overlap. Its default makes a group's rewards
take about as long as a group takes to generate here. Two vLLM CPU servers (`.venv-vllm`, `bash
scripts/setup_vllm.sh`) share one core, the trainer has the other (on 2 cores).

`--layers`, `--generations`, `--prompt-words` and `--answer-tokens` (the toy model's depth, completions per prompt,
words per prompt, tokens per completion; defaults 2, 8, 1-3, 24) set how long the trainer's own work (scoring,
backward, optimizer, weight sync) takes against generating a batch. The verifier's latency per group is matched,
measured first, to a group generated alone on the idle servers (`--match alone`, the default: a group's rewards take
as long as generating a group) or to a group's share of generating a step's batch (`--match share`: its prompts sent
at once, spread over both servers as a step asks for them; about a third of the former here, the servers batching a
step's groups). In the step TRL calls a reward function once for the whole batch, so a verifier that scores one
completion after another takes the batch's completions times its latency there; in the stream each group's call runs
on its own thread as the group finishes (`stream_reward_workers` at once).
`step_parts_s` in the JSON line gives each mode's parts: the rewards in the step, TRL's generate call (the generation
and weight sync when synchronous) and the rest (the trainer's work, weight sync and, streamed, the wait for finished
groups). With the rewards in the step a streaming step takes about rewards + rest, with them in the stream about the
rest alone, which the weight sync to the CPU servers (about 0.4 s a step at 6 layers) and the wait for generation hold
up here. Read the steady state from full runs: the first steps of a streamed run take groups generated ahead during the
warm-up (quick runs read lower).

`--verifier sandbox`: the reward is the sandboxed code verifier instead (`CodeExecutionReward`, each completion run
as a program in its own bubblewrap sandbox against the row's tests: the counting task with its answer as code,
`trl_scale.toy.code_task`); its time is what a sandbox takes here, not a chosen latency, and it spends CPU the
servers and the trainer also need (2 cores here).

Usage: python benchmarks/agents.py [--quick] [--latency S | --match alone|share] [--verifier sleep|sandbox]
[--layers N] [--generations N] [--prompt-words N] [--answer-tokens N]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # tests/real_vllm.py: the harness that starts real vLLM servers
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = {  # mode -> (async_rollout_staleness, stream_rewards)
    "sync": (0, False),
    "streaming_rewards_in_step": (1, False),
    "streaming_rewards_in_stream": (1, True),
}
GROUP = 8  # completions per prompt (--generations)
PROMPTS_PER_STEP = 8
ANSWER_TOKENS = 24
PROMPT_WORDS = 3  # words per prompt, at most (--prompt-words; from 2 fewer)


def slow_verifier(latency: float):
    """The counting reward, after `latency` seconds per completion scored (one after another)."""
    from trl_scale.toy import counting_reward

    def verifier(completions, **kwargs):
        time.sleep(latency * len(completions))
        return counting_reward(completions=completions, **kwargs)

    return verifier


def verifier_and_data(verifier: str, latency: float, prompt_words: int = PROMPT_WORDS):
    """The reward function and the prompts of a regime."""
    from trl_scale.toy import counting_code_prompts, counting_prompts, number_words_as_code

    if verifier == "sleep":
        return slow_verifier(latency), counting_prompts(
            4096, seed=0, min_len=max(1, prompt_words - 2), max_len=prompt_words
        )
    from trl_scale.rewards import CodeExecutionReward

    return CodeExecutionReward(extract=number_words_as_code), counting_code_prompts(4096, seed=0)


def run(
    model_path: str,
    urls: list[str],
    mode: str,
    latency: float,
    steps: int,
    warmup: int,
    out: str,
    verifier: str,
    group: int = GROUP,
    prompt_words: int = PROMPT_WORDS,
    answer_tokens: int = ANSWER_TOKENS,
) -> dict:
    from transformers import AutoTokenizer, TrainerCallback

    import trl_scale
    from trl_scale.callbacks import StepTimeCallback

    staleness, in_stream = MODES[mode]
    ends = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    reward, dataset = verifier_and_data(verifier, latency, prompt_words)
    trainer = trl_scale.GRPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=trl_scale.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=PROMPTS_PER_STEP * group,
            num_generations=group,
            max_completion_length=answer_tokens,
            max_steps=steps,
            learning_rate=1e-4,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_urls=urls,
            async_rollout_staleness=staleness,
            stream_rewards=in_stream,
            rollout_request_timeout=600,
            weight_sync_timeout=300,
            generation_kwargs={"ignore_eos": True},
        ),
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[StepTimeCallback()],
    )
    trainer.add_callback(Clock())
    trainer.train()
    trainer.vllm_generation.client.close()
    intervals = [b - a for a, b in zip(ends, ends[1:])][warmup:]
    logs = [h for h in trainer.state.log_history if "loss" in h][warmup + 1 :]
    step_s = statistics.mean(intervals)
    reward_s, generate_s = _mean(logs, "time/reward_s"), _mean(logs, "time/generate_s")
    return {
        "step_s": step_s,
        "reward_s_in_step": reward_s,
        "reward_s_in_stream": _growth_per_step(logs, "rewards/stream_seconds"),  # a running total
        "generate_call_s": generate_s,  # TRL's _generate: the generation itself in the synchronous run
        # the rest: scoring, forward, backward, optimizer, weight sync and, streamed, the wait for finished groups
        "rest_s": step_s - reward_s - generate_s,
    }


def _mean(logs: list[dict], key: str) -> float:
    values = [h[key] for h in logs if key in h]
    return statistics.mean(values) if values else 0.0


def _growth_per_step(logs: list[dict], key: str) -> float:
    if len(logs) < 2:
        return 0.0
    return (logs[-1].get(key, 0.0) - logs[0].get(key, 0.0)) / (len(logs) - 1)


def group_generation_seconds(
    urls: list[str], model_path: str, prompts: list[str], group: int, answer_tokens: int, repeats: int = 3
) -> dict[str, float]:
    """How long generating a group takes here, two ways (medians, each request its own prompts: no prefix-cache
    hits; the first of each kind warms up):

    - `alone`: one prompt's `group` answers of `answer_tokens` each, the only request on the idle servers (a group's
      generation time, as a verifier's latency is read against it);
    - `share`: a group's share of a step's batch (`PROMPTS_PER_STEP` prompts sent at once, spread over both servers as
      a step asks for them): shorter, the servers batch a step's groups."""
    from transformers import AutoTokenizer

    from trl_scale.rollout import RolloutClient

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    client = RolloutClient(urls, request_timeout=300)
    fresh = iter(prompts)

    def timed(count: int) -> float:
        batch = [tokenizer(next(fresh))["input_ids"] for _ in range(count)]
        start = time.perf_counter()
        client.generate(batch, n=group, max_tokens=answer_tokens, ignore_eos=True)
        return time.perf_counter() - start

    alone = [timed(1) for _ in range(repeats + 1)][1:]
    share = [timed(PROMPTS_PER_STEP) / PROMPTS_PER_STEP for _ in range(repeats + 1)][1:]
    client.close()
    return {"alone": statistics.median(alone), "share": statistics.median(share)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency", type=float, default=None, help="seconds per completion (default: measured)")
    parser.add_argument(
        "--match",
        choices=["alone", "share"],
        default="alone",
        help="the verifier's default latency per group: a group generated alone, or its share of a step's batch",
    )
    parser.add_argument("--verifier", choices=["sleep", "sandbox"], default="sleep")
    parser.add_argument("--prompt-words", type=int, default=PROMPT_WORDS, help="words per prompt (sleep verifier)")
    parser.add_argument("--generations", type=int, default=GROUP, help="completions per prompt")
    parser.add_argument("--layers", type=int, default=2, help="model depth: training time against generation")
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS, help="tokens per completion")
    args = parser.parse_args()
    from pinned_vllm import pinned_vllm_servers

    steps, warmup, repeats = (6, 2, 1) if args.quick else (10, 3, 2)
    results = {mode: [] for mode in MODES}
    with pinned_vllm_servers("agents-bench-", num_layers=args.layers) as (model_path, urls, work):
        _, dataset = verifier_and_data(args.verifier, 0.0, args.prompt_words)
        prompts = dataset["prompt"]
        generation = group_generation_seconds(urls, model_path, prompts, args.generations, args.answer_tokens)
        matched = None if args.latency is not None or args.verifier != "sleep" else args.match
        latency = args.latency if matched is None else generation[matched] / args.generations
        what = f"{latency:.4f} s per completion" if args.verifier == "sleep" else "a sandboxed run per completion"
        print(f"a group generates in {generation}; the verifier takes {what}", flush=True)
        for repeat in range(repeats):
            order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
            for mode in order:
                out = os.path.join(work, f"{mode}-{repeat}")
                results[mode].append(
                    run(
                        model_path,
                        urls,
                        mode,
                        latency,
                        steps,
                        warmup,
                        out,
                        args.verifier,
                        group=args.generations,
                        prompt_words=args.prompt_words,
                        answer_tokens=args.answer_tokens,
                    )
                )
                print(mode, repeat, results[mode][-1], flush=True)
    step = {mode: statistics.mean(r["step_s"] for r in runs) for mode, runs in results.items()}
    names = ("reward_s_in_step", "generate_call_s", "rest_s")
    parts = {mode: {part: statistics.mean(r[part] for r in runs) for part in names} for mode, runs in results.items()}
    summary = {
        "benchmark": "agents",
        "regime": "slow_verifier" if args.verifier == "sleep" else "sandboxed_verifier",
        "quick": args.quick,
        "group_generation_s": generation,  # alone, and a group's share of a step's batch
        "verifier_matched_to": matched,  # which of them set the verifier's latency (None: --latency, or a sandbox)
        "verifier_s_per_completion": latency if args.verifier == "sleep" else None,
        "verifier_s_per_group": latency * args.generations if args.verifier == "sleep" else None,
        "layers": args.layers,
        "generations": args.generations,
        "answer_tokens": args.answer_tokens,
        "prompt_words": args.prompt_words if args.verifier == "sleep" else None,
        "step_parts_s": parts,
        "step_s": step,
        "vs_sync": {mode: step[mode] / step["sync"] for mode in step},
        "in_stream_vs_in_step": step["streaming_rewards_in_stream"] / step["streaming_rewards_in_step"],
    }
    print(
        f"step time: sync {step['sync']:.2f} s, streaming (rewards in the step) "
        f"{step['streaming_rewards_in_step']:.2f} s, streaming (rewards in the stream) "
        f"{step['streaming_rewards_in_stream']:.2f} s: {summary['in_stream_vs_in_step']:.2f}x"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
