"""One rank of a critic-sharding check, run by `torch.distributed.run` (or alone): a `CriticUpdater` with the
given sharding takes 4 micro-steps (GA 2) on its slice of a fixed batch, saves its training state, takes 2 more;
a fresh updater loads the saved state and takes the same 2. Rank 0 writes what it saw to ``out``. For a
vision-language critic (a processor saved with the model) each row's prompt carries an image.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.critic_sharding_worker MODEL SHARDING OUT
"""

import copy
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers import end_distributed_worker
from trl_scale.critic import CriticBatch, CriticSettings, CriticUpdater, load_critic

ROWS, PROMPT, COMPLETION = 8, 4, 6


def _batches(model_path: str, vocab: int):
    """Six batches of (token ids, returns, image inputs or None, prompt length)."""
    generator = torch.Generator().manual_seed(0)
    processor = _processor(model_path)
    for _ in range(6):
        images, prompt_ids = _image_prompts(processor, generator)
        prompt_len = PROMPT if prompt_ids is None else prompt_ids.size(1)
        input_ids = torch.randint(10, vocab, (ROWS, prompt_len + COMPLETION), generator=generator)
        if images is not None:
            input_ids[:, :prompt_len] = prompt_ids
            completion_types = images["token_type_ids"].new_zeros(ROWS, COMPLETION)
            images["token_type_ids"] = torch.cat([images["token_type_ids"], completion_types], 1)
        returns = torch.randn(ROWS, COMPLETION, generator=generator)
        yield input_ids, returns, images, prompt_len


def _processor(model_path: str):
    """The model's processor (loaded once), or None for a text-only critic."""
    if not os.path.exists(os.path.join(model_path, "processor_config.json")):
        return None
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_path)


def _image_prompts(processor, generator):
    """A random image per row through the processor, or (None, None) for a text-only critic."""
    if processor is None:
        return None, None
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " one two"}]}]
    text = processor.apply_chat_template(message, tokenize=False, add_generation_prompt=True)
    pixels = (torch.rand(ROWS, 28, 28, 3, generator=generator) * 255).to(torch.uint8).numpy()
    inputs = processor(images=[[image] for image in pixels], text=[text] * ROWS, return_tensors="pt")
    return {"pixel_values": inputs["pixel_values"], "token_type_ids": inputs["token_type_ids"]}, inputs["input_ids"]


def _deepspeed_config(sharding: str):
    """For "zero2"/"zero3": the critic engine's config as a launcher would give it (GA 2, clipping 1)."""
    if not sharding.startswith("zero"):
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def config(num_training_steps: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": ROWS // world,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 2 * ROWS,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": int(sharding[-1])},
            "zero_allow_untested_optimizer": True,
        }

    return config


def _updater(model_path: str, sharding: str) -> CriticUpdater:
    updater = CriticUpdater(
        load_critic(model_path, seed=0),
        CriticSettings(learning_rate=1e-2, gradient_accumulation_steps=2, max_grad_norm=1.0, cliprange_value=0.5),
        sharding="deepspeed" if sharding.startswith("zero") else sharding,
        deepspeed_config=_deepspeed_config(sharding),
    )
    updater.set_scheduler("linear", 1, 10, None)
    return updater


def _micro_step(updater: CriticUpdater, input_ids, returns, images, prompt_len, rank: int, world: int) -> float:
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    input_ids, returns = input_ids[rows], returns[rows]
    images = {key: value[rows] for key, value in images.items()} if images else None  # one image per row
    mask = torch.ones_like(returns)
    attention_mask = torch.ones_like(input_ids)
    old_values = updater.values(input_ids, attention_mask, prompt_len, COMPLETION, images)
    batch = CriticBatch(input_ids, attention_mask, prompt_len, old_values, returns, mask, multimodal_inputs=images)
    loss, _ = updater.step(batch)
    if world > 1:  # the whole batch's loss: ranks hold equal token counts
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def main(model_path: str, sharding: str, out: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    updater = _updater(model_path, sharding)
    batches = list(_batches(model_path, updater.critic.get_input_embeddings().num_embeddings))
    losses = [_micro_step(updater, *batch, rank, world) for batch in batches[:4]]
    checkpoint = os.path.join(os.path.dirname(out), f"checkpoint-{sharding}-{world}")
    os.makedirs(checkpoint, exist_ok=True)
    saved_weights = copy.deepcopy(updater.weights())  # not the live parameters
    updater.save_training_state(checkpoint, rank == 0)
    result = {
        "losses": losses,
        "weights_at_checkpoint": saved_weights,
        # not the live tensors; a DeepSpeed engine keeps its own sharded files instead
        "optimizer_at_checkpoint": None
        if sharding.startswith("zero")
        else copy.deepcopy(updater.state()["optimizer"]),
        "shard_bytes": updater.shard_bytes(),
    }
    for batch in batches[4:]:
        _micro_step(updater, *batch, rank, world)
    result["weights"] = updater.weights()
    if world > 1:
        dist.barrier()  # the checkpoint is written
    resumed = _updater(model_path, sharding)
    resumed.load_training_state(checkpoint, _broadcast(saved_weights) if world > 1 else saved_weights)
    for batch in batches[4:]:
        _micro_step(resumed, *batch, rank, world)
    result["resumed_weights"] = resumed.weights()
    if rank == 0:
        torch.save(result, out)
    if world > 1:
        end_distributed_worker()


def _broadcast(state: dict) -> dict:
    """Rank 0's gathered weights, for a rank that got none (the trainer reads them from the checkpoint's file)."""
    holder = [state]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


if __name__ == "__main__":
    main(*sys.argv[1:4])
