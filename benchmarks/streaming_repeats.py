"""One cell of the streaming benchmark (`streaming.py`: even answers, streaming at staleness 2), repeated in one set of
vLLM servers, for the trl_scale of a given checkout: to compare two commits on the cell where the quick benchmark's
single runs disagreed. Each run's mean step time (after 2 warm-up steps of 12) and the trainer process's CPU seconds.

Usage: python benchmarks/streaming_repeats.py CHECKOUT [RUNS]: CHECKOUT is a repository root (this one, or a `git
worktree` of another commit with `.venv-vllm` linked in). The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> dict:
    root = os.path.abspath(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    sys.path.insert(0, root)
    os.chdir(root)
    import streaming
    from pinned_vllm import pinned_vllm_servers

    results = []
    with pinned_vllm_servers("streaming-repeats-") as (model_path, urls, work):
        for i in range(runs):
            cpu, wall = time.process_time(), time.perf_counter()
            run = streaming.run(model_path, urls, "streaming_k2", "even", 12, 2, os.path.join(work, f"r{i}"))
            results.append(
                {"step_s": run["step_s"], "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
            )
            print(results[-1], flush=True)
    record = {"benchmark": "streaming_repeats", "cell": "even/streaming_k2", "checkout": root, "runs": results}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
