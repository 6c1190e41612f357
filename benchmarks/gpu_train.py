"""The ``train`` part of benchmarks/gpu.py: one whole training step (forward + backward + AdamW step) of a
long-tailed batch, TRL's padded path against trl-scale's packed one, on Qwen2-0.5B- and 1.5B-shaped models
(random weights, bf16, activation checkpointing as TRL's default), with a profile of where the time goes.

Variants (every one starts from the same weights; its log-probs before the first step are compared with the same
weights scored in fp32):

- ``trl_padded``: stock TRL's forward (sdpa on the padded batch), the baseline;
- ``sdpa_rows``, ``flex_rows``: trl-scale's packing as it was before this figure (rows as wide as the longest
  sequence; sdpa with a block-diagonal mask);
- ``sdpa_varlen``: trl-scale's default for an sdpa model on CUDA now: one packed row on torch's flash varlen kernel;
- ``flex_one_row``: flex attention on one packed row (its block mask skips other sequences);
- ``<best>+compile``: the faster of the two with its decoder layers compiled (``compile_decoder_layers``);
- ``<best>+compile-no_ckpt``: the same without activation checkpointing (memory for speed; largest shape only).

MFU counts useful FLOPs (gpu.model_flops: real tokens, causal attention per sequence, no recompute) over the
dense bf16 peak (989 TFLOP/s, H100 and H200 alike).
"""

from __future__ import annotations

import contextlib
import copy
import re
import time

from gpu import H100_BF16_PEAK, QWEN2_05B, Report, Sizes, measure, model_flops, qwen2_config

# Qwen2-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, tied embeddings).
QWEN2_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
)
GPU_SHAPES = {"qwen2-0.5b": QWEN2_05B, "qwen2-1.5b": QWEN2_15B}

