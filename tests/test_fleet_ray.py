"""Managed vLLM servers on a Ray cluster of two simulated nodes (`ray.cluster_utils.Cluster`: a raylet per node,
custom resources standing for the nodes' labels): PPO's vLLM server runs on the `rollout` node, its critic and reward
model on the `critic` node, as configured; the server's actor killed mid-run comes back (a new actor in its bundle),
catches up to the current weights, the run finishes every step and the server serves the policy's weights; a reward
function that raises in a later run stops the server: nothing of vLLM is left."""

from __future__ import annotations

import os
import time

import pytest
from transformers import AutoTokenizer, TrainerCallback

from .helpers import cpu_args, token_parity_reward
from .processes import wait_gone
from .real_vllm import vllm_cpu_available, weight_version
from .test_fleet import assert_a_raising_train_stops_the_servers
from .test_fleet_vllm import managed_fields
from .test_real_vllm import SYNC_TOLERANCE, served_vs_policy

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
    critic = cluster.add_node(num_cpus=2, resources={"critic": 2})
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


def test_ppo_with_servers_on_one_node_and_critic_and_reward_model_on_another(
    two_node_cluster, tiny_llama_hd64, tiny_reward_model, tmp_path
):
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
            reward_placement={"num_cpus_per_worker": 1, "resources": {"critic": 1}},
            ray_call_timeout=300,
            weight_sync="shared_dir",
            rollout_request_timeout=120,
            **fields,
        )
    )
    trainer = trl_scale.PPOTrainer(
        model=tiny_llama_hd64,
        reward_funcs=[tiny_reward_model, token_parity_reward],
        args=args,
        train_dataset=counting_prompts(64),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama_hd64),
    )
    try:
        fleet = trainer.rollout_fleet
        assert _node_of(fleet.handles[0].actor) == two_node_cluster["rollout"]
        assert _node_of(trainer.critic.group.workers[0]) == two_node_cluster["critic"]
        assert _node_of(trainer.reward_funcs[0].group.workers[0]) == two_node_cluster["critic"]
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
        assert weight_version(restarted.url) == trainer.vllm_generation.syncer.version
        trainer.vllm_generation.sync_weights()  # the last step's update came after the last sync
        assert (diff := served_vs_policy(trainer, restarted.url)) <= SYNC_TOLERANCE, diff
        # a later run whose reward function raises: train() stops the server (its actor and vLLM's processes)
        assert_a_raising_train_stops_the_servers(trainer, marker, reward_index=1, timeout=60)
    finally:
        trainer.close_rollout_servers()
        trainer.critic.group.shutdown()
    assert not wait_gone(marker, 60), "vLLM processes outlived the run"
