"""The vision-language workload of `benchmarks/packing.py --vlm`: policy scoring (forward + backward) of a batch
whose prompts hold images, stock TRL 1.16's fused forward vs trl-scale's, each in a fresh process (peak RSS above
the level once the model and batch exist, and the median step time).

The model is a Gemma 3 vision-language model built from a config (random weights, fp32, sdpa): a 4-layer h256 text
model with a 32,768-token vocabulary, and a one-layer SigLIP tower reading 112x112 images as 8x8 patches, one image
token per patch (64 per image). Rows hold 1-3 images each (Gemma 3's processor resizes every image to the tower's
size, so images of several sizes arrive as the same pixels' shape), 16-160 prompt text tokens, and long-tailed
completions up to 256 tokens, left-padded prompts and right-padded completions as TRL's GRPO scores them.
"""

from __future__ import annotations

import time

BOI, IMAGE, EOI = 32000, 32001, 32002
TOKENS_PER_IMAGE = 64


def build_model():
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    from trl_scale.toy import tiny_config

    text = tiny_config("gemma3", vocab_size=32768, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
    vision = transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=112
    )
    vision.patch_size = 14  # 8x8 patches: one image token each
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=BOI,
        image_token_index=IMAGE,
        eoi_token_index=EOI,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.125)
    return model


def build_batch(batch_size: int, seed: int = 0):
    """(input_ids, attention_mask, labels, image inputs) of `batch_size` rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts, completions, images = [], [], 0
    for row in range(batch_size):
        parts = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            parts += [BOI] + [IMAGE] * TOKENS_PER_IMAGE + [EOI]
            images += 1
        text = torch.randint(10, 30000, (int(torch.randint(16, 161, (1,), generator=generator)),), generator=generator)
        prompts.append(parts + text.tolist())
        length = 256 if row == 0 else int((torch.exp(torch.randn(1, generator=generator) * 0.9) * 32).clamp(4, 256))
        completions.append(torch.randint(10, 30000, (length,), generator=generator).tolist())
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(batch_size, width_p + width_c, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        ids[row, width_p - len(prompt) : width_p] = torch.tensor(prompt)
        ids[row, width_p : width_p + len(completion)] = torch.tensor(completion)
        mask[row, width_p - len(prompt) : width_p + len(completion)] = 1
        labels[row, width_p : width_p + len(completion)] = torch.tensor(completion)
    pixel_values = torch.randn(images, 3, 112, 112, generator=generator)
    return ids, mask, labels, {"pixel_values": pixel_values, "token_type_ids": (ids == IMAGE).long()}


def worker(variant: str, batch_size: int, repeats: int, status_mib, reset_peak) -> dict:
    """One variant's median step time and peak RSS (MiB above the level once the model and batch exist)."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring

    model = build_model()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if variant == "trl_scale":
        install_packed_scoring(model, outputs=("entropy",))
    ids, mask, labels, images = build_batch(batch_size)

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **images)
        (-(out.log_probs * out.label_mask).sum() / out.label_mask.sum()).backward()
        return out

    step()  # warm-up
    baseline = status_mib("VmRSS")
    reset_peak()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
    return {
        "variant": variant,
        "seconds": sorted(times)[len(times) // 2],
        "peak_mib": status_mib("VmHWM") - baseline,
        "tokens": int(mask.sum()),
        "padded_tokens": ids.numel(),
        "image_tokens": int((ids == IMAGE).sum()),
        "completion_tokens": int((labels != -100).sum()),
        "logp_sum": float(out.log_probs.detach().sum()),
    }
