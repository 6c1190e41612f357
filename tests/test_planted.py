"""Rules a planted bug once changed without any test going red (issue 59's survivors), each pinned here on its own:
the version a streamed answer reports when it finishes during a weight sync, a conversation's newest turn, the
least-outstanding router's order, the sliding-window rule of the varlen switch, and the decoder layers of a PEFT
model. The bigger survivors have tests beside their features (the code verifier's rules in test_sandbox.py, the
reward client's in test_remote_reward.py, the seeds in test_seeds.py)."""

from types import SimpleNamespace

import torch

from trl_scale.routing import LeastOutstandingRouting, ServerState


def _generation(sync_count: int):
    """A rollout generation with only what `send_group` and `continue_conversations` read (its syncer's count)."""
    from trl_scale.rollout.generation import ServerRolloutGeneration
    from trl_scale.rollout.seeds import RequestSeeds
    from trl_scale.rollout.syncer import WeightSyncer

    generation = object.__new__(ServerRolloutGeneration)
    generation.syncer = WeightSyncer(None, "r", None, managed=False)
    generation.syncer.count, generation.syncer.mode = sync_count, SimpleNamespace(name="shared_dir")
    generation.fleet = None
    generation.seeds = RequestSeeds(None)
    interrupt = SimpleNamespace(interrupt="keep")
    generation.settings = SimpleNamespace(sampling={}, asynchronous=interrupt)
    return generation


def test_an_answer_finishing_during_a_weight_sync_may_hold_the_syncs_weights():
    """A streaming sync lets running answers reach its new weights: an answer that finishes while a sync is under
    way reports the sync's version (count + 1), not the count before it (which understated its staleness)."""
    generation = _generation(sync_count=3)

    def complete(prompt, n, model, **kwargs):
        generation.syncer.syncing = True  # a sync began while this answer was generating
        return [{"token_ids": [1]}] * n

    generation.client = SimpleNamespace(complete=complete)
    _, newest = generation.send_group([1, 2], 2)
    assert newest == 4
    generation.syncer.syncing = False
    generation.client = SimpleNamespace(complete=lambda prompt, n, model, **kwargs: [{"token_ids": [1]}] * n)
    assert generation.send_group([1, 2], 2)[1] == 3


def test_a_conversations_later_turn_reports_the_newest_weights_it_reached():
    """Later turns go out after the first, and a sync may land between them: the group's newest version is the
    newest of its turns, not its first turn's."""
    from concurrent.futures import Future

    generation = _generation(sync_count=5)
    generation.logprobs = None
    generation.require_logprobs = False

    def submit(fn, *args):
        future = Future()
        future.set_result(([{"token_ids": [7]}], 7))  # this turn was generated after two more syncs
        return future

    generation.client = SimpleNamespace(submit=submit)

    def converse(rows, prompt_ids, completion_ids, logprobs, send_turns):
        send_turns([[1, 2, 3]])
        return [[{"role": "assistant", "content": "x"}]]

    choices = [{"token_ids": [3]}]
    assert generation.continue_conversations(converse, [{}], [[1, 2]], choices) == 7


def test_least_outstanding_routing_orders_by_in_flight_then_served():
    busy = ServerState("a", outstanding=2, served=0)
    idle_but_used = ServerState("b", outstanding=0, served=50)
    idle_fresh = ServerState("c", outstanding=1, served=0)
    picked = LeastOutstandingRouting().pick([busy, idle_fresh, idle_but_used], cap=8, backlog=0, now=0.0)
    assert picked is idle_but_used  # fewest in flight wins over fewest served
    tie = [ServerState("d", outstanding=1, served=9), ServerState("e", outstanding=1, served=2)]
    assert LeastOutstandingRouting().pick(tie, cap=8, backlog=0, now=0.0).url == "e"


def test_a_sliding_window_model_keeps_its_window_unless_it_says_it_is_off():
    """Mistral's config has a sliding_window and no use_sliding_window flag: its window is on, so the switch to
    full-attention varlen must refuse it; Qwen2's use_sliding_window=False means full attention everywhere."""
    from transformers import MistralConfig, Qwen2Config

    from trl_scale.scoring.varlen import varlen_unsupported_config

    cuda = torch.device("cuda")  # the rule is read on a device object; nothing runs there
    mistral = MistralConfig(sliding_window=4096, num_hidden_layers=2)
    mistral._attn_implementation = "sdpa"
    assert varlen_unsupported_config(mistral, cuda) == "sliding-window attention"
    qwen = Qwen2Config(sliding_window=4096, use_sliding_window=False, num_hidden_layers=2)
    qwen._attn_implementation = "sdpa"
    assert varlen_unsupported_config(qwen, cuda) is None


def test_the_decoder_layers_of_a_peft_model_are_found(tiny_llama):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trl_scale.scoring.compiled import decoder_layers

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    count = model.config.num_hidden_layers
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    layers = decoder_layers(peft)
    assert len(layers) == count and layers is peft.get_base_model().model.layers


class _Recorded:
    """An environment that records what reset() was given and whether it was closed."""

    def __init__(self):
        self.reset_with, self.closed = None, False

    def reset(self, **kwargs):
        self.reset_with = kwargs
        return None

    def close(self):
        self.closed = True


def test_with_several_environments_reset_gets_the_row_without_its_environment_column():
    """TRL passes the row to reset() without `environment` (a control field in multi-environment mode); the
    stream's episodes must too (an environment's reset(**row) may take no such argument)."""
    import threading

    from trl_scale.trainers.stream_environments import EpisodeOpener

    factories = {"a": _Recorded, "b": _Recorded}
    tokenize = lambda names, prompts: ([[1] for _ in prompts], None, {})  # noqa: E731 (TRL's: ids, images, fields)
    opener = EpisodeOpener(factories, True, tokenize, 5.0, threading.Lock())
    rows = [{"prompt": "p", "environment": "a", "id": 1}, {"prompt": "p", "environment": "b", "id": 1}]
    episode = opener(rows)
    assert [instance.reset_with for instance in episode.instances] == [{"prompt": "p", "id": 1}] * 2
    episode.close()


def test_an_instance_given_back_after_its_run_ended_is_closed_not_pooled():
    """The end of a run closes the free instances; one still in an episode then is closed when it comes back, and
    the next run makes its own (before: it went back to the pool unclosed, a session left open)."""
    from trl_scale.trainers.stream_environments import EnvironmentPool

    pool = EnvironmentPool({None: _Recorded})
    in_episode, free = pool.acquire(None), pool.acquire(None)
    pool.release(None, free)
    pool.close()  # the run ends with `in_episode` still out
    assert free.closed and not in_episode.closed
    pool.release(None, in_episode)
    assert in_episode.closed
    assert pool.acquire(None) not in (in_episode, free)
