"""The vision-language workload of `benchmarks/packing.py --vlm`: policy scoring (forward + backward) of a batch
whose prompts hold images, stock TRL 1.16's fused forward vs trl-scale's, each in a fresh process (peak RSS above
the level once the model and batch exist, and the median step time).

The model is built from a config (random weights, fp32, sdpa), a 4-layer h256 text model with a 32,768-token
vocabulary, in one of two families (`--vlm-family`):

- `gemma3`: a one-layer SigLIP tower reading 112x112 images as 8x8 patches, one image token per patch (64 per
  image; Gemma 3's processor resizes every image to the tower's size, so images of several sizes arrive as the same
  pixels' shape);
- `qwen2_vl`: a one-layer Qwen2-VL tower reading each image as a grid of 14x14 patches, 2x2 patches merged into one
  image token, grids of 8x8 to 24x24 patches (16 to 144 tokens), 3-D positions.

Rows hold 1-3 images each, 16-160 prompt text tokens, and long-tailed completions up to 256 tokens, left-padded
prompts and right-padded completions as TRL's GRPO scores them.
"""

from __future__ import annotations

import time

BOI, IMAGE, EOI = 32000, 32001, 32002
TOKENS_PER_IMAGE = 64
FAMILIES = ("gemma3", "qwen2_vl")


def build_model(family: str = "gemma3"):
    return build_gemma3() if family == "gemma3" else build_qwen2_vl()


def build_qwen2_vl():
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText

    from trl_scale.toy import tiny_config

    text = tiny_config("qwen2", vocab_size=32768, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2)
    text = text.to_dict()
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [8, 12, 12]}  # of head_dim / 2 = 32 rotary pairs
    vision = dict(depth=1, embed_dim=64, hidden_size=256, num_heads=2, patch_size=14, mlp_ratio=2)
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=dict(vision, spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE,
        video_token_id=IMAGE + 3,
        vision_start_token_id=BOI,
        vision_end_token_id=EOI,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config)


def build_gemma3():
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


def build_batch(batch_size: int, seed: int = 0, family: str = "gemma3"):
    """(input_ids, attention_mask, labels, image inputs) of `batch_size` rows."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    prompts, completions, grids = [], [], []
    for row in range(batch_size):
        parts = []
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            tokens = TOKENS_PER_IMAGE
            if family != "gemma3":  # a grid of patches, each side even (2x2 merged into one token)
                height, width = (torch.randint(4, 13, (2,), generator=generator) * 2).tolist()
                tokens = height * width // 4
            grids.append([1, height, width] if family != "gemma3" else None)
            parts += [BOI] + [IMAGE] * tokens + [EOI]
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
    if family == "gemma3":
        pixel_values = torch.randn(len(grids), 3, 112, 112, generator=generator)
        return ids, mask, labels, {"pixel_values": pixel_values, "token_type_ids": (ids == IMAGE).long()}
    grid = torch.tensor(grids)
    pixel_values = torch.randn(int(grid.prod(1).sum()), 3 * 2 * 14 * 14, generator=generator)
    return (
        ids,
        mask,
        labels,
        {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": (ids == IMAGE).long()},
    )


def worker(variant: str, batch_size: int, repeats: int, status_mib, reset_peak, family: str = "gemma3") -> dict:
    """One variant's median step time and peak RSS (MiB above the level once the model and batch exist)."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring

    model = build_model(family)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if variant.startswith("trl_scale"):  # trl_scale_padded: the chunked head alone, its rows padded
        install_packed_scoring(model, outputs=("entropy",), padding_free=variant == "trl_scale" and None)
    ids, mask, labels, images = build_batch(batch_size, family=family)

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
