"""The ``train`` part of benchmarks/gpu.py: one whole training step (forward + backward + AdamW step) of a
long-tailed batch, TRL's padded path against trl-scale's packed one, on Qwen2-0.5B- and 1.5B-shaped models
(random weights, bf16, activation checkpointing as TRL's default), with a profile of where the time goes.

Variants (every one starts from the same weights; its log-probs before the first step are compared with the same
weights scored in fp32):

- ``trl_padded``: stock TRL's forward (sdpa on the padded batch), the baseline;
- ``sdpa_varlen`` (``sdpa_rows`` off CUDA): trl-scale's packed step before its defaults changed: one packed row on
  torch's flash varlen kernel, every layer checkpointed (TRL's ``gradient_checkpointing=True``), plain layers;
- ``<that>+auto_ckpt``: the same with the checkpointed layers planned by memory (``gradient_checkpointing_layers=
  "auto"``), plain layers: what the compile saves is the difference to the next;
- ``default``: trl-scale's defaults as its trainers apply them (``DecoderLayers``): the plan by memory, and the
  layers compiled where ``why_not_compile`` finds it pays for a run of ``PLANNED_STEPS``;
- with ``every_layout``: ``sdpa_rows``, ``flex_rows`` (packing before the GPU layouts) and ``flex_one_row``.

A ``compile_break_even`` line gives the compile's cost (the first step's extra time and a new length's) over its
saving per step.

MFU counts useful FLOPs (gpu.model_flops: real tokens, causal attention per sequence, no recompute) over the
dense bf16 peak (989 TFLOP/s, H100 and H200 alike).
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from dataclasses import dataclass

from gpu_common import H100_BF16_PEAK, QWEN2_05B, Report, Sizes, measure, model_flops, qwen2_config, timed

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


@dataclass(frozen=True)
class Variant:
    """One way of running the step: the attention layout (``trl_padded``, ``sdpa_rows``, ``flex_rows``,
    ``sdpa_varlen``, ``flex_one_row``), which layers activation checkpointing recomputes (``"all"`` as TRL,
    ``"auto"`` trl-scale's plan by memory, ``"none"``), and compiled layers (``None``: trl-scale's rule,
    ``why_not_compile``, for a run of ``PLANNED_STEPS``)."""

    layout: str
    checkpointing: str = "all"
    compiled: bool | None = False

    @property
    def name(self) -> str:
        if self.compiled is None and self.checkpointing == "auto":
            return "default"
        extras = {"all": "", "auto": "+auto_ckpt", "none": "-no_ckpt"}[self.checkpointing]
        return self.layout + ("+compile" if self.compiled else "") + extras


# The run the default's compile rule is asked about (a GRPO run is hundreds of steps).
PLANNED_STEPS = 1000


def _variant_model(config, state, variant: Variant):
    """A model with the shared weights ``state``, set up as ``variant`` says; with the planner (or None) and
    whether its layers were compiled."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import install_packed_scoring
    from trl_scale.scoring.checkpointing import SelectiveCheckpointing, device_memory
    from trl_scale.scoring.compiled import compile_decoder_layers, why_not_compile

    attention = "flex_attention" if "flex" in variant.layout else "sdpa"
    first = next(iter(state.values()))
    with torch.device(first.device):
        model = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), dtype=first.dtype, attn_implementation=attention
        )
    model.load_state_dict(state)
    model.train()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    packed = None
    if variant.layout != "trl_padded":
        before = variant.layout.endswith("_rows")
        with _packing_as_before() if before else contextlib.nullcontext():
            packed = install_packed_scoring(model, outputs=("entropy",))
        if packed is None:
            raise RuntimeError(f"{variant.name}: packing stepped aside on this model")
    planner = None
    if variant.checkpointing != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    memory = device_memory(first.device)
    if variant.checkpointing == "auto" and memory is not None:  # as trl-scale's trainers plan it (DecoderLayers)
        planner = SelectiveCheckpointing(model, memory)
    compiled = variant.compiled
    if compiled is None:
        compiled = why_not_compile(model, PLANNED_STEPS) is None
    if compiled:
        compile_decoder_layers(model)
    return model, packed, planner, compiled


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
        rounds.append([timed(lambda b=batch: _train_step(model, optimizer, b), device) for batch in on_device])
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


def train_figures(
    report: Report, sizes: Sizes, device, dtype, shapes: dict | None = None, every_layout: bool = False
) -> None:
    """Each shape: every variant's step time, MFU and exactness; a profile before and after; one JSON line per
    variant and one summary line per shape. ``every_layout`` adds the layouts measured before (rows, flex)."""
    from packing import long_tailed_batch

    shapes = shapes or {"smoke": sizes.model}
    cpu_batch = long_tailed_batch(sizes.batch_size, sizes.max_prompt, sizes.max_completion, sizes.vocab)
    for shape_name, shape in shapes.items():
        shape_figures(report, sizes, device, dtype, shape_name, shape, cpu_batch, every_layout)


def _first_steps(step, device, count: int = 2) -> list[float]:
    """The first steps' times: a compiled variant compiles in the first (and, with the checkpointed layers planned,
    once more in the second, the first with no layer checkpointed: the flag is part of the compiled graph's
    guards); the planner measures in the first."""
    return [timed(step, device) for _ in range(count)]


