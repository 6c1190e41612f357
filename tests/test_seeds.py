"""A seed per request (`trl_scale/rollout/seeds.py`): derived from generation_kwargs' seed, the trainer's seed, the
rank and the request's identity, so seeded runs reproduce request for request and no two requests draw alike. The
end-to-end check (an ordered agent run twice: equal to the bit, its groups' completions different) is
tests/test_stream_environments.py's."""

import threading

import pytest

from trl_scale.rollout.seeds import RequestSeeds, continued_seed, identified, next_identity


def test_each_identity_its_own_seed_the_same_in_every_run():
    seeds = RequestSeeds.from_config(7, 42, rank=0)
    drawn = [seeds.seed(("batch", b, i)) for b in range(20) for i in range(8)]
    assert len(set(drawn)) == len(drawn)
    assert drawn == [RequestSeeds.from_config(7, 42, 0).seed(("batch", b, i)) for b in range(20) for i in range(8)]
    others = [
        RequestSeeds.from_config(8, 42, 0),  # another generation seed
        RequestSeeds.from_config(7, 43, 0),  # another run seed
        RequestSeeds.from_config(7, 42, 1),  # another rank
    ]
    for other in others:
        assert other.seed(("batch", 0, 0)) != drawn[0]
    assert all(0 <= seed < 2**30 for seed in drawn)  # vLLM seeds a request's choices seed + i


def test_unseeded_requests_stay_unseeded_and_a_seeded_one_needs_its_identity():
    sampling = {"temperature": 1.0}
    assert RequestSeeds.from_config(None, 42, 0).sampling(sampling, None) is sampling
    seeded = RequestSeeds.from_config(0, 42, 0)
    assert seeded.sampling({"seed": 0}, ("group", 3, 1, 0))["seed"] == seeded.seed(("group", 3, 1, 0))
    with pytest.raises(RuntimeError, match="without its identity"):
        seeded.sampling(sampling, None)


def test_a_groups_requests_are_numbered_in_its_thread_whatever_other_threads_do():
    """A streamed group's requests (first turn, later turns, an episode's rows) take its key and their number in
    the order its thread sends them; another group's thread numbers its own; outside a group there is none."""
    seen = {}

    def group(index):
        with identified("group", index, 1):
            seen[index] = [next_identity() for _ in range(3)]

    threads = [threading.Thread(target=group, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {i: [("group", i, 1, n) for n in range(3)] for i in range(4)}
    assert next_identity() is None


def test_a_continuation_draws_its_own_numbers():
    assert continued_seed(None, 5) is None
    assert len({continued_seed(11, done) for done in range(10)} | {11}) == 11


def test_a_synchronous_batch_seeds_each_request_by_the_batchs_number_and_its_place(monkeypatch):
    """The synchronous and prefetched path: each prompt of a batch one request, seeded by ("batch", number, place);
    the next batch other seeds (before: the same seed in every request of every batch)."""
    from types import SimpleNamespace

    from trl_scale.rollout.generation import ServerRolloutGeneration

    sent = []

    class Client:
        def generate(self, prompts, n, model=None, per_request=None, **sampling):
            sent.append([extra["seed"] for extra in per_request])
            return [[{"token_ids": [1]}] * k for k in n]

    generation = object.__new__(ServerRolloutGeneration)
    from trl_scale.rollout.syncer import WeightSyncer

    generation.client, generation.syncer = Client(), WeightSyncer(None, "r", None, managed=False)
    generation.settings = SimpleNamespace(sampling={"temperature": 1.0, "seed": 3})
    generation.seeds = RequestSeeds.from_config(3, 0, 0)
    prompts = [[1, 2]] * 4 + [[3]] * 4
    generation._request(prompts, batch=0)
    generation._request(prompts, batch=1)
    assert sent == [
        [generation.seeds.seed(("batch", 0, 0)), generation.seeds.seed(("batch", 0, 1))],
        [generation.seeds.seed(("batch", 1, 0)), generation.seeds.seed(("batch", 1, 1))],
    ]
    assert len({seed for batch in sent for seed in batch}) == 4
