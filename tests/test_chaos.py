"""The chaos run (benchmarks/chaos.py): streaming GRPO over a fleet of `trl-scale serve` servers while servers are
killed, stopped past the request timeout, made to answer 500 or slowly, and the trainer is killed and resumed from
its checkpoint; every prompt group is trained once, no token is older than the bound, the resumed run's first
generation is of the checkpoint's weights, and no process is left.

The short version (3 servers, 100 steps, one fault of each kind) runs in CI; the full one (6 servers, 300 steps, 12
faults, and the fault-free run beside it for the step-time cost) is marked `chaos`: bash scripts/test.sh -m chaos.
Also here: the schedule and the fault proxy, on their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from .helpers import plain_http_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from chaos_faults import KINDS, SERVER_FAULTS, FaultProxy, schedule  # noqa: E402

pytest.importorskip("fastapi")


def chaos(out, *flags, timeout: int = 900) -> dict:
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "chaos.py"), "--out", str(out), *flags]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    row = json.loads(lines[-1])
    assert run.returncode == (0 if row["invariants_held"] else 1)
    return row


def assert_survived(row: dict, faults: int) -> None:
    assert row["invariants_held"], json.dumps(row["invariants"], indent=1)
    assert row["faults_total"] == faults and set(row["faults_injected"]) == set(KINDS), row["faults_injected"]
    assert row["faults_survived"] == faults, row["faults"]
    assert row["steps_lost"] >= 1  # the kill came after a checkpoint: steps were trained again, as documented
    assert row["server_deaths"] >= row["faults_injected"]["kill"]  # the fleet saw every kill ...
    assert row["server_restarts"] == row["server_deaths"]  # ... and brought each server back


def test_the_short_chaos_run_survives_one_fault_of_each_kind(tmp_path):
    row = chaos(tmp_path, "--short", "--no-baseline")
    assert_survived(row, faults=5)
    print(json.dumps(row))


@pytest.mark.chaos
def test_the_chaos_run(tmp_path):
    """The full run, with its figures (the README's table)."""
    row = chaos(tmp_path, timeout=3000)
    assert_survived(row, faults=12)
    assert row["servers"] == 6 and row["steps"] == 300 and "step_time_cost" in row
    print(json.dumps({k: v for k, v in row.items() if k not in ("faults", "invariants")}))


def test_the_schedule_is_seeded_and_spreads_the_faults():
    faults = schedule(3, 100, 6, 12, 20, stop_seconds=7, spell_seconds=6)
    assert faults == schedule(3, 100, 6, 12, 20, stop_seconds=7, spell_seconds=6)  # the seed decides
    assert faults != schedule(4, 100, 6, 12, 20, stop_seconds=7, spell_seconds=6)
    kinds = [f.kind for f in faults]
    assert len(faults) == 12 and set(kinds) == set(KINDS) and kinds.count("trainer_kill") == 1
    killed = next(f for f in faults if f.kind == "trainer_kill")
    assert 50 <= killed.step < 75 and killed.step % 20 not in (0, 1)  # after a checkpoint, steps to lose
    assert max(f.step for f in faults) < 75  # the last quarter: the trainer uses the servers again
    assert not [f for f in faults if f.kind != "trainer_kill" and killed.step - 3 <= f.step < killed.step + 3]
    by_server: dict[int, list[int]] = {}
    for fault in faults:
        if fault.kind in SERVER_FAULTS:
            by_server.setdefault(fault.server, []).append(fault.step)
    assert all(b - a >= 8 for steps in by_server.values() for a, b in zip(steps, steps[1:]))
    assert next(f for f in faults if f.kind == "stop").seconds == 7
    with pytest.raises(ValueError, match="--faults must be at least 5"):
        schedule(0, 100, 6, 4, 20, 7, 6)


def test_the_proxy_forwards_answers_500_slows_and_drops_as_a_dead_server():
    with plain_http_server(200, b'{"choices": []}') as upstream:
        proxy = FaultProxy(upstream)
        try:
            assert requests.post(f"{proxy.url}/v1/completions", json={}, timeout=10).json() == {"choices": []}
            proxy.error_until = time.time() + 60
            assert requests.get(f"{proxy.url}/health", timeout=10).status_code == 500
            proxy.error_until, proxy.slow_until, proxy.slow_seconds = 0.0, time.time() + 60, 0.5
            began = time.monotonic()
            requests.post(f"{proxy.url}/v1/completions", json={}, timeout=10)
            assert time.monotonic() - began >= 0.5
            proxy.slow_until = 0.0
            answered = time.time()
            requests.post(f"{proxy.url}/v1/completions", json={}, timeout=10)
            assert proxy.first_answer_after(answered) is not None
        finally:
            proxy.close()
    dead = FaultProxy(upstream)  # nothing listens there any more
    try:
        with pytest.raises(requests.ConnectionError):
            requests.post(f"{dead.url}/v1/completions", json={}, timeout=10)
        assert dead.first_answer_after(0.0) is None
    finally:
        dead.close()


def test_the_readme_table_is_the_recorded_run():
    """The docs' chaos table row (docs/managed-servers.md) is benchmarks/results/chaos_cpu.jsonl (the full run), as
    printed."""
    with open(os.path.join(ROOT, "benchmarks", "results", "chaos_cpu.jsonl")) as f:
        row = json.loads(f.readline())
    with open(os.path.join(ROOT, "docs", "managed-servers.md")) as f:
        readme = f.read()
    kinds = row["faults_injected"]
    recovery, rotation = row["recovery_s"], row["back_in_rotation_s"]
    expected = (
        f"| {row['faults_total']}: {kinds['kill']} kill, {kinds['stop']} stop, {kinds['error']} error, "
        f"{kinds['slow']} slow, {kinds['trainer_kill']} trainer kill | {row['faults_survived']} | "
        f"{'all held' if row['invariants_held'] else 'FAILED'} | {row['steps_lost']} (trainer kill) | "
        f"{recovery['mean']:.1f} s / {recovery['worst']:.1f} s | "
        f"{rotation['mean']:.1f} s / {rotation['worst']:.1f} s | {row['trainer_resume_s']:.1f} s | "
        f"+{100 * row['step_time_cost']:.1f} % (wall +{100 * row['wall_time_cost']:.1f} %) |"
    )
    assert expected in readme, expected
    assert row["servers"] == 6 and row["steps"] == 300 and row["faults_survived"] == row["faults_total"]
