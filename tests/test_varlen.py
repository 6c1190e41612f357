"""Packed scoring on the varlen attention (``trl_scale.scoring.varlen``): the wiring, on CPU.

On CUDA an sdpa model is switched to torch's flash varlen kernel (tested on a GPU in ``test_gpu.py`` and measured
by ``benchmarks/gpu.py --parts train``). Here the same switch is made by hand, and the packed calls run the
per-sequence sdpa path the kernel's inputs take where it does not run (fp32). What is checked is what the kernel
relies on: packed calls arrive as one row with their boundaries, the model builds no mask for them, gradients
under activation checkpointing (layers re-run in backward, outside the engine) still see the boundaries, and
every other call is sdpa's to the bit."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import install_packed_scoring, packing_support
from trl_scale.scoring import varlen as varlen_module
from trl_scale.scoring.varlen import VARLEN_SDPA, varlen_unsupported

from .helpers import padded_scoring_batch


def _switched(path: str):
    """The model at ``path`` on sdpa, switched to the varlen attention as `install_varlen_attention` does on CUDA."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    varlen_module._register()
    model.set_attn_implementation(VARLEN_SDPA)
    return model


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_varlen_scoring_equals_trls_padded_path(family, checkpointing, request, monkeypatch):
    path = request.getfixturevalue(family)
    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids, mask, labels = padded_scoring_batch(tokenizer)
    padded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    packed = _switched(path)
    kernel_calls = []
    segment_attention = varlen_module._segment_attention

    def counting(query, key, value, cu_seq_lens, scale):
        kernel_calls.append(cu_seq_lens.tolist())
        return segment_attention(query, key, value, cu_seq_lens, scale)

    monkeypatch.setattr(varlen_module, "_segment_attention", counting)
    masks_built = []
    sdpa_mask = varlen_module.varlen_sdpa_mask

    def recording_mask(*args, **kwargs):
        mask = sdpa_mask(*args, **kwargs)
        masks_built.append(mask)
        return mask

    from transformers.masking_utils import AttentionMaskInterface

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, VARLEN_SDPA, recording_mask)
    for model in (padded, packed):
        model.train()
        add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    install_packed_scoring(packed, temperature=0.9, outputs=("entropy",), tree_packing=False)  # rows: this test's
    support = packing_support(packed.base_model)
    assert support.varlen and support.one_row and support.exact
    kernel_calls.clear(), masks_built.clear()  # (the probe's)

    outputs = []
    for model in (padded, packed):
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        valid = out.label_mask
        (-(out.log_probs * valid).sum() / valid.sum()).backward()
        outputs.append(out)
    expected, got = outputs
    valid = expected.label_mask.bool()
    assert (got.log_probs - expected.log_probs)[valid].abs().max().item() <= 1e-5
    assert (got.entropy - expected.entropy)[valid].abs().max().item() <= 1e-5
    for (name, a), b in zip(padded.named_parameters(), packed.parameters()):
        assert (a.grad - b.grad).abs().max().item() <= 1e-5 * max(1.0, a.grad.abs().max().item()), name
    # one packed row, four sequences, every layer (and again in backward under checkpointing), and no mask built
    layers = packed.config.num_hidden_layers
    lengths = mask.sum(1).tolist()
    bounds = [0] + torch.tensor(sorted(lengths, reverse=False)).cumsum(0).tolist()
    assert len(kernel_calls) == layers * (2 if checkpointing else 1)
    assert all(call[-1] == sum(lengths) and len(call) == len(bounds) for call in kernel_calls)
    assert masks_built == [None]


def test_calls_without_boundaries_are_sdpa_to_the_bit(tiny_llama):
    """Generation and TRL's padded forwards on a switched model: sdpa's mask, sdpa's kernel, the same numbers."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    input_ids, mask, _ = padded_scoring_batch(tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa").eval()
    switched = _switched(tiny_llama).eval()
    with torch.no_grad():
        assert torch.equal(
            plain(input_ids, attention_mask=mask).logits, switched(input_ids, attention_mask=mask).logits
        )
        generated = [
            m.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False) for m in (plain, switched)
        ]
    assert torch.equal(*generated)


def test_only_sdpa_models_on_cuda_are_switched(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa")
    assert varlen_unsupported(model) == "not on a CUDA device"
    assert not varlen_module.install_varlen_attention(model)
    assert model.config._attn_implementation == "sdpa"
    eager = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager")
    assert "only sdpa" in varlen_unsupported(eager)
