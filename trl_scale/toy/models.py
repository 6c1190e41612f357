"""Tiny causal LMs and reward models built from configs and saved to disk, so that ``from_pretrained(path)``
runs the real loading code with no Hub access."""

from __future__ import annotations

import os
from typing import Literal

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
)

from ..sharding.zero import whole_parameters
from .tokenizer import build_tokenizer, vlm_chat_template

ModelFamily = Literal[
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma2",
    "gemma3",
    "gpt2",
    "opt",
    "falcon",
    "lfm2",
    "nemotron_h",
    "qwen3_next",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "gpt_oss",
    "deepseek_v3",
    "granitemoe",
]

# Families beyond Llama-style configs, each as (config class, keyword arguments in terms of the common sizes).
# Gemma 2/3 carry logit soft-capping and sliding windows; GPT-2 and OPT learned absolute positions; OPT and Falcon do
# not build packed masks from position_ids; LFM2, NemotronH and Qwen3-Next are hybrids with convolution, Mamba-2
# and gated-delta-rule layers.
_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": "head_dim"}),
    "mistral": ("MistralConfig", {"sliding_window": 8}),
    "phi3": ("Phi3Config", {}),
    "gemma2": ("Gemma2Config", {"head_dim": "head_dim", "final_logit_softcapping": 30.0, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": "head_dim", "final_logit_softcapping": 30.0, "sliding_window": 8}),
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
    "nemotron_h": (
        "NemotronHConfig",
        {"mamba_num_heads": 4, "mamba_head_dim": "head_dim", "ssm_state_size": 16, "n_groups": 1,
         "hybrid_override_pattern": "M*", "chunk_size": 16},
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        {"head_dim": "head_dim", "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
         "linear_key_head_dim": "head_dim", "linear_value_head_dim": "head_dim",
         "layer_types": ["linear_attention", "full_attention"]},
    ),
    # A mixture of experts: transformers keeps each block's experts fused (`mlp.experts.gate_up_proj`,
    # `mlp.experts.down_proj`), its checkpoints (and vLLM's loader) name them one expert at a time.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": "head_dim", "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
         "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    # More mixtures of experts: Qwen2-MoE with its shared expert, Mixtral, OLMoE, GPT-OSS (attention sinks, sliding
    # and full layers)
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
         "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "gpt_oss": (
        "GptOssConfig",
        {"head_dim": "head_dim", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"]},
    ),
    # DeepSeek-V3: multi-head latent attention, sigmoid routing limited to groups with a bias correction, a shared
    # expert; GraniteMoE: a softmax over the chosen experts' logits (its config names no `num_experts`)
    "deepseek_v3": (
        "DeepseekV3Config",
        {"moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
         "first_k_dense_replace": 0, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
         "qk_nope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1, "num_key_value_heads": "num_heads"},
    ),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip
ModelKind = Literal["causal-lm", "reward"]


# A shape vLLM's CPU build can serve: its CPU attention refuses head_dim 16 (the default shape's), takes 64.
VLLM_CPU_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def tiny_config(
    family: ModelFamily = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
    **overrides,
) -> PretrainedConfig:
    """A small config of the given family (untied embeddings, fp32, sdpa attention)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    common.update(overrides)  # e.g. max_position_embeddings, attn_implementation
    # Older families with their own size names; they start sequences with their EOS token.
    tokens = dict(
        vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=eos_token_id
    )
    if family == "gpt2":
        sizes = dict(n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=1024)
        return transformers.GPT2Config(**{**tokens, **sizes, **overrides})
    if family in ("opt", "falcon"):
        sizes = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads)
        if family == "opt":
            sizes.update(ffn_dim=intermediate_size or 2 * hidden_size, word_embed_proj_dim=hidden_size)
        config_class = transformers.OPTConfig if family == "opt" else transformers.FalconConfig
        return config_class(**{**tokens, **sizes, **overrides})
    if family not in _FAMILIES:
        raise ValueError(
            f"family={family!r} is not supported; use one of {sorted(_FAMILIES) + ['gpt2', 'opt', 'falcon']}"
        )
    class_name, extra = _FAMILIES[family]
    head_dim = hidden_size // num_heads
    placeholders = {"head_dim": head_dim, "num_heads": num_heads}  # MLA keeps a key-value head per attention head
    extra = {k: placeholders.get(v, v) if isinstance(v, str) else v for k, v in extra.items()}
    extra = {k: v for k, v in extra.items() if k != "layer_types" or len(v) == num_layers}
    return getattr(transformers, class_name)(**{**common, **extra, **overrides})


def build_tiny_model(
    output_dir: str | os.PathLike,
    family: ModelFamily = "llama",
    kind: ModelKind = "causal-lm",
    words: list[str] | None = None,
    seed: int = 0,
    **config_kwargs,
) -> str:
    """Create a tiny random model of ``family`` and the toy tokenizer, save both to ``output_dir``.

    ``kind="reward"`` builds a sequence-classification model with one label (a reward or value model).
    Returns the directory, ready for ``AutoModelFor*.from_pretrained`` and ``AutoTokenizer.from_pretrained``.
    """
    output_dir = os.fspath(output_dir)
    tokenizer = build_tokenizer(words)
    config = tiny_config(
        family,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **config_kwargs,
    )
    torch.manual_seed(seed)
    with whole_parameters():
        if kind == "causal-lm":
            model = AutoModelForCausalLM.from_config(config)
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.bos_token_id = None
        elif kind == "reward":
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            raise ValueError(f"kind={kind!r} is not supported; use 'causal-lm' or 'reward'")
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    check_tokenizer_round_trip(output_dir, tokenizer)
    return output_dir


# Gemma 3's named image tokens (its processor reads them from the tokenizer).
_GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def build_tiny_vlm(
    output_dir: str | os.PathLike, words: list[str] | None = None, seed: int = 0, **text_config_kwargs
) -> str:
    """Create a tiny random Gemma 3 vision-language model and its processor, save both to ``output_dir``.

    A one-layer SigLIP tower reads 28x28 images as 4x4 patches, pooled into 4 image tokens. The processor is
    Gemma 3's own (image processor + the toy tokenizer with Gemma 3's image tokens + a chat template for content
    lists), so ``AutoProcessor``, ``AutoModelForImageTextToText`` and ``AutoModelForSequenceClassification`` (a
    critic or reward model that sees the images) all load it from ``output_dir``.
    """
    output_dir = os.fspath(output_dir)
    tokenizer = build_tokenizer(words, model_special_tokens=_GEMMA3_IMAGE_TOKENS)
    tokenizer.chat_template = vlm_chat_template(tokenizer.boi_token)
    # No final soft-capping, as Gemma 3's checkpoints: Gemma3ForConditionalGeneration never applies it (only the
    # text-only Gemma3ForCausalLM does), while TRL's fused head, trl-scale's and vLLM's read it from the text config,
    # so a value here would score other log-probs than the model samples (measured: 2e-3 on a trained tiny VLM).
    text_config = tiny_config(
        "gemma3",
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"final_logit_softcapping": None} | text_config_kwargs),
    )
    vision_config = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7
    )
    image_tokens_per_image = 4
    config = transformers.Gemma3Config(
        text_config=text_config.to_dict(),
        vision_config=vision_config.to_dict(),
        mm_tokens_per_image=image_tokens_per_image,
        boi_token_index=tokenizer.boi_token_id,
        image_token_index=tokenizer.image_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with whole_parameters():
        model = AutoModelForImageTextToText.from_config(config)
        # Gemma 3 starts its image projection at zero (image tokens then read nothing from the image): drawn here,
        # so that the tiny model sees its images from the start and a test pairing the wrong image can tell.
        projection = model.model.multi_modal_projector.mm_input_projection_weight
        torch.nn.init.normal_(projection, std=vision_config.hidden_size**-0.5)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=image_tokens_per_image,
    )
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    return output_dir


_QWEN2_VL_TOKENS = {
    "vision_start_token": "<|vision_start|>",
    "image_token": "<|image_pad|>",
    "vision_end_token": "<|vision_end|>",
    "video_token": "<|video_pad|>",
}


def build_tiny_qwen2_vl(output_dir: str | os.PathLike, seed: int = 0, family: str = "qwen2_vl") -> str:
    """Create a tiny random Qwen2-VL (3-D "mrope" positions: an image's tokens get (time, height, width) positions)
    and its tokenizer, save both to ``output_dir``; ``family="qwen2_5_vl"``: a Qwen2.5-VL (its vision tower attends
    within windows of 4x4 patches in its first block, over the whole image in its last).

    A small vision tower reads 7x7 patches, two frames deep, merging 2x2 patches into one image token: an image
    of grid (1, h, w) patches is ``h * w / 4`` tokens between ``<|vision_start|>`` and ``<|vision_end|>``. No processor
    is saved: Qwen2-VL's needs torchvision (for its video processor), which this machine's torch has no build of;
    `toy.qwen2_vl_processor.qwen2_vl_processor(path)` builds one in code, for images only.
    """
    output_dir = os.fspath(output_dir)
    tokenizer = build_tokenizer(model_special_tokens=_QWEN2_VL_TOKENS)
    text = tiny_config(
        "qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    ).to_dict()
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}  # of head_dim / 2 = 8 rotary pairs
    grid = dict(patch_size=7, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        vision = dict(depth=1, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        vision = dict(depth=2, hidden_size=32, out_hidden_size=text["hidden_size"], intermediate_size=64, num_heads=2)
        vision |= dict(window_size=28, fullatt_block_indexes=[1])  # windows of 28 pixels: 4x4 patches
    else:
        raise ValueError(f"family={family!r}: 'qwen2_vl' or 'qwen2_5_vl'")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in _QWEN2_VL_TOKENS.items()}
    config = config_class(
        text_config=text,
        vision_config=vision | grid,
        image_token_id=ids["image_token"],
        video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"],
        vision_end_token_id=ids["vision_end_token"],
    )
    torch.manual_seed(seed)
    with whole_parameters():
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def check_tokenizer_round_trip(path: str, tokenizer=None, text: str | None = None) -> None:
    """Fail loudly if the tokenizer saved at ``path`` does not reload as the one that was saved."""
    tokenizer = tokenizer or build_tokenizer()
    text = text or "three four five the cat"
    reloaded = AutoTokenizer.from_pretrained(path)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    got = reloaded(text, add_special_tokens=False)["input_ids"]
    if got != expected or reloaded.decode(got) != text:
        raise RuntimeError(
            f"tokenizer saved at {path} reloads as {type(reloaded).__name__} and encodes {text!r} as {got}, "
            f"not {expected}"
        )
