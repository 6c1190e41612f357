"""`trl-scale` command line, in the style of `trl grpo`:

    trl-scale grpo|rloo|dpo|ppo --config file.yaml [--field value ...]
    trl-scale serve --model PATH [--host 127.0.0.1] [--port N] [--api-key KEY] [--token-delay S]
    trl-scale check-servers URL... [--weight-sync MODE] [--max-completion-length N] [--model PATH] [--json]
    trl-scale rollout {rejection-sample,eval} --servers URL... --tokenizer PATH --dataset D --reward-funcs F
    trl-scale demo [--max-steps N] [--family llama|qwen2]
    trl-scale step grpo|rloo|dpo|ppo --config file.yaml | --example demo   (the step a config runs, printed)

Training commands parse TRL's `ScriptArguments`, the method's config and TRL's `ModelConfig` with `TrlParser`
(YAML plus command-line overrides). Offline conveniences: `model_name_or_path: toy:llama` (or `toy:qwen2`)
builds a tiny model warmed up on noisy counting text (a weak counter, as an SFT checkpoint would be) in
`<output_dir>/base-model`; `dataset_name: toy:counting` / `toy:preferences` uses the
built-in toy datasets; `reward_funcs` takes `counting_reward` or any dotted import path.
"""

from __future__ import annotations

import argparse
import os
import sys

from .cli_parsing import import_trl_script_types as _import_trl_script_types
from .cli_parsing import method_classes as _method_classes
from .cli_parsing import parse as _parse


def _load_dataset(script_args):
    from .toy import counting_prompts, preference_pairs

    name = script_args.dataset_name
    if name is None:
        raise ValueError("dataset_name is required: a dataset id or local path, or toy:counting / toy:preferences")
    if name in ("toy:counting", "toy:preferences"):
        make = counting_prompts if name == "toy:counting" else preference_pairs
        splits = {script_args.dataset_train_split: make(script_args.num_toy_examples)}
        # the test split: other rows of the same task (`trl-scale rollout` names one split only: the one it reads)
        held_out = max(16, script_args.num_toy_examples // 16)
        splits.setdefault(getattr(script_args, "dataset_test_split", "test"), make(held_out, seed=1))
        return splits
    from datasets import load_dataset

    _check_local_dataset_has_rows(name)
    builder = _FILE_BUILDERS.get(os.path.splitext(name)[1].lower()) if os.path.isfile(name) else None
    if builder is not None:  # one local file: its format's builder (datasets finds no data file at a file's path)
        split = script_args.dataset_train_split
        return load_dataset(builder, data_files={split: name}, streaming=script_args.dataset_streaming)
    return load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)


_FILE_BUILDERS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _check_local_dataset_has_rows(name: str) -> None:
    """A local dataset whose files hold nothing: `datasets` fails with "corresponds to no data" or a bare
    StopIteration, before the trainer's own empty-dataset check can say what is wrong."""
    if not os.path.exists(name):
        return
    if os.path.isfile(name):
        files = [name]
    else:
        files = [os.path.join(root, f) for root, _, names in os.walk(name) for f in names if not f.startswith(".")]

    if files and all(_holds_no_rows(f) for f in files):
        raise ValueError(
            f"dataset_name={name!r} holds no rows (its data files are empty, or a header only: {sorted(files)[:5]}). "
            "Fix: add rows to it, or point dataset_name at a dataset that has them"
        )


def _holds_no_rows(path: str) -> bool:
    """A data file with no rows: empty, a CSV header alone, a Parquet file of 0 rows, JSON of no records."""
    extension = os.path.splitext(path)[1].lower()
    try:
        if extension == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows == 0
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
        if extension == ".csv":
            return len([line for line in head.splitlines() if line.strip()]) <= 1
        if extension in (".json", ".jsonl"):
            return head.strip() in (b"", b"[]", b"{}")
        return not head.strip()
    except Exception:  # unreadable here: let `datasets` say what it makes of it
        return False