# Kernel families in a profile, by the kernel's name.
_KERNEL_KINDS = [
    ("attention", r"flash|fmha|attention|flex|sdpa|efficient"),
    ("logprob_head", r"chunked|logprob|_log_softmax|logsumexp"),
    ("matmul", r"gemm|cutlass|nvjet|sm90|sm80|cublas|matmul|xmma"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("triton_fused", r"^triton_"),
    ("copy_index", r"copy|cat|index|gather|scatter|fill|zero"),
    ("elementwise", r"elementwise|vectorized|reduce|unrolled|pow|rsqrt|mul|add|silu|exp"),
]


@contextlib.contextmanager
def _packing_as_before():
    """trl-scale's packing as it was before the varlen / one-row layouts: rows as wide as the longest sequence,
    sdpa with its mask (for the "before" figures, in the same run)."""
    from trl_scale.scoring import engine, support

    saved = engine.install_varlen_attention, support.uses_one_row
    engine.install_varlen_attention = lambda model: False
    support.uses_one_row = support.uses_varlen_layout
    try:
        yield
    finally:
        engine.install_varlen_attention, support.uses_one_row = saved


def _variant_model(config, state, variant: str, checkpointing: bool, compiled: bool):
    """A model with the shared weights ``state``, set up as ``variant`` says."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring
    from trl_scale.scoring.compiled import compile_decoder_layers

    attention = "flex_attention" if "flex" in variant else "sdpa"
    first = next(iter(state.values()))
    with torch.device(first.device):
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), dtype=first.dtype, attn_implementation=attention
        )
    model.load_state_dict(state)
    model.train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    packed = None
    if variant != "trl_padded":
        before = variant.endswith("_rows")
        with _packing_as_before() if before else contextlib.nullcontext():
            packed = install_packed_scoring(model, outputs=("entropy",))
        if packed is None:
            raise RuntimeError(f"{variant}: packing stepped aside on this model")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        compile_decoder_layers(model)
    return model, packed


def _train_step(model, optimizer, batch):
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    valid = out.label_mask
    (-(out.log_probs * valid).sum() / valid.sum()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def varied_batches(model, optimizer, sizes: Sizes, device, count: int = 4) -> dict:
    """Steps on ``count`` other long-tailed batches (new lengths each), twice round: the first round's steps
    include whatever a new length costs (a compiled layer recompiles once for dynamic lengths), the second is the
    steady state. MFU uses each batch's own useful FLOPs."""
    from gpu import _sync
    from packing import long_tailed_batch

    batches = [
        long_tailed_batch(sizes.batch_size, sizes.max_prompt, sizes.max_completion, sizes.vocab, seed=s)
        for s in range(1, count + 1)
    ]
    config = model.config
    useful = [model_flops(config, b[1], b[2]) for b in batches]
    on_device = [tuple(x.to(device) for x in b[:3]) for b in batches]
    rounds = []
    for _ in range(2):
        times = []
        for batch in on_device:
            _sync(device)
            start = time.perf_counter()
            _train_step(model, optimizer, batch)
            _sync(device)
            times.append(time.perf_counter() - start)
        rounds.append(times)
    steady = rounds[1]
    mfu = sum(useful) / sum(steady) / H100_BF16_PEAK if device.type == "cuda" else None
    return {
        "varied_first_round_s": [round(t, 4) for t in rounds[0]],
        "varied_steady_s": [round(t, 4) for t in steady],
        "varied_steady_mfu": mfu,
        "varied_real_tokens": [int(b[1].sum()) for b in batches],
    }


def _logprobs(model, batch):
    import torch

    input_ids, mask, labels = batch
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs.float(), out.label_mask.bool()


def _kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in _KERNEL_KINDS:
        if re.search(pattern, lowered):
            return kind
    return "other"


def profile_step(step, device, label: str, out_dir: str | None) -> dict:
    """One step under torch.profiler: the top kernels by GPU time, their families, and how much of the step's wall
    time the GPU was busy (the rest is the host: Python, launches, syncs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    torch.cuda.synchronize() if device.type == "cuda" else None
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize() if device.type == "cuda" else None
    wall = time.perf_counter() - start
    events = prof.key_averages()
    rows = []
    for event in events:
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device.type != "cuda":
            device_us = event.self_cpu_time_total
        if device_us > 0 and (device.type != "cuda" or event.device_type == torch.autograd.DeviceType.CUDA):
            rows.append((event.key, device_us / 1e3, event.count))
    rows.sort(key=lambda r: -r[1])
    busy = sum(ms for _, ms, _ in rows)
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        kinds[_kernel_kind(name)] = kinds.get(_kernel_kind(name), 0.0) + ms
    if out_dir:
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(f"{out_dir}/profiles.txt", "a") as f:  # one file: a device run brings back 8 files at most
            f.write(f"\n===== {label}: one training step, {wall * 1e3:.1f} ms wall =====\n")
            f.write(events.table(sort_by=sort, row_limit=40))
    return {
        "profile_wall_ms": wall * 1e3,
        "gpu_busy_ms": busy,
        "gpu_busy_fraction": busy / (wall * 1e3) if wall else None,
        "by_kind_ms": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels": [[name[:90], round(ms, 2), count] for name, ms, count in rows[:10]],
    }


def _errors_vs_fp32(logp, valid, reference) -> dict:
    error = (logp - reference)[valid].abs()
    return {"vs_fp32_max": error.max().item(), "vs_fp32_mean": error.mean().item()}


def train_figures(report: Report, sizes: Sizes, device, dtype, shapes: dict | None = None) -> None:
    """Each shape: every variant's step time, MFU and exactness; a profile before and after; one JSON line per
    variant and one summary line per shape."""
    from packing import long_tailed_batch

    shapes = shapes or {"smoke": sizes.model}
    cpu_batch = long_tailed_batch(sizes.batch_size, sizes.max_prompt, sizes.max_completion, sizes.vocab)
    for shape_name, shape in shapes.items():
        shape_figures(report, sizes, device, dtype, shape_name, shape, cpu_batch, last=shape_name == list(shapes)[-1])


def shape_figures(report: Report, sizes: Sizes, device, dtype, shape_name: str, shape: dict, cpu_batch, last: bool):
    """One model shape: every variant on the same weights and batch, then the summary line."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring.varlen import varlen_unsupported_config

    out_dir = report.path.rsplit("/", 1)[0] if report.path else None
    batch = tuple(x.to(device) for x in cpu_batch[:3])
    real_tokens = int(cpu_batch[1].sum())
    shape_sizes = Sizes(**{**sizes.__dict__, "model": shape})
    config = qwen2_config(shape_sizes, "sdpa", dtype)
    flops = model_flops(config, cpu_batch[1], cpu_batch[2])
    torch.manual_seed(0)
    with torch.device(device):
        reference_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(dtype) for k, v in reference_model.state_dict().items()}
    add_fused_lm_head(reference_model, outputs=("log_probs",))
    reference, _ = _logprobs(reference_model, batch)
    del reference_model
    results: dict[str, dict] = {}

    def run(
        variant: str,
        compiled: bool = False,
        checkpointing: bool = True,
        profile: str | None = None,
        varied: bool = False,
    ):
        name = variant + ("+compile" if compiled else "") + ("" if checkpointing else "-no_ckpt")
        if report.seconds_left() < (150 if compiled else 45):
            report.add("train_step", shape=shape_name, variant=name, skipped="out of time")
            return None
        if "flex" in variant and device.type != "cuda":
            report.add("train_step", shape=shape_name, variant=name, skipped="flex has no CPU backward")
            return None
        row = {"shape": shape_name, "variant": name, "real_tokens": real_tokens, "padded_tokens": batch[0].numel()}
        model = optimizer = None
        torch._dynamo.reset()  # each variant compiles afresh: no recompile limit reached by the ones before it
        try:
            start = time.monotonic()
            model, packed = _variant_model(config, state, variant, checkpointing, compiled)
            logp, valid = _logprobs(model, batch)
            row.update(_errors_vs_fp32(logp, valid, reference))
            row["attention"] = model.config._attn_implementation
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")

            def step(model=model, optimizer=optimizer):
                _train_step(model, optimizer, batch)

            seconds, peak = measure(step, device, sizes.repeats)
            row.update(
                step_s=seconds,
                peak_mib=peak,
                setup_and_warmup_s=time.monotonic() - start - seconds * sizes.repeats,
                tokens_per_s=real_tokens / seconds,
                mfu=flops / seconds / H100_BF16_PEAK if device.type == "cuda" else None,
                row_fill=packed.stats.pop().get("padding_free/row_fill") if packed else None,
            )
            if profile:
                row["profile"] = profile_step(step, device, f"{shape_name}_{profile}", out_dir)
            if varied:
                row.update(varied_batches(model, optimizer, sizes, device))
        except Exception as error:  # an OOM or a kernel that fails here is a figure too
            row["error"] = f"{type(error).__name__}: {error}"[:400]
        finally:
            del model, optimizer
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results[name] = report.add("train_step", **row)
        return results[name]

    baseline = run("trl_padded", profile="trl_padded")
    run("sdpa_rows")
    run("flex_rows", profile="before")
    varlen_why_not = varlen_unsupported_config(config, device)
    if varlen_why_not is None:
        run("sdpa_varlen")
    else:
        report.add("train_step", shape=shape_name, variant="sdpa_varlen", skipped=varlen_why_not)
    run("flex_one_row")
    timed = {k: v for k, v in results.items() if "step_s" in v and k != "trl_padded"}
    if not timed:
        return
    best = min(timed, key=lambda k: timed[k]["step_s"])
    run(best, varied=True)  # as a run meets it: a new batch (new lengths) every step
    after = run(best, compiled=device.type == "cuda", profile="after", varied=True)
    final = after if after is not None and "step_s" in after else timed[best]
    if last and device.type == "cuda":
        run(best, compiled=True, checkpointing=False)
    if baseline is None or "step_s" not in baseline:
        return
    report.add(
        "train_step_summary",
        shape=shape_name,
        trl_padded_step_s=baseline["step_s"],
        trl_padded_mfu=baseline.get("mfu"),
        trl_scale_variant=final["variant"],
        trl_scale_step_s=final["step_s"],
        trl_scale_mfu=final.get("mfu"),
        speedup_vs_trl_padded=baseline["step_s"] / final["step_s"],
        trl_padded_vs_fp32_max=baseline["vs_fp32_max"],
        trl_padded_vs_fp32_mean=baseline["vs_fp32_mean"],
        trl_scale_vs_fp32_max=final["vs_fp32_max"],
        trl_scale_vs_fp32_mean=final["vs_fp32_mean"],
        exact_as_padded=final["vs_fp32_mean"] <= 1.1 * baseline["vs_fp32_mean"]
        and final["vs_fp32_max"] <= 1.5 * baseline["vs_fp32_max"],
    )
