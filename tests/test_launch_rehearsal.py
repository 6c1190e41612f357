"""The launch recipes run for real, as nodes on one machine (tier `launchers`, outside CI: `bash scripts/test.sh -m
launchers`): `examples/launch/multinode.sh` with DEVICE=cpu, its server node a real vLLM CPU server (the CPU build in
.venv-vllm, synced by trl-scale's gloo engine), its trainer nodes `accelerate launch` processes rendezvousing on
localhost; and the Ray-cluster recipe's placements on a cluster of two raylets.

Each run's figures (each step's loss, gradient norm, reward, entropy) equal the same run's on one node (the node
runs to the bit, the Ray one within 2e-8): sampling is seeded per request (`generation_kwargs` seed: each
request draws its own numbers, reproducibly) and the server is put back on the base weights before every run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from trl_scale.rollout import RolloutClient
from trl_scale.rollout.weight_sync import SharedDirSync
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import VLLM_CPU_SHAPE

from .helpers import ROOT, free_port, subprocess_env
from .real_vllm import VLLM_PYTHON, vllm_cpu_available

pytestmark = [
    pytest.mark.launchers,
    pytest.mark.skipif(not vllm_cpu_available(), reason="needs .venv-vllm: bash scripts/setup_vllm.sh"),
]

RECIPE = ROOT / "examples" / "launch" / "multinode.sh"
CONFIG = "examples/grpo_tiny_cpu.yaml"
STEPS = 3


def _run_args(out) -> list[str]:
    return [
        "--max_steps", str(STEPS), "--logging_steps", "1", "--output_dir", str(out), "--per_device_train_batch_size",
        "16", "--num_generations", "4", "--learning_rate", "3e-3", "--generation_kwargs", '{"seed": 7}',
        "--dataset_name", "toy:counting", "--reward_funcs", "tests.helpers.token_parity_reward",
        "--vllm_server_timeout", "600", "--save_strategy", "steps",
        "--save_steps", str(STEPS),
    ]  # fmt: skip


def _recipe_env(model: str, nodes: list[str], rank: int, **more) -> dict:
    env = subprocess_env()
    env.update(NODES=" ".join(nodes), NODE_RANK=str(rank), DEVICE="cpu", MODEL=model, CONFIG=CONFIG)
    env.update(VLLM_PYTHON=str(VLLM_PYTHON), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.update({k: str(v) for k, v in more.items()})
    return env


LOGGED = ("loss", "grad_norm", "reward", "entropy")  # GRPO's loss is 0 on-policy at one iteration: its gradient is not


def _losses(out) -> list[float]:
    """The run's figures at full precision, step by step, from the last checkpoint's log history: the loss, the
    gradient's norm, the reward and the entropy (those a step logs)."""
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    figures = [entry[name] for entry in steps for name in LOGGED if name in entry]
    assert len(steps) == STEPS and all(entry["grad_norm"] > 0 for entry in steps), steps  # the policy moved
    return figures


def _finished(processes: list[subprocess.Popen], timeout: float = 900) -> None:
    for process in processes:
        output, _ = process.communicate(timeout=timeout)
        assert process.returncode == 0, output[-4000:]


