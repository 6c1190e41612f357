"""One rank's failure is every rank's (2 CPU processes under accelerate): a weight sync whose part on rank 1 fails
fails on both ranks naming rank 1 (it used to be overwritten by rank 0's "ok", and rank 1 recorded a version it did
not help make); managed servers that cannot start raise the same exception type on both ranks as with one process."""

import re
import subprocess

import pytest

from ..helpers import ROOT, accelerate_launch, launcher_failure, start_servers, subprocess_env


def _results(command: list[str]) -> dict[int, str]:
    done = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    # Each rank writes its line at once, but the launcher's other output may still cut in: read up to the next one.
    found = dict(re.findall(r"RESULT rank=(\d) (.*?)(?=RESULT rank=|$)", done.stdout, flags=re.MULTILINE))
    assert sorted(found) == ["0", "1"], launcher_failure(output)
    return {int(rank): outcome for rank, outcome in found.items()}


@pytest.mark.slow
def test_a_sync_failing_on_rank_1_fails_on_both_ranks_naming_rank_1(tiny_llama, tmp_path):
    (server,) = start_servers(tiny_llama, 1)
    try:
        command = accelerate_launch(2) + ["-m", "tests.multiprocess.rank_failure_worker", "sync", tiny_llama]
        results = _results(command + [str(tmp_path / "out"), server.url])
    finally:
        server.stop()
    for rank in (0, 1):
        assert results[rank].startswith("RolloutError: weight sync failed: OSError: on rank 1 of 2: No space left"), (
            results
        )


def test_managed_servers_that_cannot_start_raise_the_same_type_on_every_rank(tiny_llama, tmp_path):
    command = accelerate_launch(2) + ["-m", "tests.multiprocess.rank_failure_worker", "managed", tiny_llama]
    results = _results(command + [str(tmp_path / "out")])
    for rank in (0, 1):  # as with one process (tests/test_fleet.py): a ValueError naming the field
        assert re.match(r"ValueError: on rank 0 of 2: managed_server_python='.*' has no vllm", results[rank]), results
