"""`trl-scale <method> --config file.yaml`: the example YAMLs run, overrides apply, and every trainer runs with
2 processes under `accelerate launch` (gloo on CPU)."""

import subprocess
import sys

import pytest

from trl_scale.cli import main

from .helpers import (
    ROOT,
    accelerate_launch,
    accelerate_launch_with_config,
    deepspeed_launcher_config,
    launcher_failure,
    run_to_completion,
    subprocess_env,
)

EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("method", ["grpo", "rloo", "dpo", "ppo"])
def test_each_trainer_runs_with_two_processes(method, tmp_path):
    overrides = ["--output_dir", str(tmp_path), "--max_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true"]
    overrides += ["--per_device_train_batch_size", "8", "--token_budget", "24", "--tree_packing", "true"]
    if method != "dpo":  # a reward with variance on a random model, so there are gradients to all-reduce
        overrides += ["--reward_funcs", "tests.helpers.token_parity_reward", "--max_completion_length", "6"]
    if method == "grpo":  # evaluation over both processes: pass@k from the rewards gathered from both
        overrides += ["--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "8"]
        overrides += ["--num_generations_eval", "4", "--num_toy_examples", "64", "--eval_success_threshold", "0.5"]
    command = accelerate_launch(2) + ["-m", "trl_scale.cli"]
    command += [method, "--config", str(EXAMPLES / f"{method}_tiny_cpu.yaml"), *overrides]
    result = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, launcher_failure(output)
    assert f"trl-scale {method}: training on 2 process(es)" in output
    assert "'grad_norm'" in output and "padding_free/tokens_per_micro_batch" in output
    assert "tree_packing/share_ratio" in output  # the command line's tree_packing, on both processes
    if method == "grpo":
        assert "'eval_rewards/token_parity_reward/pass@4'" in output and "'eval_reward'" in output, output[-3000:]
    assert (tmp_path / "model.safetensors").exists()
    if method == "ppo":
        assert (tmp_path / "value_model" / "model.safetensors").exists()


def test_yaml_and_overrides_reach_the_config(tmp_path, monkeypatch):
    seen = {}

    import trl_scale

    def fake_train(self, resume_from_checkpoint=None):
        seen["args"] = self.args

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    config = str(EXAMPLES / "grpo_tiny_cpu.yaml")
    assert main(["grpo", "--config", config, "--output_dir", str(tmp_path), "--token_budget", "99"]) == 0
    assert seen["args"].token_budget == 99  # command line overrides YAML
    assert seen["args"].num_generations == 8 and seen["args"].padding_free is True  # from the YAML


def test_evaluation_from_the_command_line_takes_the_test_split(tmp_path, monkeypatch, capsys):
    """`--eval_strategy steps` with a toy dataset evaluates on its held-out split; with a dataset that has no
    `dataset_test_split`, a usage error naming the field and the splits there are, before any model loads."""
    import trl_scale

    seen = {}

    def fake_train(self, resume_from_checkpoint=None):
        seen["trainer"] = self

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    config = str(EXAMPLES / "grpo_tiny_cpu.yaml")
    evaluation = ["--eval_strategy", "steps", "--eval_steps", "20", "--eval_pass_at_k", "1", "8"]
    assert main(["grpo", "--config", config, "--output_dir", str(tmp_path), *evaluation]) == 0
    trainer = seen["trainer"]
    assert trainer.args.eval_pass_at_k == [1, 8] and trainer.args.eval_steps == 20
    eval_prompts = trainer.eval_dataset["prompt"]  # the same task (counting prompts), other rows
    assert len(eval_prompts) == 4096 // 16 and eval_prompts != trainer.train_dataset["prompt"][: len(eval_prompts)]
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "one two"}\n{"prompt": "three four"}\n')
    with pytest.raises(SystemExit):
        main(["grpo", "--config", config, "--output_dir", str(tmp_path), "--dataset_name", str(data), *evaluation])
    error = capsys.readouterr().err
    assert "dataset_test_split='test'" in error and "['train']" in error and "eval_strategy=no" in error, error


def test_bad_reward_function_is_a_clear_error(tmp_path):
    config = str(EXAMPLES / "grpo_tiny_cpu.yaml")
    with pytest.raises(ValueError, match="no_such_module.reward"):
        main(["grpo", "--config", config, "--output_dir", str(tmp_path), "--reward_funcs", "no_such_module.reward"])


