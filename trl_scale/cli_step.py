"""`trl-scale step`: the training step a config would run, printed without running it (no model loaded, no server
reached): the run's plan, TRL's hooks in call order with the features that take each, and the interceptions in force.

    trl-scale step grpo|rloo|dpo|ppo --config file.yaml [--field value ...]
    trl-scale step --example demo|streaming-environments
"""

from __future__ import annotations

import argparse
import tempfile

from .cli_parsing import import_trl_script_types, method_classes, parse

USAGE = (
    "usage: trl-scale step {grpo,rloo,dpo,ppo} --config file.yaml [--field value ...]\n"
    "       trl-scale step --example {demo,streaming-environments}"
)

EXAMPLES = ("demo", "streaming-environments")


class CountingEnvironment:
    """The streaming example's environment (TRL's `environment_factory` interface): a prompt from `reset()`, one
    tool, a reward from the instance."""

    def reset(self, **kwargs) -> str:
        self.guesses = 0
        return "Count from 1 to 5."

    def guess(self, number: int) -> str:
        """Say a number.

        Args:
            number: the number said
        """
        self.guesses += 1
        return "heard"

    def get_reward(self) -> float:
        return float(self.guesses)


def example_arguments(name: str, output_dir: str) -> tuple[type, dict]:
    """The trainer class and constructor arguments of a documented example (`docs/step.md`)."""
    from .toy.demo import demo_config
    from .trainers import GRPOConfig, GRPOTrainer

    if name == "demo":
        return GRPOTrainer, {"model": "toy:llama", "args": GRPOConfig(**demo_config(output_dir))}
    if name == "streaming-environments":
        config = GRPOConfig(
            output_dir=output_dir,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_urls=["http://127.0.0.1:8000", "http://127.0.0.1:8001"],
            async_rollout_staleness=1,
            num_generations=4,
            per_device_train_batch_size=4,
            bf16=False,
            report_to="none",
        )
        return GRPOTrainer, {"model": "toy:llama", "args": config, "environment_factory": CountingEnvironment}
    raise ValueError(f"--example {name!r}: use one of {', '.join(EXAMPLES)}")


def example_step(name: str) -> str:
    from .trainers.step import describe_step

    with tempfile.TemporaryDirectory() as output_dir:
        trainer_class, arguments = example_arguments(name, output_dir)
        return describe_step(trainer_class, arguments)


def config_step(method: str, argv: list[str]) -> str:
    """The step of `trl-scale METHOD` with this `--config` and overrides (the reward functions and datasets are not
    loaded: the plan reads the config)."""
    from trl import TrlParser

    from .trainers.step import describe_step

    script_type, model_config_type = import_trl_script_types()
    trainer_class, config_class = method_classes(method)
    parser = TrlParser((script_type, config_class, model_config_type), prog=f"trl-scale step {method}")
    if not any(a == "--config" or a.startswith("--config=") for a in argv):  # else transformers' own checks speak
        parser.error(
            "needs --config file.yaml: the config whose step it prints (the training command's own). Fix: "
            f"trl-scale step {method} --config your.yaml, or trl-scale step --example demo"
        )
    _, training_args, model_args = parse(parser, method, argv)
    return describe_step(trainer_class, {"model": model_args.model_name_or_path, "args": training_args})


def step(argv: list[str]) -> int:
    if argv and argv[0].startswith("--example"):
        parser = argparse.ArgumentParser(prog="trl-scale step", usage=USAGE)
        parser.add_argument("--example", choices=EXAMPLES, required=True)
        print(example_step(parser.parse_args(argv).example))
        return 0
    if not argv or argv[0] not in ("grpo", "rloo", "dpo", "ppo"):
        print(USAGE)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    print(config_step(argv[0], argv[1:]))
    return 0
