"""Regional compilation: ``torch.compile`` on each decoder layer, not on the model.

TRL's scoring forward (and trl-scale's packing around it) is Python with data-dependent shapes; compiling the whole
model would break its graph at every step of that. The decoder layers are where the time goes and are all the same
code: compiled one by one they share one graph (torch inlines ``nn.Module`` calls, so parameters are inputs, not
constants), which fuses the norms, rotary embeddings, activations and residual adds around the matrix products.
Activation checkpointing re-runs the compiled layer in backward.
"""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder layers (``model.model.layers`` in transformers' causal LMs; through PEFT wrappers)."""
    backbone = model
    for _ in range(4):  # PeftModel -> LoraModel -> CausalLM -> backbone
        layers = getattr(backbone, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return layers
        backbone = getattr(backbone, "base_model", None) or getattr(backbone, "model", None)
        if backbone is None:
            break
    raise ValueError(f"{type(model).__name__} has no decoder layers this can find (model.layers)")


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