def test_realistic_gpu_yamls_parse(tmp_path, monkeypatch):
    from transformers import TrainingArguments
    from trl import ModelConfig, TrlParser

    import trl_scale
    from trl_scale.cli import _import_trl_script_types

    script_type, _ = _import_trl_script_types()
    for method, config_cls in (("grpo", trl_scale.GRPOConfig), ("ppo", trl_scale.PPOConfig)):
        parser = TrlParser((script_type, config_cls, ModelConfig))
        yaml = str(EXAMPLES / f"{method}_qwen2.5-1.5b_8gpu.yaml")
        # bf16 needs a GPU to validate; everything else must parse as written.
        script, args, model_args = parser.parse_args_and_config(
            ["--config", yaml, "--bf16", "false", "--output_dir", str(tmp_path)]
        )
        assert args.use_vllm and args.token_budget == 16384 and model_args.attn_implementation == "flash_attention_2"
        if method == "ppo":
            assert args.backend == "ray" and args.critic_placement["num_gpus_per_worker"] == 1.0
            assert args.reference_placement == args.reward_placement == args.critic_placement
    parser = TrlParser((script_type, trl_scale.GRPOConfig, ModelConfig))
    # parsed as in each of its 8 processes: 4 sequence-parallel pairs
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 8))
    monkeypatch.setattr("trl_scale.scoring.arguments.launched_processes", lambda: 8)
    _, args, _ = parser.parse_args_and_config(
        ["--config", str(EXAMPLES / "grpo_long_context_8gpu.yaml"), "--bf16", "false", "--output_dir", str(tmp_path)]
    )
    assert args.sequence_parallel_size == 2 and args.max_completion_length == 32768
    assert args.generation_batch_size == 2 * 4 * 8  # per pair x 4 pairs x steps_per_generation
    parser = TrlParser((script_type, trl_scale.PPOConfig, ModelConfig))
    _, args, _ = parser.parse_args_and_config(
        ["--config", str(EXAMPLES / "ppo_ray_cluster.yaml"), "--bf16", "false", "--output_dir", str(tmp_path)]
    )
    assert args.managed_servers == 2 and args.managed_server_placement == "ray" and args.managed_server_gpus == 1
    assert args.managed_server_args == ["--max-model-len", "4096", "--gpu-memory-utilization", "0.85"]
    assert args.managed_server_resources == {"CPU": 8, "rollout": 1}
    assert args.critic_placement["resources"] == {"critic": 1}


