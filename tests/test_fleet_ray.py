"""Managed vLLM servers on a Ray cluster of two simulated nodes (`ray.cluster_utils.Cluster`: a raylet per node,
custom resources standing for the nodes' labels): PPO's vLLM server runs on the `rollout` node, its critic on the
`critic` node, as configured; the server's actor killed mid-run comes back (a new actor in its bundle), is re-synced,
and the run finishes every step; nothing of vLLM is left afterwards."""

from __future__ import annotations

import os
import time

import pytest
from transformers import AutoTokenizer, TrainerCallback

from .helpers import cpu_args, token_parity_reward
from .real_vllm import vllm_cpu_available, weight_version
from .test_fleet import processes_with, wait_gone
from .test_fleet_vllm import managed_fields

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm_cpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_node_cluster():
    if not vllm_cpu_available():
        pytest.skip("real vLLM is not installed: bash scripts/setup_vllm.sh")
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    rollout = cluster.add_node(num_cpus=2, resources={"rollout": 1})
    critic = cluster.add_node(num_cpus=2, resources={"critic": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield {"address": cluster.address, "rollout": rollout.node_id, "critic": critic.node_id}
    ray.shutdown()
    cluster.shutdown()


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


class KillServerActorAt(TrainerCallback):
    def __init__(self, trainer, step: int):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        fleet = self.trainer.rollout_fleet
        if state.global_step == self.step:
            ray.kill(fleet.handles[0].actor, no_restart=True)
        elif state.global_step == self.step + 1:
            deadline = time.monotonic() + 600
            while fleet.restarts < 1 and time.monotonic() < deadline:
                time.sleep(1)


def test_ppo_with_servers_and_critic_on_their_own_nodes(two_node_cluster, tiny_llama_hd64, tmp_path):
    import trl_scale
    from trl_scale.toy import counting_prompts

    marker = f"ray-{os.getpid()}-{time.time_ns()}"
    fields = managed_fields(marker, 1)
    fields.update(managed_server_placement="ray", managed_server_resources={"CPU": 1, "rollout": 1})
    args = trl_scale.PPOConfig(
        **cpu_args(
            tmp_path,
            max_steps=4,
            max_completion_length=6,
            num_ppo_epochs=1,
            num_mini_batches=1,
            backend="ray",
            ray_address=two_node_cluster["address"],
            critic_placement={"num_cpus_per_worker": 1, "resources": {"critic": 1}},
            ray_call_timeout=300,
            weight_sync="shared_dir",
            rollout_request_timeout=120,
            **fields,
        )
    )
    trainer = trl_scale.PPOTrainer(
        model=tiny_llama_hd64,
        reward_funcs=token_parity_reward,
        args=args,
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama_hd64),
    )
    try:
        fleet = trainer.rollout_fleet
        assert _node_of(fleet.handles[0].actor) == two_node_cluster["rollout"]
        assert _node_of(trainer.critic.group.workers[0]) == two_node_cluster["critic"]
        first_actor = fleet.handles[0].actor
        trainer.add_callback(KillServerActorAt(trainer, step=1))
        trainer.train()
        assert trainer.state.global_step == 4
        logs = [entry for entry in trainer.state.log_history if "rollout/server_restarts" in entry]
        assert len(logs) == 4, trainer.state.log_history
        assert fleet.deaths == 1 and fleet.restarts == 1
        restarted = fleet.handles[0]
        assert restarted.actor != first_actor and _node_of(restarted.actor) == two_node_cluster["rollout"]
        # the restarted server is on the run's weights: the trainer's client reached it at its (new) address
        assert [s.url for s in trainer.vllm_generation.client.servers] == [restarted.url]
        assert weight_version(restarted.url) == trainer.vllm_generation.version
        assert processes_with(marker)
    finally:
        trainer.close_rollout_servers()
        trainer.critic.group.shutdown()
    assert not wait_gone(marker, 60), "vLLM processes outlived the run"
