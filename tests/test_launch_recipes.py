"""The launch recipes in examples/launch/ (SLURM, SkyPilot, a Ray cluster), checked as far as this machine allows:
each is rendered with its variables in a dry run (`DRY_RUN=1` prints every command a node would run), and the
commands are read by the parsers that will read them on the cluster: accelerate's launch parser and config loader
for the trainer nodes, trl-scale's own `TrlParser` for the training arguments, Ray's schema for the cluster YAML;
the vLLM servers' flags are the ones docs/rollout.md gives for `weight_sync="nccl"`, on the ports the trainer is
given."""

import os
import shlex
import subprocess

import pytest
import yaml

from .helpers import ROOT

LAUNCH = ROOT / "examples" / "launch"


def dry_run(command: list[str], **env) -> list[list[str]]:
    """The commands a recipe prints under DRY_RUN=1, each split as the shell would."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SKYPILOT"))}
    result = subprocess.run(
        command, cwd=ROOT, env={**environment, "DRY_RUN": "1", **env}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def check_trainer(command: list[str], rank: int, nodes: list[str], trainer_nodes: int, gpus: int, tmp_path):
    """accelerate's launch parser and config loader, then trl-scale's TrlParser, read the trainer node's command."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser
    from trl import ModelConfig, TrlParser

    import trl_scale
    from trl_scale.cli import _import_trl_script_types

    assert command[:2] == ["accelerate", "launch"]
    launch = launch_command_parser().parse_args(command[2:])
    assert launch.module and launch.training_script == "trl_scale.cli"
    assert (launch.num_machines, launch.num_processes) == (trainer_nodes, trainer_nodes * gpus)
    assert (launch.machine_rank, launch.main_process_ip) == (rank, nodes[0])
    assert load_config_from_file(str(ROOT / launch.config_file)).distributed_type == "MULTI_GPU"
    method, *arguments = launch.training_script_args
    script_type, _ = _import_trl_script_types()
    config_cls = {"grpo": trl_scale.GRPOConfig, "ppo": trl_scale.PPOConfig}[method]
    parser = TrlParser((script_type, config_cls, ModelConfig))
    # bf16 needs a GPU to validate; every other field parses as written
    _, args, _ = parser.parse_args_and_config([*arguments, "--bf16", "false", "--output_dir", str(tmp_path)])
    return args


def check_servers(commands: list[list[str]], node: str, gpus: int) -> list[str]:
    """Each GPU's vLLM server, with the flags docs/rollout.md gives for weight_sync="nccl"; returns their URLs."""
    rollout = (ROOT / "docs" / "rollout.md").read_text()
    row = next(line for line in rollout.splitlines() if line.startswith('| `"nccl"` (GPU)'))
    documented = shlex.split(row.split("`")[3])  # VLLM_SERVER_DEV_MODE=1 vllm serve M --weight-transfer-config ...
    assert len(commands) == gpus
    commands = sorted(commands, key=lambda command: command[1])  # started in the background: printed in any order
    urls = []
    for gpu, command in enumerate(commands):
        assert command[:3] == ["env", f"CUDA_VISIBLE_DEVICES={gpu}", documented[0]]
        serve = command[command.index("vllm") :]
        for flag in documented[documented.index("M") + 1 :: 2]:
            value = documented[documented.index(flag) + 1]
            assert serve[serve.index(flag) + 1] == value, (flag, serve)
        urls.append(f"http://{node}:{serve[serve.index('--port') + 1]}")
    return urls


def check_run(per_node: list[list[list[str]]], nodes: list[str], trainer_nodes: int, gpus: int, tmp_path) -> None:
    urls = []
    for node, commands in zip(nodes[trainer_nodes:], per_node[trainer_nodes:]):
        urls += check_servers(commands, node, gpus)
    assert len(urls) == len(set(urls)) == (len(nodes) - trainer_nodes) * gpus
    for rank in range(trainer_nodes):
        (command,) = per_node[rank]
        args = check_trainer(command, rank, nodes, trainer_nodes, gpus, tmp_path)
        assert args.vllm_server_base_urls == urls and args.weight_sync == "nccl" and args.use_vllm