def _resolve_model(model_name: str | None, training_args) -> str:
    if model_name is None:
        raise ValueError(
            "model_name_or_path is required (a model id or path, or toy:llama / toy:qwen2 / toy:llama-vllm)"
        )
    if model_name.startswith("toy:"):
        from .toy.demo import build_counting_model
        from .toy.models import VLLM_CPU_SHAPE

        family = model_name.split(":", 1)[1]
        shape = {}
        if family.endswith("-vllm"):  # toy:llama-vllm: a shape vLLM's CPU build serves (head_dim 64)
            family, shape = family.removesuffix("-vllm"), VLLM_CPU_SHAPE
        path = os.path.join(training_args.output_dir, "base-model")
        # Under several processes the main one builds it; the others wait, then load what it wrote.
        with training_args.main_process_first(desc="build the toy model"):
            if not os.path.exists(os.path.join(path, "config.json")):
                build_counting_model(path, family=family, **shape)  # warmed up: RL on a random model learns nothing
        return path
    return model_name


def _eval_split(parser, dataset, script_args, training_args):
    """The split evaluated during training (`dataset_test_split`), where `eval_strategy` asks for evaluation."""
    if training_args.eval_strategy == "no":
        return None
    split = script_args.dataset_test_split
    if split not in dataset:
        parser.error(
            f"eval_strategy={training_args.eval_strategy.value!r} evaluates on dataset_test_split={split!r}, which "
            f"{script_args.dataset_name} does not have (its splits: {sorted(dataset)}). Fix: name one of those "
            "splits as dataset_test_split, or eval_strategy=no"
        )
    return dataset[split]


def _say_processes(trainer, method: str) -> None:
    sp_size = trainer.plan.scoring.sequence_parallel_size
    processes = trainer.accelerator.state.num_processes
    if sp_size > 1:
        trainer.accelerator.print(
            f"trl-scale {method}: training on {processes // sp_size} data-parallel rank(s) of {processes} processes, "
            f"each packed row scored over {sp_size} ranks (sequence parallelism)"
        )
    else:
        trainer.accelerator.print(f"trl-scale {method}: training on {processes} process(es)")


def train(method: str, argv: list[str]) -> int:
    """Parse `--config` YAML and overrides with TrlParser, build the trainer, train, save, push if asked."""
    from trl import TrlParser, get_peft_config

    script_type, model_config_type = _import_trl_script_types()
    trainer_cls, config_cls = _method_classes(method)
    parser = TrlParser((script_type, config_cls, model_config_type), prog=f"trl-scale {method}")
    script_args, training_args, model_args = _parse(parser, method, argv)
    model_path = _resolve_model(model_args.model_name_or_path, training_args)
    model_init_kwargs = {"attn_implementation": model_args.attn_implementation, "dtype": model_args.dtype}
    model_init_kwargs = {k: v for k, v in model_init_kwargs.items() if v is not None}
    if training_args.model_init_kwargs:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs or None
    try:
        dataset = _load_dataset(script_args)
    except ValueError as error:  # no rows, no dataset_name: a usage error, its message says the fix
        parser.error(str(error))
    kwargs = dict(
        model=model_path,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=_eval_split(parser, dataset, script_args, training_args),
        peft_config=get_peft_config(model_args),
    )
    if method != "dpo":
        from .cli_rewards import resolve_reward_funcs

        reward_funcs = resolve_reward_funcs(
            script_args.reward_funcs or [], script_args.reward_funcs_kwargs, model_path
        )
        if script_args.reward_model_name_or_path:
            reward_funcs.append(script_args.reward_model_name_or_path)
        if not reward_funcs:
            raise ValueError(f"{method} needs reward_funcs and/or reward_model_name_or_path")
        kwargs["reward_funcs"] = reward_funcs
    if method == "ppo":
        kwargs["value_model"] = script_args.value_model_name_or_path
    trainer = trainer_cls(**kwargs)
    _say_processes(trainer, method)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "close_rollout"):
        trainer.close_rollout()
    _end_distributed(trainer.accelerator)
    return 0


