"""Run under `accelerate launch` (2 CPU processes) by tests/multiprocess/test_rank_failures.py: one rank's own part
of a step fails, and every rank must learn it. Prints one `RESULT rank=R TYPE: message` line per rank.

    python -m tests.multiprocess.rank_failure_worker sync|managed MODEL OUT [URL]
"""

from __future__ import annotations

import sys

from ..helpers import end_distributed_worker, server_grpo


def main() -> None:
    case, model, out, *urls = sys.argv[1:]
    rank, outcome = None, "ok"
    try:
        if case == "sync":  # rank 1 fails its part of the second weight sync (its parameter walk, its disk)
            trainer = server_grpo(model, out, urls, weight_sync="shared_dir", max_steps=3)
            rank = trainer.accelerator.process_index
            generation = trainer.vllm_generation
            if rank == 1:
                mode = generation.syncer.mode
                walk = mode.sync

                def fails_on_this_rank(weights, version):
                    if generation.sync_count == 1:
                        raise OSError("No space left on device (rank 1's copy of the weights)")
                    return walk(weights, version)

                mode.sync = fails_on_this_rank
            trainer.train()
        else:  # managed servers that cannot start: the same exception type on every rank as with one process
            server_grpo(model, out, None, managed_servers=1, managed_server_python=sys.executable)
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    import torch.distributed as dist

    rank = dist.get_rank() if rank is None else rank
    # One write per line: print() writes the text and its newline apart, and two ranks share this pipe.
    line = outcome.replace("\n", " ")
    sys.stdout.write(f"RESULT rank={rank} {line}\n")
    sys.stdout.flush()
    end_distributed_worker()


if __name__ == "__main__":
    main()
