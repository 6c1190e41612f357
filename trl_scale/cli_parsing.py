"""The training commands' parsing, shared by `trl-scale METHOD` (train) and `trl-scale step METHOD` (print the
step): TRL's script arguments with trl-scale's, the method's classes, and TrlParser's errors as usage errors."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


def import_trl_script_types():
    from trl import ModelConfig, ScriptArguments

    @dataclass
    class TrainScriptArguments(ScriptArguments):
        """TRL's script arguments plus the reward and value models of online methods."""

        reward_funcs: list[str] | None = field(
            default=None,
            metadata={
                "help": "Reward functions: `counting_reward` or dotted import paths (online methods); a class "
                "(trl_scale.CodeExecutionReward, trl_scale.RemoteReward, yours) is made with reward_funcs_kwargs."
            },
        )
        reward_funcs_kwargs: dict | str | None = field(
            default=None,
            metadata={
                "help": "Settings of the reward classes in reward_funcs, by entry: {entry: {argument: value}} (YAML "
                'mapping, or JSON on the command line), e.g. {"trl_scale.RemoteReward": {"urls": ["http://h:8100/'
                'get_reward"], "label_column": "tests"}}.'
            },
        )
        reward_model_name_or_path: str | None = field(
            default=None, metadata={"help": "Path of a sequence-classification reward model (online methods)."}
        )
        value_model_name_or_path: str | None = field(
            default=None, metadata={"help": "PPO only: the critic; default: the reward model, else the policy."}
        )
        num_toy_examples: int = field(default=4096, metadata={"help": "Rows of a `toy:` dataset."})

    return TrainScriptArguments, ModelConfig


def method_classes(method: str):
    import trl_scale

    return {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "dpo": (trl_scale.DPOTrainer, trl_scale.DPOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]


def parse(parser, method: str, argv: list[str]):
    """TrlParser's dataclasses from `--config` and the overrides; a bad field, value or YAML is a usage error naming
    the fix, not a traceback."""
    try:
        return parser.parse_args_and_config(args=argv)
    except ValueError as error:  # a usage error, not a traceback
        unknown = re.search(r"Unknown arguments from config file: (\[.*?\])", str(error))  # TrlParser, a YAML key
        if unknown:
            parser.error(
                f"--config has unknown fields {unknown.group(1)}. Fix: check the field names (`trl-scale {method} "
                "--help` lists them)"
            )
        if "arguments are not used" in str(error):  # HfArgumentParser: an unknown field
            parser.error(f"{error}. Fix: check the field names (`trl-scale {method} --help` lists them)")
        parser.error(str(error))  # a config's own check (e.g. bf16 on a CPU machine): its message says the fix
    except OSError as error:  # TrlParser opens --config itself
        if getattr(error, "filename", None) is None:
            raise
        parser.error(
            f"--config {error.filename}: {error.strerror.lower() if error.strerror else error}. Fix: the path of a "
            "YAML file (relative to the working directory)"
        )
    except Exception as error:
        import yaml

        if not isinstance(error, yaml.YAMLError):
            raise
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        parser.error(f"--config is not valid YAML{line}: {problem}. Fix: correct the YAML (e.g. its indentation)")
