"""trl-scale's vLLM plugin: a CPU (gloo) weight-transfer engine registered as backend `trl_scale_gloo`, and a mend of
vLLM 0.32's CPU build, whose weight updates left a mixture-of-experts model's experts unpacked (`moe_reload.py`).

vLLM looks weight-transfer engines up by name (`WeightTransferEngineFactory`) and runs every `vllm.general_plugins`
entry point in each of its processes at start-up (vLLM 0.32 `plugins/__init__.py`), so installing this package
into vLLM's environment is all it takes:

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model M \
        --weight-transfer-config '{"backend":"trl_scale_gloo"}'

`gloo.py` is plain torch (no vLLM): the same group and receive code runs in `trl-scale serve` and in the trainer.
"""

from .gloo import BACKEND

__all__ = ["BACKEND", "register"]


def register() -> None:
    """vLLM's general-plugin hook. It may run several times per process (vLLM's own warning), so registering is
    idempotent; the engine's module is imported only when a server is configured with this backend."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from .moe_reload import mend_cpu_moe_reload

    mend_cpu_moe_reload()

    if BACKEND not in WeightTransferEngineFactory._registry:
        engine_module = "trl_scale_vllm_plugin.engine"
        WeightTransferEngineFactory.register_engine(BACKEND, engine_module, "GlooWeightTransferEngine")
