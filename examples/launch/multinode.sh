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
#   DEVICE=cpu     a rehearsal without GPUs (tests/test_launch_rehearsal.py runs it: two nodes on one machine):
#                  GPUS_PER_NODE counts processes and servers per node (1), the trainers run on the CPU (gloo),
#                  the servers are vLLM's CPU build, synced by trl-scale's gloo engine (its vLLM plugin)
#   VLLM_PYTHON    run the servers as `$VLLM_PYTHON -m vllm.entrypoints.openai.api_server` (vLLM's own
#                  environment, or the CPU build, whose `vllm` command does not run); default: `vllm serve`
#   TRAINER_ARGS   more trainer arguments, e.g. "--max_steps 2 --output_dir out"
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d .venv/bin ] && PATH="$PWD/.venv/bin:$PATH"  # scripts/setup.sh's environment, where there is one
read -r -a nodes <<< "${NODES:?NODES: the nodes, space-separated, trainer nodes first}"
rank=${NODE_RANK:?NODE_RANK: the index of this node in NODES}
trainer_nodes=${TRAINER_NODES:-1}
device=${DEVICE:-gpu}
if [ "$device" = cpu ]; then gpus=${GPUS_PER_NODE:-1}; else gpus=${GPUS_PER_NODE:-8}; fi
read -r -a trainer_args <<< "${TRAINER_ARGS:-}"
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

if [ "$device" = cpu ]; then
    # gloo processes (accelerate's --multi_gpu with use_cpu), fp32; the servers: vLLM's CPU build, its KV cache small
    on_device=(--mixed_precision no)
    trainer_device=(--use_cpu true --bf16 false)
    server_env=(VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1)
    server_device=(--dtype float32 --enforce-eager --max-model-len 512)
    engine='{"backend":"trl_scale_gloo"}'
else
    on_device=() trainer_device=() server_env=() server_device=() engine='{"backend":"nccl"}'
fi
if [ -n "${VLLM_PYTHON:-}" ]; then vllm_serve=("$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model); else
    vllm_serve=(vllm serve); fi

if [ "$rank" -lt "$trainer_nodes" ]; then
    # the servers take minutes to load a model: the trainer's preflight waits for each (vllm_server_timeout)
    run accelerate launch --config_file examples/accelerate/multi_gpu.yaml "${on_device[@]}" \
        --num_machines "$trainer_nodes" --num_processes $((trainer_nodes * gpus)) --machine_rank "$rank" \
        --main_process_ip "${nodes[0]}" --main_process_port "${MASTER_PORT:-29500}" \
        -m trl_scale.cli "$method" --config "$config" --model_name_or_path "$model" \
        --use_vllm true --vllm_mode server --vllm_server_base_urls "${urls[@]}" --weight_sync nccl \
        --vllm_server_timeout 1800 \
        "${trainer_device[@]}" "${trainer_args[@]}"
else
    serve() {
        local visible=()
        [ "$device" = cpu ] || visible=(CUDA_VISIBLE_DEVICES="$1")
        run env "${visible[@]}" "${server_env[@]}" VLLM_SERVER_DEV_MODE=1 "${vllm_serve[@]}" "$model" \
            --host 0.0.0.0 --port $((port + $1)) --weight-transfer-config "$engine" \
            --logprobs-mode processed_logprobs "${server_device[@]}"
    }
    for ((gpu = 0; gpu < gpus; gpu++)); do
        if [ -n "${DRY_RUN:-}" ]; then serve "$gpu"; else serve "$gpu" & fi  # printed in order; run side by side
    done
    wait
fi