def shape_figures(
    report: Report, sizes: Sizes, device, dtype, shape_name: str, shape: dict, cpu_batch, every_layout: bool
):
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
    cuda = device.type == "cuda"

    def run(variant: Variant, profile: str | None = None, varied: bool = False):
        name = variant.name
        if report.seconds_left() < (150 if variant.compiled is not False else 45):
            report.add("train_step", shape=shape_name, variant=name, skipped="out of time")
            return None
        if "flex" in variant.layout and not cuda:
            report.add("train_step", shape=shape_name, variant=name, skipped="flex has no CPU backward")
            return None
        row = {"shape": shape_name, "variant": name, "real_tokens": real_tokens, "padded_tokens": batch[0].numel()}
        model = optimizer = planner = None
        torch._dynamo.reset()  # each variant compiles afresh: no recompile limit reached by the ones before it
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            start = time.monotonic()
            model, packed, planner, compiled = _variant_model(config, state, variant)
            logp, valid = _logprobs(model, batch)
            row.update(_errors_vs_fp32(logp, valid, reference))
            row["attention"] = model.config._attn_implementation
            row["compiled"] = compiled
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)

            def step(model=model, optimizer=optimizer):
                _train_step(model, optimizer, batch)

            first = _first_steps(step, device)
            seconds, peak = measure(step, device, sizes.repeats)
            row.update(
                step_s=seconds,
                first_steps_s=first,
                peak_mib=peak,
                peak_total_mib=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                device_mib=torch.cuda.get_device_properties(device).total_memory / 2**20 if cuda else None,
                setup_and_warmup_s=time.monotonic() - start - seconds * sizes.repeats,
                tokens_per_s=real_tokens / seconds,
                mfu=flops / seconds / H100_BF16_PEAK if cuda else None,
                row_fill=packed.stats.pop().get("padding_free/row_fill") if packed else None,
            )
            if planner is not None:
                row.update(
                    checkpointed_layers=planner.last_checkpointed,
                    layers=len(planner.layers),
                    activation_kib_per_token_layer=(planner.activation_bytes or 0) / 1024,
                )
            if profile:
                row["profile"] = profile_step(step, device, f"{shape_name}_{profile}", out_dir)
            if varied:
                row.update(varied_batches(model, optimizer, sizes, device))
        except Exception as error:  # an OOM or a kernel that fails here is a figure too
            row["error"] = f"{type(error).__name__}: {error}"[:400]
        finally:
            if planner is not None:
                planner.remove()
            del model, optimizer, planner
            if cuda:
                torch.cuda.empty_cache()
        results[name] = report.add("train_step", **row)
        return results[name]

    baseline = run(Variant("trl_padded"), profile="trl_padded")
    varlen_why_not = varlen_unsupported_config(config, device)
    today = "sdpa_varlen" if varlen_why_not is None else "sdpa_rows"  # trl-scale's packed layout before this figure
    if every_layout:
        for layout in ("sdpa_rows", "flex_rows", "sdpa_varlen", "flex_one_row"):
            if layout != today:
                run(Variant(layout))
    before = run(Variant(today), profile="before")
    planned = run(Variant(today, checkpointing="auto"), varied=True)
    after = run(Variant(today, checkpointing="auto", compiled=None), profile="after", varied=True)
    compile_figures(report, shape_name, planned, after)
    final = after if after is not None and "step_s" in after else before
    if baseline is None or "step_s" not in baseline or final is None or "step_s" not in final:
        return
    report.add(
        "train_step_summary",
        shape=shape_name,
        trl_padded_step_s=baseline["step_s"],
        trl_padded_mfu=baseline.get("mfu"),
        trl_scale_variant=final["variant"],
        trl_scale_step_s=final["step_s"],
        trl_scale_mfu=final.get("mfu"),
        before_step_s=before["step_s"] if before and "step_s" in before else None,
        before_mfu=before.get("mfu") if before else None,
        speedup_vs_trl_padded=baseline["step_s"] / final["step_s"],
        trl_padded_vs_fp32_max=baseline["vs_fp32_max"],
        trl_padded_vs_fp32_mean=baseline["vs_fp32_mean"],
        trl_scale_vs_fp32_max=final["vs_fp32_max"],
        trl_scale_vs_fp32_mean=final["vs_fp32_mean"],
        exact_as_padded=final["vs_fp32_mean"] <= 1.1 * baseline["vs_fp32_mean"]
        and final["vs_fp32_max"] <= 1.5 * baseline["vs_fp32_max"],
    )


def compile_figures(report: Report, shape_name: str, plain: dict | None, compiled: dict | None) -> None:
    """What compiling the layers cost and saved: the first steps' extra time (and new lengths', from the varied
    batches' first round), each beyond the plain variant's own, over the steady saving per step: the steps to break
    even. Both rows plan their checkpointed layers the same way; only the compile differs."""
    rows = (plain, compiled)
    if any(r is None or "step_s" not in r for r in rows) or not compiled.get("compiled"):
        return

    def extra(row, firsts: str, steady) -> float:
        return sum(a - b for a, b in zip(row[firsts], steady if isinstance(steady, list) else [steady] * 9))

    extra_first = extra(compiled, "first_steps_s", compiled["step_s"]) - extra(plain, "first_steps_s", plain["step_s"])
    new_lengths = extra(compiled, "varied_first_round_s", compiled["varied_steady_s"]) - extra(
        plain, "varied_first_round_s", plain["varied_steady_s"]
    )
    saving = plain["step_s"] - compiled["step_s"]
    cost = extra_first + max(0.0, new_lengths)
    report.add(
        "compile_break_even",
        shape=shape_name,
        compile_s=cost,
        first_step_extra_s=extra_first,
        new_lengths_extra_s=new_lengths,
        saving_per_step_s=saving,
        break_even_steps=cost / saving if saving > 0 else None,
        rule_min_steps=_rule_min_steps(),
    )


def _rule_min_steps() -> int:
    from trl_scale.scoring.compiled import COMPILE_MIN_STEPS

    return COMPILE_MIN_STEPS
