"""Sandboxed verification throughput: solutions verified per second by `CodeExecutionReward` with its pool (one run
per CPU at once) against one run at a time, on the same solutions, in one process.

The solutions: a quarter correct, a quarter wrong, a quarter correct but slow (about 0.1 s of CPU each, as a real
solution doing work), a quarter stdin/stdout programs with two tests each (two sandboxed runs). Every run is a real
bubblewrap sandbox under the default limits.

Usage: python benchmarks/rewards.py [--solutions N] [--repeats R]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CALLS = [{"call": f"fib({n})", "expected": e} for n, e in ((10, 55), (15, 610), (20, 6765), (1, 1))]
IO = [{"stdin": "3 4\n", "stdout": "7\n"}, {"stdin": "10 -2\n", "stdout": "8\n"}]
KINDS = {
    "correct": ("def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a", CALLS),
    "wrong": ("def fib(n):\n    return n", CALLS),
    "slow": (
        "def fib(n):\n    sum(i * i for i in range(300_000))\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a",
        CALLS,
    ),
    "program": ("a, b = map(int, input().split())\nprint(a + b)", IO),
}


def batch(count: int) -> tuple[list[str], list[list[dict]]]:
    kinds = list(KINDS.values())
    chosen = [kinds[i % len(kinds)] for i in range(count)]
    return [code for code, _ in chosen], [tests for _, tests in chosen]


def measure(slots: int, codes: list[str], tests: list[list[dict]], repeats: int) -> tuple[float, list[float]]:
    from trl_scale.rewards import CodeExecutionReward, SandboxSettings

    reward = CodeExecutionReward(sandbox=SandboxSettings(slots=slots))
    seconds, scores = [], []
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            outcomes = reward.verify(codes, tests)
            seconds.append(time.perf_counter() - started)
            scores = [sum(o.passed for o in row) / len(row) for row in outcomes]
    finally:
        reward.close()
    return statistics.median(seconds), scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--solutions", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    codes, tests = batch(args.solutions)
    slots = os.cpu_count() or 1
    pooled, pooled_scores = measure(slots, codes, tests, args.repeats)
    serial, serial_scores = measure(1, codes, tests, args.repeats)
    assert pooled_scores == serial_scores, "the pool changed a score"
    expected = {"correct": 1.0, "wrong": 0.25, "slow": 1.0, "program": 1.0}  # fib(1) == 1 holds for the wrong one
    assert pooled_scores == [list(expected.values())[i % 4] for i in range(len(codes))], pooled_scores
    runs = sum(1 if "call" in t[0] else len(t) for t in tests)
    print(f"{args.solutions} solutions ({runs} sandboxed runs), median of {args.repeats}:")
    print(f"  pool of {slots}: {pooled:.2f} s  ({args.solutions / pooled:.1f} solutions/s)")
    print(f"  one at a time: {serial:.2f} s  ({args.solutions / serial:.1f} solutions/s)")
    result = {
        "benchmark": "rewards",
        "solutions": args.solutions,
        "sandboxed_runs": runs,
        "slots": slots,
        "pool_solutions_per_s": round(args.solutions / pooled, 2),
        "serial_solutions_per_s": round(args.solutions / serial, 2),
        "speedup": round(serial / pooled, 2),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