@pytest.mark.parametrize(
    "trainer_nodes, gpus, config",
    [(1, 2, None), (2, 4, None), (1, 2, "examples/grpo_tiny_cpu.yaml")],  # the last: a config of local generation
)
def test_multinode_runs_each_nodes_role(trainer_nodes, gpus, config, tmp_path):
    """Every node's command; the trainers' parsed (server rollout on whatever the config says: the recipe hands
    them its servers)."""
    nodes = ["node-a", "node-b", "node-c"]
    per_node = [
        dry_run(
            ["bash", str(LAUNCH / "multinode.sh")],
            NODES=" ".join(nodes),
            NODE_RANK=str(rank),
            TRAINER_NODES=str(trainer_nodes),
            GPUS_PER_NODE=str(gpus),
            **({"CONFIG": config} if config else {}),
        )
        for rank in range(len(nodes))
    ]
    check_run(per_node, nodes, trainer_nodes, gpus, tmp_path)


def test_multinode_refuses_an_allocation_with_no_server_node():
    result = subprocess.run(
        ["bash", str(LAUNCH / "multinode.sh")],
        env={**os.environ, "DRY_RUN": "1", "NODES": "a b", "NODE_RANK": "0", "TRAINER_NODES": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no node is left to serve" in result.stderr


def test_the_slurm_script_renders_every_nodes_commands(tmp_path):
    header = [line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    directives = dict((line.split()[1].lstrip("-") + "=").split("=")[:2] for line in header)  # --exclusive: ""
    nodes = [f"gpu-{i}" for i in range(int(directives["nodes"]))]
    gpus = int(directives["gpus-per-node"])
    commands = dry_run(["bash", str(LAUNCH / "slurm.sbatch")], NODES=" ".join(nodes), SLURM_JOB_NUM_NODES="3")
    trainer_nodes = 2  # the script's default
    per_node = [[commands[rank]] for rank in range(trainer_nodes)]
    servers = commands[trainer_nodes:]
    per_node += [servers[i * gpus : (i + 1) * gpus] for i in range(len(nodes) - trainer_nodes)]
    check_run(per_node, nodes, trainer_nodes, gpus, tmp_path)


def test_the_skypilot_task_runs_multinode_on_each_of_its_nodes(tmp_path):
    task = yaml.safe_load((LAUNCH / "skypilot.yaml").read_text())
    envs = {key: str(value) for key, value in task["envs"].items()}
    gpus = int(task["resources"]["accelerators"].split(":")[1])
    assert int(envs["GPUS_PER_NODE"]) == gpus and int(envs["TRAINER_NODES"]) < task["num_nodes"]
    nodes = [f"10.0.0.{i}" for i in range(task["num_nodes"])]
    per_node = [
        dry_run(
            ["bash", "-c", task["run"]],
            **envs,
            SKYPILOT_NODE_IPS="\n".join(nodes),
            SKYPILOT_NODE_RANK=str(rank),
        )
        for rank in range(len(nodes))
    ]
    check_run(per_node, nodes, int(envs["TRAINER_NODES"]), gpus, tmp_path)


def test_the_ray_cluster_holds_what_the_ppo_config_places_on_it(tmp_path):
    """Ray's own schema accepts the cluster YAML, and its node types offer the custom resources and counts the
    config's placements ask for (critic workers, managed servers), so every role can be placed."""
    from ray.autoscaler._private.util import fillout_defaults, validate_config
    from trl import ModelConfig, TrlParser

    import trl_scale
    from trl_scale.cli import _import_trl_script_types

    cluster = yaml.safe_load((LAUNCH / "ray_cluster.yaml").read_text())
    validate_config(fillout_defaults(cluster))
    script_type, _ = _import_trl_script_types()
    parser = TrlParser((script_type, trl_scale.PPOConfig, ModelConfig))
    config = str(ROOT / "examples" / "ppo_ray_cluster.yaml")
    _, args, _ = parser.parse_args_and_config(["--config", config, "--bf16", "false", "--output_dir", str(tmp_path)])
    offered: dict[str, float] = {}
    for node_type in cluster["available_node_types"].values():
        for name, amount in node_type["resources"].items():
            offered[name] = offered.get(name, 0) + amount * node_type.get("max_workers", 1)
    needed = {}
    for name, amount in (args.critic_placement.get("resources") or {}).items():
        needed[name] = needed.get(name, 0) + amount * args.critic_placement["num_workers"]
    for name, amount in args.managed_server_resources.items():
        if name != "CPU":
            needed[name] = needed.get(name, 0) + amount * args.managed_servers
    assert needed and all(offered.get(name, 0) >= amount for name, amount in needed.items()), (needed, offered)
    assert "ppo --config examples/ppo_ray_cluster.yaml" in (LAUNCH / "ray_cluster.yaml").read_text()
