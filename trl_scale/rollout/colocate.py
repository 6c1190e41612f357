"""TRL's default vLLM mode (`use_vllm=True`, `vllm_mode="colocate"`: vLLM inside the trainer), made to work wherever
vLLM runs, with two changes to TRL's `VLLMGeneration`:

- **Weight sync.** TRL hands each parameter to the vLLM model's `load_weights`, which needs every linear layer's
  weight as vLLM created it. Backends that repack weights into a kernel format after loading (vLLM's CPU backend
  does, and so do online-quantised layers) leave an empty parameter with no `weight_loader`, and the first sync fails
  (`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). Where the engine is in that state, the
  sync goes through vLLM's layerwise `reload_weights` (vLLM >= 0.31: each layer re-materialised, loaded in checkpoint
  format and processed again, in place); elsewhere TRL's own direct call runs, unchanged. Decided by inspecting the
  engine's layers once, not by the platform's name.
- **Engine settings.** TRL builds `vllm.LLM(...)` with no dtype, so vLLM picks one from the checkpoint's config (bf16
  where the policy trains in fp32: sampler and policy then disagree by ~1e-3 per token). The engine takes the
  policy's dtype, unless `vllm_llm_kwargs` says otherwise; `vllm_llm_kwargs` passes other `LLM` settings too
  (`hf_overrides`, `enforce_eager`, ...), except those TRL must own.
"""

from __future__ import annotations

import functools
import importlib
from contextlib import contextmanager, nullcontext

import torch
from trl.generation.vllm_generation import VLLMGeneration

from ..logs import get_logger
from .weight_names import CheckpointNamedWalk

logger = get_logger(__name__)


class ColocatedVLLMGeneration(CheckpointNamedWalk, VLLMGeneration):
    """TRL's `VLLMGeneration` with the engine's dtype and the weight sync above; everything else is TRL's."""

    def __init__(self, *args, llm_kwargs: dict | None = None, **kwargs):
        self.llm_kwargs = dict(llm_kwargs or {})
        self._loads_directly: bool | None = None  # decided at the first sync, from the engine's layers
        super().__init__(*args, **kwargs)

    def _init_vllm(self) -> None:
        if self.mode != "colocate":
            return super()._init_vllm()
        settings = dict(self.llm_kwargs)
        settings.setdefault("dtype", _dtype_name(self.model))
        module = importlib.import_module(VLLMGeneration.__module__)
        build = module.LLM
        # TRL's `LLM(...)` call, with these settings on top of TRL's (`model`, `seed`... are refused in them)
        module.LLM = lambda *args, **kwargs: build(*args, **{**kwargs, **settings})
        try:
            super()._init_vllm()
        finally:
            module.LLM = build

    phase = staticmethod(lambda name: nullcontext())  # the trainer's phase clock, where one is recorded

    def sync_weights(self) -> None:
        with self.phase("weight sync"):
            self._sync_weights()

    def _sync_weights(self) -> None:
        if self.mode != "colocate" or self._direct_load():
            return super().sync_weights()
        if self.enable_sleep_mode:  # as TRL: the weights' memory mapped again before they are written
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        worker = self.llm.llm_engine.model_executor.driver_worker
        worker.reload_weights(weights_iterator=self._iter_named_params(), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    def _direct_load(self) -> bool:
        """Whether TRL's per-parameter `load_weights` can write into this engine (decided once, at the first sync)."""
        if self._loads_directly is None:
            worker = self.llm.llm_engine.model_executor.driver_worker
            self._loads_directly = not repacks_weights(worker.model_runner.model)
            if not self._loads_directly and not hasattr(worker, "reload_weights"):
                raise RuntimeError(
                    "this vLLM engine repacks its weights after loading, so TRL's direct load_weights cannot update "
                    "them, and it has no layerwise reload_weights (vLLM >= 0.31). Fix: upgrade vLLM, or use "
                    "vllm_mode='server' with weight_sync='shared_dir'"
                )
            if not self._loads_directly:
                logger.info("colocated vLLM repacks its weights: weight syncs use its layerwise reload_weights")
        return self._loads_directly


def repacks_weights(model) -> bool:
    """Whether some linear layer of a loaded vLLM model no longer holds its weight as vLLM created it (with a
    `weight_loader`): its weights were processed into a kernel format after loading."""
    from vllm.model_executor.layers.linear import LinearBase

    weights = [getattr(m, "weight", None) for m in model.modules() if isinstance(m, LinearBase)]
    return not all(hasattr(w, "weight_loader") for w in weights if isinstance(w, torch.Tensor))


def _dtype_name(model) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return str(base.dtype).removeprefix("torch.")


@contextmanager
def colocated_generation(trainer_module: str, llm_kwargs: dict | None):
    """While TRL's constructor runs, its trainer module builds `ColocatedVLLMGeneration` where it builds
    `VLLMGeneration` (the only name swapped; restored afterwards, also on error)."""
    module = importlib.import_module(trainer_module)
    original = module.VLLMGeneration
    module.VLLMGeneration = functools.partial(ColocatedVLLMGeneration, llm_kwargs=llm_kwargs)
    try:
        yield
    finally:
        module.VLLMGeneration = original
