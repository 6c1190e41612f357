"""The collectives that route several trainer processes through the main one (2 real gloo processes): each rank
gets its own part of the main process's answer, and a failure there is raised on every rank instead of leaving
the others waiting."""

import os

import pytest
import torch.multiprocessing as mp

from .helpers import free_port


class ServiceDown(RuntimeError):
    pass


def _ranks(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from trl_scale import ranks
    from trl_scale.distributed import main_process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = {}
    try:
        # Each rank sends its own payload; the main process answers each rank separately.
        seen["call"] = main_process.call_on_main([rank] * (rank + 1), lambda payloads: [sum(p) for p in payloads])

        # Started now, collected later: the caller's own collectives may run in between.
        pending = main_process.start_on_main(rank, lambda payloads: lambda: [p * 10 for p in payloads])
        dist.barrier()
        seen["pending"] = pending.result()

        seen["main_only"] = main_process.run_on_main(lambda: "started")

        def broken(payloads):
            raise ServiceDown("critic group: its worker died during step")

        try:
            main_process.call_on_main(rank, broken)
        except ServiceDown as error:
            seen["error"] = str(error)

        def fails_to_start():
            raise ServiceDown("critic group could not start")

        try:
            main_process.run_on_main(fails_to_start)
        except ServiceDown as error:
            seen["start_error"] = str(error)

        # Every rank does its own part; one rank's failure fails all of them, with its type and its rank named.
        def rank_local_part():
            if rank == 1:
                raise ServiceDown("disk full on this node")
            return rank

        try:
            ranks.agree(rank_local_part)
        except ServiceDown as error:
            seen["agree_error"] = str(error)
        seen["agreed"] = ranks.agree(lambda: rank * 7)  # no failure: each rank keeps its own result
        seen["decided"] = ranks.decide_on_main(lambda: f"decided by rank {dist.get_rank()}")
        seen["gathered"] = ranks.gathered({f"adapter-of-rank-{rank}"})
        dist.barrier()  # both ranks got here: nothing is left waiting
    finally:
        results[rank] = seen
        dist.destroy_process_group()


@pytest.mark.slow  # > 20 s on 2 cores; still in CI (CI deselects only gpu and vllm)
def test_main_process_collectives_route_answers_and_errors_to_every_rank():
    world = 2
    results = mp.Manager().dict()
    mp.start_processes(_ranks, args=(world, free_port(), results), nprocs=world, join=True, start_method="spawn")
    assert results[0]["call"] == 0 and results[1]["call"] == 2  # rank 1 sent [1, 1]
    assert [results[r]["pending"] for r in range(world)] == [0, 10]
    assert results[0]["main_only"] == "started" and results[1]["main_only"] is None
    for rank in range(world):
        assert results[rank]["error"] == "critic group: its worker died during step"
        assert results[rank]["start_error"] == "on rank 0 of 2: critic group could not start"
        assert results[rank]["agree_error"] == "on rank 1 of 2: disk full on this node"
        assert results[rank]["agreed"] == 7 * rank and results[rank]["decided"] == "decided by rank 0"
        assert results[rank]["gathered"] == [{"adapter-of-rank-0"}, {"adapter-of-rank-1"}]


def test_with_one_process_the_calls_run_in_place():
    from trl_scale import ranks
    from trl_scale.distributed import main_process

    assert main_process.call_on_main(3, lambda payloads: [payloads[0] + 1]) == 4
    assert main_process.start_on_main(3, lambda payloads: lambda: [payloads[0] * 2]).result() == 6
    with pytest.raises(ZeroDivisionError):
        main_process.call_on_main(3, lambda payloads: [1 / 0])

    with pytest.raises(ZeroDivisionError, match="division by zero"):  # the original, unchanged
        ranks.agree(lambda: 1 / 0)
    assert ranks.decide_on_main(lambda: "here") == "here" and ranks.run_on_main(lambda: 5) == 5
    assert ranks.gathered({"a"}) == [{"a"}]
