"""benchmarks/gpu.py --smoke: the GPU figures' script runs on CPU with tiny shapes, so it cannot rot between the
sessions that are lent a GPU. Every part gives its figures, and the checks it reports hold: trl-scale's head equals
TRL's, packed scoring equals TRL's padded path (fp32 ≤ 1e-5; bf16 no further from fp32 than the padded path)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-smoke")
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--smoke", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out / "gpu.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert (out / "gpu.md").read_text().startswith("| figure |")
    return rows


def test_every_part_reports_its_figures(smoke_rows):
    figures = [r["figure"] for r in smoke_rows]
    assert figures.count("head") == 4
    assert {"scoring_small_fp32", "scoring", "e2e", "train_step", "train_step_summary"} <= set(figures)
    assert len({r["run"] for r in smoke_rows}) == 1 and smoke_rows[0]["run"]
    assert not [r for r in smoke_rows if "error" in r or "skipped" in r and r.get("attention") == "sdpa"]
    e2e = {r["trainer"]: r for r in smoke_rows if r["figure"] == "e2e"}
    assert set(e2e) == {"grpo", "ppo"}
    for row in e2e.values():
        assert row["baseline_step_s"] > 0 and row["trl_scale_step_s"] > 0
        assert row["pad_fraction_removed"] > 0  # trl-scale packed its scoring calls


def test_head_variants_agree_with_trls_kernel(smoke_rows):
    heads = {r["variant"]: r for r in smoke_rows if r["figure"] == "head"}
    assert set(heads) == {"trl_fused", "full_logits", "trl_scale", "trl_scale_torch_head"}
    for row in heads.values():
        assert row["max_abs_logp_diff_vs_trl_fused"] <= 5e-2  # bf16 inputs; fp32 accumulation in every head
    assert heads["trl_scale"]["uses_trl_kernel"] is False  # CPU: our head; on CUDA the same call is TRL's kernel


def test_packed_scoring_is_exact_in_fp32_and_no_worse_than_padded_in_bf16(smoke_rows):
    small = next(r for r in smoke_rows if r["figure"] == "scoring_small_fp32")
    assert small["packed"] and small["within_tolerance"] and small["max_abs_logp_diff"] <= 1e-5
    bf16 = next(r for r in smoke_rows if r["figure"] == "scoring" and r["attention"] == "sdpa")
    assert bf16["packed"] and bf16["dtype"] == "bfloat16" and bf16["within_tolerance"]
    assert bf16["trl_scale_packed_vs_fp32_mean"] <= 1.1 * bf16["trl_padded_vs_fp32_mean"]


def test_training_step_figure_compares_packed_with_trls_padded_step(smoke_rows):
    steps = {r["variant"]: r for r in smoke_rows if r["figure"] == "train_step" and "step_s" in r}
    assert {"trl_padded", "sdpa_rows"} <= set(steps)
    assert steps["sdpa_rows"]["row_fill"] < 1.0 and "profile" in steps["trl_padded"]
    assert steps["trl_padded"]["profile"]["top_kernels"]
    summary = next(r for r in smoke_rows if r["figure"] == "train_step_summary")
    assert summary["exact_as_padded"] and summary["speedup_vs_trl_padded"] > 0


def test_a_parts_typo_is_refused_before_any_part_runs(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--smoke", "--parts", "head,scorng"]
    run = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    assert "--parts 'head,scorng': unknown ['scorng']; choose from head, scoring, e2e, train" in run.stderr
    assert not (tmp_path / "gpu.jsonl").exists()  # nothing ran, nothing half-written
