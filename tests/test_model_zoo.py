"""Packed scoring on every model family: exact where the model supports it (values and gradients against each
sequence scored alone, the ground truth), TRL's padded path with one warning where it does not, an error where the
user asked for packing. Also: TRL's fp32 head option, and the chunked head never materialising full logits."""

import copy
import logging

import pytest
import torch
import transformers
from packaging.version import Version
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

import trl_scale
from trl_scale.scoring import install_packed_scoring, packing_support, probe_packing, use_packing
from trl_scale.toy import build_tiny_model, counting_prompts

from .helpers import cpu_args, max_param_diff, padded_scoring_batch, step_logs, token_parity_reward

# Packs exactly in transformers 5 (sdpa; Gemma 2 has no sdpa, eager): RoPE, sliding windows, soft-capping, GPT-2's
# learned absolute positions (packed positions restart at 0, as for a sequence alone), and two mixtures of experts
# without a router loss in TRL's forward: GraniteMoE's (asked for: below), DeepSeek-V3 (latent attention, none).
EXACT_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt2", "granitemoe", "deepseek_v3"]
# OPT builds its mask without position_ids; the hybrids' CPU kernels cannot keep sequences apart; GPT-OSS's eager
# attention (with sinks) lets a packed sequence see the one before it.
INEXACT_FAMILIES = ["opt", "lfm2", "nemotron_h", "qwen3_next", "gpt_oss"]
# Falcon's mask ignores position_ids before transformers 5.24 and honours them from 5.24 (measured): the probe decides.
(EXACT_FAMILIES if Version(transformers.__version__) >= Version("5.24") else INEXACT_FAMILIES).append("falcon")


def _objective(out, valid):
    return (out.log_probs * valid).sum() + 0.3 * (out.entropy * valid).sum()


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_packed_scoring_is_exact_per_family(zoo, family):
    path = zoo(family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # no dropout; the engine still forces no cache
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    packed_model = copy.deepcopy(model)
    config = install_packed_scoring(
        packed_model, padding_free=True, logprob_chunk_size=5, temperature=0.7, outputs=("entropy",)
    )
    assert config is not None and packing_support(packed_model.base_model).exact is True
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(path))
    params = [p for p in model.parameters() if p.requires_grad]

    packed = packed_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    packed_grads = torch.autograd.grad(_objective(packed, packed.label_mask), list(packed_model.parameters()))
    assert config.stats.calls == 1 and config.stats.fallbacks == 0

    # Ground truth: each sequence alone, unpadded, through TRL's own fused forward.
    total = 0.0
    for row in range(input_ids.size(0)):
        real = mask[row].bool()
        start, length = int(real.nonzero()[0]), int(real.sum())
        alone = model(
            input_ids=input_ids[row, real][None],
            attention_mask=torch.ones(1, length, dtype=torch.long),
            labels=labels[row, real][None],
            fused_lm_head=True,
        )
        for name in ("log_probs", "entropy"):
            got = getattr(packed, name)[row, start : start + length - 1]
            assert (got - getattr(alone, name)[0]).abs().max().item() <= 1e-5, (family, name, row)
        assert torch.equal(packed.label_mask[row, start : start + length - 1], alone.label_mask[0])
        total = total + _objective(alone, alone.label_mask)
    reference_grads = torch.autograd.grad(total, params)
    assert len(packed_grads) == len(reference_grads) > 0
    for got, expected in zip(packed_grads, reference_grads):
        assert (got - expected).abs().max().item() <= 1e-5, family


