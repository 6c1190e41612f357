"""One rank of the sharded-adapter check (tests/test_weight_sync.py): a PEFT Llama, sharded with FSDP2 across the
ranks when there are several, whose adapter `adapter_state_dict` gathers on every rank; rank 0 saves what it got
(what the LoRA sync writes for vLLM), and every rank checks it held only a shard."""

import os
import sys

import torch
import torch.distributed as dist


def main(model_path: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same adapter on every rank; init_lora_weights=False: B is not zero
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(model, config)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
        assert lora_b.to_local().numel() < lora_b.numel(), "the adapter is not sharded"
    from trl_scale.rollout.generation import adapter_state_dict

    state = adapter_state_dict(model)
    if world == 1 or dist.get_rank() == 0:
        torch.save(state, out)
    if world > 1:
        from tests.helpers import end_distributed_worker

        end_distributed_worker()  # FSDP2's process groups can abort a rank at native teardown (seen once in CI)


if __name__ == "__main__":
    main(*sys.argv[1:])
