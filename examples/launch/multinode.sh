#!/usr/bin/env bash
# One node's part of a multi-node trl-scale run: the first TRAINER_NODES nodes train (accelerate launch, one process
# per GPU, DDP), every other node serves the policy with vLLM (one server per GPU; trl-scale routes over all of them,
# fails over, and syncs weights into them over vLLM's NCCL weight-transfer engine). The SLURM, SkyPilot and
# Kubernetes recipes beside it run this script on every node with NODES and NODE_RANK set.
#
#   NODES          the nodes' hostnames or IPs, space-separated, trainer nodes first (required)
#   NODE_RANK      this node's index in NODES (required)
#   TRAINER_NODES  how many nodes train (1)       GPUS_PER_NODE  GPUs per node (8)
#   METHOD         grpo or ppo (grpo)             CONFIG         the trainer YAML (examples/grpo_qwen2.5-1.5b_8gpu.yaml)
#   MODEL          the policy (the YAML's)        SERVER_PORT    the first server port on a node (8000)
#   MASTER_PORT    the trainers' rendezvous port (29500)
#   DRY_RUN=1      print each command instead of running it (tests/test_launch_recipes.py parses them)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv/bin ] && PATH="$PWD/.venv/bin:$PATH"  # scripts/setup.sh's environment, where there is one
read -r -a nodes <<< "${NODES:?NODES: the nodes, space-separated, trainer nodes first}"
rank=${NODE_RANK:?NODE_RANK: the index of this node in NODES}
trainer_nodes=${TRAINER_NODES:-1}
gpus=${GPUS_PER_NODE:-8}
method=${METHOD:-grpo}
config=${CONFIG:-examples/grpo_qwen2.5-1.5b_8gpu.yaml}
model=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
port=${SERVER_PORT:-8000}
if [ "${#nodes[@]}" -le "$trainer_nodes" ]; then
    echo "NODES has ${#nodes[@]} node(s) and TRAINER_NODES=$trainer_nodes: no node is left to serve" >&2
    exit 2
fi

run() {
    if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

urls=()
for node in "${nodes[@]:trainer_nodes}"; do
    for ((gpu = 0; gpu < gpus; gpu++)); do urls+=("http://$node:$((port + gpu))"); done
done

if [ "$rank" -lt "$trainer_nodes" ]; then
    # the servers take minutes to load a model: the trainer's preflight waits for each (vllm_server_timeout)
    run accelerate launch --config_file examples/accelerate/multi_gpu.yaml \
        --num_machines "$trainer_nodes" --num_processes $((trainer_nodes * gpus)) --machine_rank "$rank" \
        --main_process_ip "${nodes[0]}" --main_process_port "${MASTER_PORT:-29500}" \
        -m trl_scale.cli "$method" --config "$config" --model_name_or_path "$model" \
        --vllm_server_base_urls "${urls[@]}" --weight_sync nccl --vllm_server_timeout 1800
else
    serve() {
        run env CUDA_VISIBLE_DEVICES="$1" VLLM_SERVER_DEV_MODE=1 vllm serve "$model" --host 0.0.0.0 \
            --port $((port + $1)) --weight-transfer-config '{"backend":"nccl"}' \
            --logprobs-mode processed_logprobs
    }
    for ((gpu = 0; gpu < gpus; gpu++)); do
        if [ -n "${DRY_RUN:-}" ]; then serve "$gpu"; else serve "$gpu" & fi  # printed in order; run side by side
    done
    wait
fi
