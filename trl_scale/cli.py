"""`trl-scale` command line: `trl-scale demo` (more subcommands arrive with their features)."""

from __future__ import annotations

import argparse
import os
import sys


def _demo(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trl-scale demo", description="Train a tiny model to count on CPU, offline.")
    parser.add_argument("--output-dir", default="trl-scale-demo", help="where the models, plot and result go")
    parser.add_argument(
        "--max-steps", type=int, default=800, help="GRPO steps (default 800, under a minute on 2 cores)"
    )
    parser.add_argument("--family", choices=["llama", "qwen2"], default="llama", help="tiny model family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _quiet()
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


COMMANDS = {"demo": _demo}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: trl-scale {" + ",".join(COMMANDS) + "} [options]   (trl-scale <command> --help)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