@pytest.fixture(scope="module")
def server_node(tmp_path_factory):
    """The recipe's server node (NODE_RANK 1 of a trainer node and a server node): one vLLM CPU server."""
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-llama-hd64"), **VLLM_CPU_SHAPE)
    port = free_port()
    env = _recipe_env(model, ["127.0.0.1", "127.0.0.1"], 1, SERVER_PORT=port)
    process = subprocess.Popen(
        ["bash", str(RECIPE)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url)
        yield model, port, url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def _wait_healthy(process, url: str, timeout: float = 300) -> None:
    """The server node answers `/health` (the rollout client's own wait), its recipe still running."""
    client = RolloutClient([url])
    try:
        client.wait_until_ready(timeout)
    finally:
        client.close()
    assert process.poll() is None, "the server node exited"


def _on_base_weights(model: str, url: str) -> None:
    client = RolloutClient([url])
    try:
        SharedDirSync(client).reload(model, "base")
    finally:
        client.close()


def _reference(model: str, url: str, out, processes: int) -> list[float]:
    """The same run on one node: the CLI alone (one process) or one accelerate launch of `processes`."""
    _on_base_weights(model, url)
    cli = ["-m", "trl_scale.cli", "grpo", "--config", CONFIG, "--model_name_or_path", model,
           "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_urls", url, "--weight_sync", "nccl",
           "--use_cpu", "true", "--bf16", "false",
           *_run_args(out)]  # fmt: skip
    if processes > 1:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                  str(processes), "--num_machines", "1", "--mixed_precision", "no", "--main_process_port",
                  str(free_port())]  # fmt: skip
    else:
        launch = [sys.executable]
    run = subprocess.run([*launch, *cli], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return _losses(out)


def test_the_recipes_trainer_node_trains_as_the_same_run_on_one_node(server_node, tmp_path):
    model, port, url = server_node
    _on_base_weights(model, url)
    out = tmp_path / "recipe"
    env = _recipe_env(model, ["127.0.0.1", "127.0.0.1"], 0, SERVER_PORT=port, MASTER_PORT=free_port(),
                      TRAINER_ARGS=" ".join(_run_args(out)).replace('{"seed": 7}', '{"seed":7}'))  # fmt: skip
    trainer = subprocess.Popen(["bash", str(RECIPE)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _finished([trainer])
    got = _losses(out)
    expected = _reference(model, url, tmp_path / "one-node", processes=1)
    print(json.dumps({"rehearsal": "trainer node + server node", "recipe": got, "one_node": expected}))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (got, expected)


def test_two_trainer_nodes_rendezvous_on_localhost_and_train_as_one_node_of_two_processes(server_node, tmp_path):
    """NODES: two trainer nodes and the server node; accelerate's --num_machines 2 rendezvous (gloo) on localhost,
    one process each."""
    model, port, url = server_node
    _on_base_weights(model, url)
    out = tmp_path / "recipe"
    nodes = ["127.0.0.1"] * 3
    master = free_port()
    trainers = []
    for rank in (0, 1):
        env = _recipe_env(model, nodes, rank, TRAINER_NODES=2, SERVER_PORT=port, MASTER_PORT=master,
                          TRAINER_ARGS=" ".join(_run_args(out)).replace('{"seed": 7}', '{"seed":7}'))  # fmt: skip
        trainers.append(subprocess.Popen(["bash", str(RECIPE)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))  # fmt: skip
    _finished(trainers)
    got = _losses(out)
    expected = _reference(model, url, tmp_path / "one-node", processes=2)
    print(json.dumps({"rehearsal": "two trainer nodes + server node", "recipe": got, "one_node_2_procs": expected}))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6), (got, expected)


# ---- the Ray-cluster recipe: examples/ppo_ray_cluster.yaml on raylets started by `ray start` ----------------------

RAY_CONFIG = "examples/ppo_ray_cluster.yaml"


def _ray(*args: str, env: dict) -> None:
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    run = subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def _raylets(tmp_path, nodes: list[dict]) -> tuple[str, dict]:
    """Raylets on this machine by Ray's own `ray start`: the head, then each further node joining it; each with its
    CPUs and custom resources (what the recipe's node types offer)."""
    port = free_port()
    env = subprocess_env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    head, *others = nodes
    common = ["--include-dashboard=false", "--disable-usage-stats"]
    _ray("start", "--head", "--port", str(port), "--num-cpus", str(head["cpus"]), "--resources",
         json.dumps(head["resources"]), *common, env=env)  # fmt: skip
    for node in others:
        _ray("start", "--address", f"127.0.0.1:{port}", "--num-cpus", str(node["cpus"]), "--resources",
             json.dumps(node["resources"]), "--disable-usage-stats", env=env)  # fmt: skip
    return f"127.0.0.1:{port}", env


def _ray_recipe_run(model: str, reward_model: str, address: str, env: dict, out) -> list[float]:
    """The recipe's PPO config as its comment runs it (the trainer a driver on the head), with CPU sizes: one managed
    vLLM CPU server on a `rollout` node, the critic and the reward model on `critic` ones."""
    vllm_args = "--max-model-len 512 --dtype float32 --enforce-eager"
    cli = [sys.executable, "-m", "trl_scale.cli", "ppo", "--config", RAY_CONFIG, "--model_name_or_path", model,
           "--dataset_name", "toy:counting", "--reward_model_name_or_path", reward_model, "--output_dir", str(out),
           "--dtype", "float32", "--bf16", "false", "--use_cpu", "true", "--report_to", "none",
           "--ray_address", address, "--per_device_train_batch_size", "8", "--max_completion_length", "6",
           "--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(STEPS),
           "--num_ppo_epochs", "1", "--num_mini_batches", "1", "--learning_rate", "3e-3",
           "--generation_kwargs", '{"seed": 7}', "--managed_servers", "1", "--managed_server_gpus", "0",
           "--managed_server_resources", '{"CPU": 1, "rollout": 1}', "--managed_server_python", str(VLLM_PYTHON),
           f"--managed_server_args={vllm_args}", "--weight_sync_dir", str(out / "weights"),
           "--managed_server_env", '{"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}',
           "--managed_server_ready_timeout", "600",
           "--critic_placement", '{"num_workers": 1, "num_gpus_per_worker": 0, "num_cpus_per_worker": 1, '
           '"resources": {"critic": 1}}',
           "--reward_placement", '{"num_workers": 1, "num_gpus_per_worker": 0, "num_cpus_per_worker": 1, '
           '"resources": {"critic": 1}}',
           "--token_budget", "512", "--ray_call_timeout", "600"]  # fmt: skip
    run = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return _losses(out)


def test_the_ray_cluster_recipe_places_its_roles_on_two_raylets_and_trains_as_on_one(tmp_path):
    """Two raylets (`ray start` twice): the head offers `rollout`, the second node `critic`, so the managed vLLM
    server can only run on the head and the critic and reward model only on the second (Ray places by the custom
    resources the config's placements ask for). The same run on one raylet offering both gives the same losses."""
    model = build_tiny_model(tmp_path / "policy", **VLLM_CPU_SHAPE)
    reward_model = build_tiny_model(tmp_path / "reward", kind="reward", seed=1)
    losses = {}
    layouts = {
        "two raylets": [{"cpus": 2, "resources": {"rollout": 1}}, {"cpus": 2, "resources": {"critic": 2}}],
        "one raylet": [{"cpus": 4, "resources": {"rollout": 1, "critic": 2}}],
    }
    for name, nodes in layouts.items():
        address, env = _raylets(tmp_path / name, nodes)
        try:
            losses[name] = _ray_recipe_run(model, reward_model, address, env, tmp_path / name.replace(" ", "-"))
        finally:
            _ray("stop", "--force", env=env)
    print(json.dumps({"rehearsal": "ray cluster recipe", **losses}))
    assert losses["two raylets"] == pytest.approx(losses["one raylet"], abs=1e-6), losses