@pytest.mark.parametrize("family", INEXACT_FAMILIES)
def test_inexact_family_falls_back_with_one_warning_or_errors_when_packing_is_asked(zoo, family, caplog):
    path = zoo(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    add_fused_lm_head(model, outputs=("log_probs",))
    trl_forward = model.forward
    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        assert install_packed_scoring(model, padding_free=None) is None
        assert use_packing(model.base_model, None, probe_now=True) is False  # decided once, warned once
    assert model.forward is trl_forward  # TRL's padded path, untouched
    warnings = [r.getMessage() for r in caplog.records if "not exact" in r.getMessage()]
    model_type = model.config.model_type
    assert len(warnings) == 1 and f"'{model_type}'" in warnings[0] and "padded path" in warnings[0]

    fresh = AutoModelForCausalLM.from_pretrained(path)
    add_fused_lm_head(fresh, outputs=("log_probs",))
    with pytest.raises(ValueError, match=rf"padding_free=True.*'{model_type}'.*Fix: set padding_free=None"):
        install_packed_scoring(fresh, padding_free=True)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_probe_accepts_exact_models_in_half_precision(zoo, family):
    model = AutoModelForCausalLM.from_pretrained(zoo(family), dtype=torch.bfloat16)
    assert probe_packing(model.base_model, varlen=False) == (True, "")
    assert probe_packing(model.base_model, varlen=True) == (True, "")


def test_probe_catches_a_mask_that_ignores_packing(zoo):
    """The probe itself must fail on a leaking model: a Llama whose mask builder never sees position_ids."""
    model = AutoModelForCausalLM.from_pretrained(zoo("llama"))
    backbone = model.base_model
    forward = backbone.forward

    def leaky_forward(*args, position_ids=None, **kwargs):
        return forward(*args, **kwargs)  # positions (and so the block-diagonal mask) dropped

    backbone.forward = leaky_forward
    exact, reason = probe_packing(backbone, varlen=False)
    assert not exact and "sees the one before it" in reason


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_hybrid_trains_as_it_does_without_packing(zoo, method, tmp_path, caplog):
    """A hybrid (LFM2: convolution + attention layers) with the default padding_free=None: the probe finds packing
    inexact on CPU, so training is TRL's padded path exactly; padding_free=True is refused at construction."""
    path = zoo("lfm2")
    trainer_cls = getattr(trl_scale, f"{method.upper()}Trainer")
    config_cls = getattr(trl_scale, f"{method.upper()}Config")

    def run(out, **overrides):
        config = config_cls(
            **cpu_args(tmp_path / out, num_generations=4, max_completion_length=8, beta=0.05, max_steps=2, **overrides)
        )
        trainer = trainer_cls(
            model=path, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(32, seed=0)
        )
        trainer.train()
        return trainer

    with caplog.at_level(logging.WARNING, logger="trl_scale"):
        auto = run("auto")
    assert any("'lfm2'" in r.getMessage() for r in caplog.records)
    off = run("off", padding_free=False)
    keys = ("loss", "grad_norm", "kl", "reward", "entropy")
    auto_logs, off_logs = step_logs(auto, keys), step_logs(off, keys)
    assert len(auto_logs) == len(off_logs) == 2
    assert auto_logs == off_logs
    assert max_param_diff(auto.model, off.model) == 0.0
    with pytest.raises(ValueError, match="padding_free=True.*'lfm2'"):
        run("required", padding_free=True)


def test_cast_lm_head_to_fp32_is_honoured_on_the_packed_path(zoo):
    """GRPO's `cast_lm_head_to_fp32`: a bf16 model whose head runs in fp32 on upcast hidden states. One unpadded
    sequence makes the backbone's work identical on both paths, so only the head can differ."""
    path = zoo("llama")
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        model.lm_head = model.lm_head.float()  # what TRL's cast_lm_head_to_fp32 does to the head's weights
        add_fused_lm_head(model, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
        models.append(model)
    trl_model, packed_model = models
    assert install_packed_scoring(packed_model, cast_lm_head_to_fp32=True, outputs=("entropy",)) is not None
    input_ids = torch.tensor([[10, 11, 12, 30, 31, 32, 33, 34, 35, 36, 37]])
    mask = torch.ones_like(input_ids)
    labels = input_ids.masked_fill(torch.arange(11) < 3, -100)
    expected = trl_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    got = packed_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert got.log_probs.dtype == torch.float32
    assert (got.log_probs - expected.log_probs).abs().max().item() <= 1e-5
    assert (got.entropy - expected.entropy).abs().max().item() <= 1e-5


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_chunked_head_never_builds_the_full_logits(tmp_path):
    """Forward and backward of packed scoring with a vocabulary large enough that `[tokens, vocab]` logits dwarf
    every weight: no tensor of that size (nor half of it) may ever exist."""
    path = build_tiny_model(tmp_path / "wide", "llama", words=None)
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(8192)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    install_packed_scoring(model, logprob_chunk_size=16, outputs=("entropy",))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 8192, (8, 40), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[::2, :12] = 0  # left padding on half the rows
    labels = input_ids.masked_fill(mask == 0, -100)
    labels[:, :16] = -100  # prompts
    scored_tokens = int((labels[:, 1:] != -100).sum())
    with _LargestTensor() as probe:
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        _objective(out, out.label_mask).backward()
    full_logits = scored_tokens * 8192
    weight = model.lm_head.weight.numel()
    assert probe.largest <= max(weight, 16 * 8192) < full_logits / 2, (probe.largest, full_logits)


# RoPE scalings with sequences past the original context (32 positions). Dynamic NTK and longrope change their
# frequencies with the longest position of a forward; YaRN is static.
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0 + i for i in range(8)]}
ROPE_SCALINGS = {
    "llama-dynamic": (
        "llama",
        dict(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
    ),
    "qwen2-dynamic": (
        "qwen2",
        dict(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0}),
    ),
    "phi3-longrope": (
        "phi3",
        dict(max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=_LONGROPE),
    ),
    "llama-yarn": (
        "llama",
        dict(
            max_position_embeddings=128,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ),
}


def _long_and_short_batch(vocab: int, width: int, pad: int):
    """A short sequence beside one as wide as the batch (TRL's layout: left-padded prompt, right-padded
    completion), labels on completions."""
    generator = torch.Generator().manual_seed(1)
    prompt_len = 6
    lengths = [(2, 3), (prompt_len, width - prompt_len), (4, width // 2)]
    input_ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for row, (p, c) in enumerate(lengths):
        tokens = torch.randint(0, vocab, (p + c,), generator=generator)
        input_ids[row, prompt_len - p : prompt_len + c] = tokens
        mask[row, prompt_len - p : prompt_len + c] = 1
        labels[row, prompt_len : prompt_len + c] = tokens[p:]
    return input_ids, mask, labels


@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rope_scaling_with_long_sequences_packs_exactly_or_steps_aside(scaling, tmp_path, caplog):
    """Past the original context, a length-dependent RoPE gives a packed sequence other frequencies than TRL's
    padded forward: such calls take TRL's path (with one warning), shorter calls pack and equal each sequence
    alone. A static scaling (YaRN) packs at every length. Packed or not, every call equals TRL's forward ≤ 1e-5."""
    family, overrides = ROPE_SCALINGS[scaling]
    path = build_tiny_model(tmp_path / scaling, family, attn_implementation="sdpa", **overrides)
    trl_model = AutoModelForCausalLM.from_pretrained(path).eval()
    add_fused_lm_head(trl_model, outputs=("log_probs", "entropy"))
    model = copy.deepcopy(trl_model)
    config = install_packed_scoring(model, padding_free=True, outputs=("entropy",))
    assert config is not None
    length_dependent = "dynamic" in scaling or "longrope" in scaling
    pad = AutoTokenizer.from_pretrained(path).pad_token_id
    for width, packs in ((24, True), (48, not length_dependent), (96, not length_dependent)):
        input_ids, mask, labels = _long_and_short_batch(model.config.vocab_size, width, pad)
        fallbacks = config.stats.fallbacks
        with caplog.at_level(logging.WARNING, logger="trl_scale"):
            got = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        assert (config.stats.fallbacks == fallbacks) == packs, (scaling, width)
        # Ground truth where packing is exact: each sequence alone; TRL's padded forward where it steps aside.
        expected = trl_model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        for row in range(input_ids.size(0)):
            real = mask[row].bool()
            start, length = int(real.nonzero()[0]), int(real.sum())
            if packs:
                alone = trl_model(
                    input_ids=input_ids[row, real][None], labels=labels[row, real][None], fused_lm_head=True
                )
                reference = alone.log_probs[0]
            else:
                reference = expected.log_probs[row, start : start + length - 1]
            error = (got.log_probs[row, start : start + length - 1] - reference).abs().max().item()
            assert error <= 1e-5, (scaling, width, row, error)
    warnings = [r.getMessage() for r in caplog.records if "length-dependent RoPE" in r.getMessage()]
    assert len(warnings) == (1 if length_dependent else 0), warnings
