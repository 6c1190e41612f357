"""A mend of vLLM 0.32's CPU build: a mixture-of-experts model's experts after a weight update.

On CPU, vLLM prepacks each MoE layer's expert weights into its grouped-GEMM layout when the layer's kernel is built
(`CPUExperts.process_weights_after_loading`, `cpu_prepack_moe_weight`), and `UnquantizedFusedMoEMethod._setup_kernel`
builds the kernel only on the first load. A weight update (`/collective_rpc reload_weights`, a weight-transfer
engine's layerwise reload) copies the new checkpoint-layout weights into the kernel's storage and never prepacks
them, so the kernel reads unpacked weights as packed: measured on a tiny Qwen3-MoE, reloading the very checkpoint
the server started from moved its prompt log-probs by 0.014. The mend runs the experts' own prepack again after
such an update (CPU experts only); the layerwise reload then copies the packed weights into the kernel's storage, as
it does for every processed tensor. GPU kernels are left alone.
"""

from __future__ import annotations

MENDED = "_trl_scale_mended"


def mend_cpu_moe_reload() -> bool:
    """Patch `UnquantizedFusedMoEMethod._setup_kernel` once per process; False where this vLLM has no such method."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:
        return False
    setup = getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)
    if setup is None:
        return False
    if getattr(setup, MENDED, False):
        return True

    def _setup_kernel(self, layer, w13, w2):
        updating = getattr(self, "moe_kernel", None) is not None  # vLLM's own test for a weight update
        setup(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None) if updating else None
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(layer)

    setattr(_setup_kernel, MENDED, True)
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    return True