def _end_distributed(accelerator) -> None:
    """End a multi-process run without C++ static destructors. Some rank, about one run in fifteen here, aborted
    at exit ("terminate called without an active exception", SIGABRT) after the run had finished and saved, and
    the launcher reported a failed run. `destroy_process_group()` alone did not stop it: the DDP wrapper and
    DeepSpeed engines still hold their process groups, which are torn down with the interpreter. So once every
    rank is here, Python's own exit work runs (atexit handlers: loggers, trackers; non-daemon threads: uploads)
    and the process leaves with `os._exit`, skipping only the native teardown."""
    import atexit
    import threading

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rollout_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-scale rollout", description=_rollout.__doc__)
    parser.add_argument("mode", choices=["rejection-sample", "eval"])
    parser.add_argument("--servers", nargs="+", required=True, help="completion server URLs (http://HOST:PORT)")
    parser.add_argument("--tokenizer", required=True, help="path of the tokenizer of the model the servers run")
    parser.add_argument("--dataset", required=True, help="toy:counting, a local dataset path, or a dataset id")
    parser.add_argument("--split", default="train")
    parser.add_argument("--reward-funcs", nargs="+", required=True, help="counting_reward or dotted import paths")
    parser.add_argument("--num-samples", type=int, default=8, help="completions per prompt (>= 1)")
    parser.add_argument("--keep-top-k", type=int, default=1, help="rejection-sample: kept per prompt (1..num-samples)")
    parser.add_argument("--min-reward", type=float, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output", help="rejection-sample (required): where to write the kept rows (.jsonl)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may wait for a server")
    parser.add_argument("--api-key", default=None)
    return parser


def _checked_rollout_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args = parser.parse_args(argv)
    for flag, value, low in (("--num-samples", args.num_samples, 1), ("--max-tokens", args.max_tokens, 1)):
        if value < low:
            parser.error(f"{flag} {value}: use a whole number >= {low}")
    if args.mode == "rejection-sample":
        if not 1 <= args.keep_top_k <= args.num_samples:
            parser.error(f"--keep-top-k {args.keep_top_k}: use 1 to --num-samples ({args.num_samples})")
        if not args.output:
            parser.error("rejection-sample needs --output FILE.jsonl: where to write the kept rows")
    if args.request_timeout <= 0:
        parser.error(f"--request-timeout {args.request_timeout:g}: use a positive number of seconds")
    return args


def _rollout(argv: list[str]) -> int:
    """`trl-scale rollout {rejection-sample,eval}`: generate and score on running servers, no training."""
    parser = _rollout_parser()
    args = _checked_rollout_args(parser, argv)
    from .rollout.urls import check_server_urls

    try:
        urls = check_server_urls(args.servers, field="--servers")
    except ValueError as error:
        parser.error(str(error))
    import json

    from transformers import AutoTokenizer

    from .rollout import RolloutClient
    from .rollout.client import RolloutError
    from .rollout.modes import check_servers_for, evaluate, rejection_sample

    script = argparse.Namespace(
        dataset_name=args.dataset,
        dataset_config=None,
        dataset_streaming=False,
        dataset_train_split=args.split,
        num_toy_examples=64,
    )
    try:
        dataset = _load_dataset(script)[args.split]
        from .cli_rewards import resolve_reward_funcs

        rewards = resolve_reward_funcs(args.reward_funcs, None, args.tokenizer)
    except ValueError as error:
        parser.error(str(error))
    client = RolloutClient(urls, request_timeout=args.request_timeout, api_key=args.api_key)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    try:
        check_servers_for(client, tokenizer, timeout=args.request_timeout)
        if args.mode == "eval":
            print(json.dumps(evaluate(client, dataset, rewards, tokenizer, num_samples=args.num_samples, **sampling)))
            return 0
        kept = rejection_sample(
            client, dataset, rewards, tokenizer, args.num_samples, args.keep_top_k, args.min_reward, **sampling
        )
    except RolloutError as error:
        print(f"trl-scale rollout: error: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    kept.to_json(args.output)
    summary = {"kept": len(kept), "mean_reward": sum(kept["reward"]) / max(1, len(kept)), "output": args.output}
    print(json.dumps(summary))
    return 0


def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-scale demo", description="Train a tiny model to count on CPU, offline.")
    parser.add_argument("--output-dir", default="trl-scale-demo", help="where the models, plot and result go")
    parser.add_argument("--max-steps", type=int, default=800, help="GRPO steps (default 800, about 40 s on 2 cores)")
    parser.add_argument("--family", choices=["llama", "qwen2"], default="llama", help="tiny model family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _quiet()
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # A tiny model gains little from more threads (400 steps: 14 s on 2 threads, 17 s on 1, 2 idle cores),
        # and spinning threads on a busy machine lose a lot (100 steps beside 2 busy processes: 21 s vs 7 s).
        torch.set_num_threads(1)
    from .toy.demo import format_result, run_demo

    result = run_demo(output_dir=args.output_dir, max_steps=args.max_steps, family=args.family, seed=args.seed)
    print(format_result(result))
    return 0 if result.reward_after > result.reward_before else 1


def _quiet() -> None:
    """Keep the demo's output to its progress bar and result: no deprecation chatter, no load/save bars."""
    import warnings

    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


METHODS = ("grpo", "rloo", "dpo", "ppo")
USAGE = (
    "usage: trl-scale {grpo,rloo,dpo,ppo} --config file.yaml [--field value ...]\n"
    "       trl-scale serve --model PATH [--host 127.0.0.1] [--port N]\n"
    "       trl-scale reward-server [--reward code|module:function] [--host 127.0.0.1] [--port N] [--api-key KEY]\n"
    "       trl-scale check-servers URL... [--weight-sync MODE] [--max-completion-length N] [--model PATH] [--json]\n"
    "       trl-scale rollout {rejection-sample,eval} --servers URL... --tokenizer PATH --dataset D --reward-funcs F\n"
    "       trl-scale demo [options]\n"
    "       trl-scale step {grpo,rloo,dpo,ppo} --config file.yaml | --example {demo,streaming-environments}"
)


def check_servers(argv: list[str]) -> int:
    """What each rollout server offers (a table), and what a run with the given settings would trip over. Exit 1
    when a server is unreachable or a problem was found."""
    import argparse
    import json

    from .rollout.client import RolloutClient
    from .rollout.preflight import RunNeeds, all_problems, format_table, inspect_all
    from .rollout.urls import check_server_urls

    parser = argparse.ArgumentParser(prog="trl-scale check-servers")
    parser.add_argument("urls", nargs="+", metavar="URL")
    parser.add_argument("--weight-sync", choices=["auto", "nccl", "shared_dir", "lora"], default=None)
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0, help="checks the log-prob mode against it")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="one JSON list of rows instead of the table")
    parser.add_argument(
        "--model", default=None, help="a local policy: each server's sampler measured against it (the mismatch probe)"
    )
    parser.add_argument("--mismatch-budget", type=float, default=None, help="with --model: a problem past it")
    args = parser.parse_args(argv)
    try:  # the URLs a trainer would accept, no others
        urls = check_server_urls(args.urls, field="URL")
    except ValueError as error:
        parser.error(str(error))
    client = RolloutClient(urls, request_timeout=30, api_key=args.api_key)
    try:
        reports = inspect_all(client.transport.get_url, client.transport.post_url, [s.url for s in client.servers])
    finally:
        client.close()
    needs = RunNeeds(
        weight_sync=args.weight_sync,
        max_completion_length=args.max_completion_length,
        importance_sampling=True,
        sampling={"temperature": args.temperature},
    )
    errors, warnings = all_problems(reports, needs)
    figures = _mismatch(urls, args) if args.model and not errors else []
    if args.json:
        by_url = {f.server: f for f in figures}
        rows = [{**r.row(), **({"mismatch KL": by_url[r.url].kl} if r.url in by_url else {})} for r in reports]
        print(json.dumps(rows))
    else:
        print(format_table(reports))
        if figures:
            from .mismatch import format_figures

            print("\nmismatch against " + args.model + ":\n" + format_figures(figures))
    if args.mismatch_budget is not None:
        from .mismatch import verdict

        errors += [line for f in figures if (line := verdict(f, args.mismatch_budget))]
    for line in errors:
        print(f"problem: {line}", file=sys.stderr)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 1 if errors else 0


def _mismatch(urls: list[str], args) -> list:
    """`check-servers --model`: each server's sampler against the local model (`trl_scale.mismatch.local`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .mismatch.local import probe_prompts, scored_figures
    from .rollout.client import RolloutClient
    from .rollout.mismatch_probe import sample_each_server

    prompts = probe_prompts(AutoTokenizer.from_pretrained(args.model))
    client = RolloutClient(urls, request_timeout=60, api_key=args.api_key, generation_timeout=120)
    try:
        samples = sample_each_server(client, prompts, {"max_tokens": 16, "temperature": args.temperature})
    finally:
        client.close()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    return scored_figures(model, prompts, samples, args.temperature)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return _demo(rest)
    if command == "step":
        from .cli_step import step

        return step(rest)
    if command == "rollout":
        return _rollout(rest)
    if command == "serve":
        from .serve import serve

        return serve(rest)
    if command == "reward-server":
        from .rewards.server import reward_server

        return reward_server(rest)
    if command == "check-servers":
        return check_servers(rest)
    if command in METHODS:
        return train(command, rest)
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