@pytest.mark.slow  # the first DeepSpeed run on a machine JIT-builds its CPU communication op (80-140 s)
@pytest.mark.parametrize("method, init_flag", [("grpo", "false"), ("grpo", "true")])  # PPO: test_ppo_sharded.py
def test_toy_model_under_a_deepspeed_zero3_launcher_trains_instead_of_hanging(method, init_flag, tmp_path):
    """`accelerate launch --config_file <ZeRO-3>` with `model_name_or_path: toy:llama`: the main process builds the
    toy model while the other waits at a barrier. It used to build it under ZeRO-3's `zero.Init`, whose collective
    broadcast the waiting rank never joined: both hung forever before the output directory existed."""
    import deepspeed  # noqa: F401  (installed by the README's test command; this path must be tested)

    launcher_config = tmp_path / "zero3.yaml"
    launcher_config.write_text(deepspeed_launcher_config(stage=3, init_flag=init_flag))
    command = accelerate_launch_with_config(launcher_config) + ["-m", "trl_scale.cli", method]
    command += ["--config", str(EXAMPLES / f"{method}_tiny_cpu.yaml"), "--output_dir", str(tmp_path / "out")]
    command += ["--max_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true"]
    output = run_to_completion(command)
    assert f"trl-scale {method}: training on 2 process(es)" in output and "'grad_norm'" in output
    assert (tmp_path / "out" / "base-model" / "config.json").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_help_and_check_servers_import_no_trl():
    """`trl-scale --help` printed four lines after importing TRL and transformers (22 s on a busy machine): the
    package imports its trainers on first use, and the server check needs only `requests`."""
    code = (
        "import sys, trl_scale.cli as cli; cli.main(['--help']); "
        "import trl_scale.rollout.client, trl_scale.rollout.preflight; "
        "print(sorted(m for m in ('trl', 'transformers', 'torch') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "check-servers" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def _trainer_from_cli(monkeypatch, yaml, argv: list[str]):
    import trl_scale

    seen = {}

    def fake_train(self, resume_from_checkpoint=None):
        seen["trainer"] = self

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    assert main(["grpo", "--config", str(yaml), *argv]) == 0
    return seen["trainer"]


def test_reward_classes_and_a_local_module_from_the_trainer_yaml_and_the_command_line(tmp_path, monkeypatch):
    """`reward_funcs` entries as a user writes them: a module beside the YAML (found from the current directory, as
    TRL's scripts find it), and reward classes made with `reward_funcs_kwargs` (a class was accepted, then failed at
    step 1 called as a reward; CodeExecutionReward and RemoteReward had no way to get their settings)."""
    from trl_scale import CodeExecutionReward, RemoteReward

    (tmp_path / "my_rewards.py").write_text(
        "def brevity(completions, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    yaml = tmp_path / "rewards.yaml"
    tiny = "".join(line for line in (EXAMPLES / "grpo_tiny_cpu.yaml").open() if not line.startswith("reward_funcs"))
    yaml.write_text(
        tiny + "\nreward_funcs: [my_rewards.brevity, trl_scale.CodeExecutionReward, trl_scale.RemoteReward]\n"
        "reward_funcs_kwargs:\n"
        "  trl_scale.CodeExecutionReward: {tests_column: checks}\n"
        "  trl_scale.RemoteReward: {urls: ['http://127.0.0.1:1/get_reward'], label_column: tests}\n"
    )
    trainer = _trainer_from_cli(monkeypatch, yaml, ["--output_dir", str(tmp_path / "out")])
    brevity, code, remote = (getattr(f, "__trl_scale_checked__", f) for f in trainer.reward_funcs)
    assert brevity.__module__ == "my_rewards"
    assert isinstance(code, CodeExecutionReward) and code.tests_column == "checks"
    assert isinstance(remote, RemoteReward) and remote.settings.label_column == "tests"
    assert remote.tokenizer is not None  # made with the model's tokenizer (conversational rows need it)
    settings = '{"trl_scale.CodeExecutionReward": {"tests_column": "cases"}}'
    argv = ["--output_dir", str(tmp_path / "out2"), "--reward_funcs", "trl_scale.CodeExecutionReward"]
    trainer = _trainer_from_cli(
        monkeypatch, EXAMPLES / "grpo_tiny_cpu.yaml", [*argv, "--reward_funcs_kwargs", settings]
    )
    assert trainer.reward_funcs[0].__trl_scale_checked__.tests_column == "cases"


@pytest.mark.parametrize(
    "entries, settings, message",
    [
        (["trl_scale.RemoteReward"], None, r"'trl_scale.RemoteReward' is a class, made with .*Fix: give its"),
        (["trl_scale.toy.counting_reward"], {"trl_scale.toy.counting_reward": {"x": 1}}, r"is a function, called as"),
        (["counting_reward"], {"trl_scale.RemoteReward": {}}, r"names \['trl_scale.RemoteReward'\], which"),
        (["counting_reward"], "not json", r"reward_funcs_kwargs='not json': use a dict"),
    ],
)
def test_reward_settings_nothing_would_read_are_refused(entries, settings, message):
    from trl_scale.cli_rewards import resolve_reward_funcs

    with pytest.raises(ValueError, match=message):
        resolve_reward_funcs(entries, settings)


@pytest.mark.parametrize(
    ("arguments", "field", "value"),
    [
        (["--vllm_llm_kwargs", '{"dtype": "float32"}'], "vllm_llm_kwargs", {"dtype": "float32"}),
        (
            ["--use_vllm", "true", "--vllm_mode", "server", "--managed_servers", "1"]
            + ["--managed_server_env", '{"VLLM_CPU_KVCACHE_SPACE": "4"}'],
            "managed_server_env",
            {"VLLM_CPU_KVCACHE_SPACE": "4"},
        ),
        (
            ["--use_vllm", "true", "--vllm_mode", "server", "--managed_servers", "1"]
            + ["--managed_server_placement", "ray", "--managed_server_resources", '{"CPU": 2}'],
            "managed_server_resources",
            {"CPU": 2},
        ),
        (
            ["--backend", "ray", "--reward_placement", '{"num_workers": 2, "num_gpus_per_worker": 0}'],
            "reward_placement",
            {"num_workers": 2, "num_gpus_per_worker": 0},
        ),
    ],
)
def test_dict_fields_take_a_json_object_on_the_command_line(tmp_path, arguments, field, value):
    """A dict field given on the command line arrives as text: it was refused by the parser ("invalid dict value")
    for vllm_llm_kwargs and the fleet's env and resources; now read as JSON, as reward_funcs_kwargs is."""
    from trl import TrlParser

    from trl_scale.cli_parsing import import_trl_script_types, method_classes, parse

    script_type, model_type = import_trl_script_types()
    _, config_class = method_classes("grpo")
    parser = TrlParser((script_type, config_class, model_type), prog="trl-scale grpo")
    argv = ["--output_dir", str(tmp_path), "--bf16", "false", "--report_to", "none", *arguments]
    _, config, _ = parse(parser, "grpo", argv)
    assert getattr(config, field) == value


def test_every_dict_field_trl_scale_adds_can_be_given_on_the_command_line():
    """The parser refuses any text for a field typed `dict | None` ("invalid dict value"): every dict field of
    trl-scale's configs and script arguments also takes a string, read as a JSON object (`numbers.dict_field`)."""
    import typing

    import trl_scale
    from trl_scale.cli_parsing import import_trl_script_types

    script_type, _ = import_trl_script_types()
    dict_fields = {}
    for config in (trl_scale.GRPOConfig, trl_scale.RLOOConfig, trl_scale.PPOConfig, trl_scale.DPOConfig, script_type):
        for klass in config.__mro__:
            own = klass.__dict__.get("__annotations__", {})
            if not klass.__module__.startswith("trl_scale") or not own:
                continue
            for name, kind in typing.get_type_hints(klass).items():
                if name in own and dict in typing.get_args(kind):
                    dict_fields[f"{klass.__name__}.{name}"] = kind
    assert len(dict_fields) >= 7, dict_fields  # the placements, the fleet's two, vllm_llm_kwargs, reward_funcs_kwargs
    refused = {name: kind for name, kind in dict_fields.items() if str not in typing.get_args(kind)}
    assert not refused, f"dict fields the command line cannot set (type them dict | str | None): {refused}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["grpo", "--config", "nope.yaml"], "trl-scale grpo: error: --config nope.yaml: no such file or directory"),
        (["step", "grpo", "--config", "nope.yaml"], "step grpo: error: --config nope.yaml: no such file or directory"),
        (["step", "rloo"], "step rloo: error: needs --config file.yaml"),
    ],
)
def test_a_missing_config_file_or_none_is_a_usage_error_naming_it(argv, message, capsys, tmp_path, monkeypatch):
    """A missing --config was a raw FileNotFoundError traceback; `step` without one spoke of bf16 (transformers'
    checks of a config it never read)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


class TokenizedReward:
    """A reward class whose constructor takes a tokenizer (as RemoteReward's does)."""

    def __init__(self, tokenizer=None, scale: float = 1.0):
        self.tokenizer, self.scale = tokenizer, scale

    def __call__(self, completions, **kwargs):
        return [self.scale] * len(completions)


def test_a_reward_classs_tokenizer_is_the_one_given_else_the_models(tiny_llama):
    from trl_scale.cli_rewards import resolve_reward_funcs

    name = f"{__name__}.TokenizedReward"
    (given,) = resolve_reward_funcs([name], {name: {"tokenizer": "my-tokenizer", "scale": 2.0}}, tiny_llama)
    assert given.tokenizer == "my-tokenizer" and given.scale == 2.0
    (default,) = resolve_reward_funcs([name], {}, tiny_llama)
    assert default.tokenizer.name_or_path == tiny_llama


def test_every_example_configs_reward_functions_resolve():
    """Each example YAML's reward_funcs import (the Ray-cluster recipe named a reward model there, which the CLI
    refused at start: never run until its rehearsal)."""
    import yaml

    from trl_scale.cli_rewards import _imported

    for path in sorted(EXAMPLES.glob("*.yaml")):
        for entry in yaml.safe_load(path.read_text()).get("reward_funcs") or []:
            assert callable(_imported(entry)), (path.name, entry)


def test_a_reward_model_given_as_a_reward_function_names_the_field_to_use(tmp_path):
    from trl_scale.cli_rewards import resolve_reward_funcs

    for entry in ("Skywork/Skywork-Reward-V2-Qwen3-0.6B", str(tmp_path)):
        with pytest.raises(ValueError, match=r"looks like a reward model.*Fix: reward_model_name_or_path: "):
            resolve_reward_funcs([entry], {})
