"""Tokens and samples per second between logs, and MFU where the device's peak FLOP/s is known."""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

# Dense bf16 peak FLOP/s by device-name fragment (vendor datasheets; sparsity excluded).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def device_peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((flops for fragment, flops in PEAK_FLOPS.items() if fragment in name), None)


class ThroughputCallback(TrainerCallback):
    """Logs `throughput/tokens_per_s`, `throughput/samples_per_s` and, with a known peak, `throughput/mfu`
    (6 x parameters x tokens/s / peak, the usual dense-transformer training estimate)."""

    def __init__(self, peak_flops: float | None = None):
        self.peak_flops = peak_flops
        self._last_time: float | None = None
        self._last_tokens = 0.0
        self._last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_time = time.perf_counter()
        self._last_step = state.global_step
        self._last_tokens = float(state.num_input_tokens_seen or 0)

    def trl_scale_metrics(self, trainer, logs) -> dict[str, float]:
        now = time.perf_counter()
        if self._last_time is None:
            self._last_time = now
            return {}
        elapsed = max(now - self._last_time, 1e-9)
        tokens = float(logs.get("num_tokens", trainer.state.num_input_tokens_seen or 0))
        steps = trainer.state.global_step - self._last_step
        args = trainer.args
        samples = steps * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
        metrics = {"throughput/samples_per_s": samples / elapsed}
        if tokens > self._last_tokens:
            tokens_per_s = (tokens - self._last_tokens) / elapsed
            metrics["throughput/tokens_per_s"] = tokens_per_s
            peak = self.peak_flops or device_peak_flops()
            if peak:
                n_params = sum(p.numel() for p in trainer.model.parameters())
                metrics["throughput/mfu"] = 6 * n_params * tokens_per_s / (peak * args.world_size)
        self._last_time, self._last_tokens, self._last_step = now, tokens, trainer.state.global_step
        return metrics
