"""Regional compilation: ``torch.compile`` on each decoder layer, not on the model.

TRL's scoring forward (and trl-scale's packing around it) is Python with data-dependent shapes; compiling the whole
model would break its graph at every step of that. The decoder layers are where the time goes and are all the same
code: compiled one by one they share one graph (torch inlines ``nn.Module`` calls, so parameters are inputs, not
constants), which fuses the norms, rotary embeddings, activations and residual adds around the matrix products.
Activation checkpointing re-runs the compiled layer in backward.
"""

from __future__ import annotations

import torch


def decoder_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module that holds and runs the model's decoder layers (``model.model`` in transformers' causal LMs;
    through PEFT wrappers)."""
    backbone = model
    for _ in range(4):  # PeftModel -> LoraModel -> CausalLM -> backbone
        layers = getattr(backbone, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return backbone
        backbone = getattr(backbone, "base_model", None) or getattr(backbone, "model", None)
        if backbone is None:
            break
    raise ValueError(f"{type(model).__name__} has no decoder layers this can find (model.layers)")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` in transformers' causal LMs; through PEFT wrappers)."""
    return decoder_backbone(model).layers


# `compile_decoder_layers=None` compiles where the compile is repaid well within the run. Measured on an H200
# (benchmarks/results/gpu_h200_train_run3.jsonl, 23k packed tokens a step, the checkpointed layers planned by memory):
# compiling cost 14.1 s at the 0.5B shape and 13.2 s at 1.5B (the first steps' 8-9 s, and 5.3 s once more at the
# first new length: dynamic shapes from then on) and saved 0.065 s and 0.130 s a step: 218 and 101 steps to break
# even. The rule asks over twice the slower, and a model large enough that its layers' work, not the host, is what
# a step spends.
COMPILE_MIN_STEPS = 500
COMPILE_MIN_PARAMETERS = 100_000_000


def why_not_compile(model: torch.nn.Module, planned_steps: int, device: torch.device | None = None) -> str | None:
    """Why `compile_decoder_layers=None` leaves `model`'s layers uncompiled for a run of `planned_steps` optimizer
    steps on `device` (its parameters' by default); None where compiling pays."""
    parameter = next(model.parameters(), None)
    device = device or (parameter.device if parameter is not None else None)
    if device is None or device.type != "cuda":
        return "the model is not on a CUDA device (compiling pays back on GPUs)"
    try:
        decoder_layers(model)
    except ValueError as error:
        return str(error)
    parameters = sum(p.numel() for p in model.parameters())
    if parameters < COMPILE_MIN_PARAMETERS:
        return f"{parameters / 1e6:.0f}M parameters: below {COMPILE_MIN_PARAMETERS // 10**6}M a step is the host's"
    if planned_steps < COMPILE_MIN_STEPS:
        return f"{planned_steps} steps planned: the compile pays back over about {COMPILE_MIN_STEPS}"
    return None


def compile_decoder_layers(model: torch.nn.Module, dynamic: bool | None = None) -> int:
    """Compile every decoder layer of ``model`` in place for the forwards that score (no KV cache); returns how
    many. A call with a cache (``generate`` on the trainer's own model) runs the layer as it was: decoding changes
    shapes every token, which would recompile past torch's limit. ``dynamic=None`` lets torch compile the first
    shape statically and the second with dynamic lengths (packed batches change length every step)."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_trl_scale_compiled", False):
            continue
        compiled = torch.compile(layer._call_impl, dynamic=dynamic)  # what nn.Module.compile does

        def call(*args, _layer=layer, _compiled=compiled, **kwargs):
            if kwargs.get("past_key_values") is not None:
                return _layer._call_impl(*args, **kwargs)
            return _compiled(*args, **kwargs)

        layer._compiled_call_impl = call  # nn.Module.__call__ runs it in place of _call_impl
        layer._trl_scale_compiled = True
    return len(layers)
