"""Streamed tool rollouts (`trl_scale/trainers/streamed_tools.py`): a prompt group's later turns, generated in the
stream's thread with TRL's own tool loop, come out exactly as TRL's loop in the step makes them (tool masks, tokens,
log-probs, messages, call and failure counts), also with many groups conversing at once. The run against real vLLM
(every turn streamed, each token's weights within its span) is in `test_real_vllm.py`."""

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import trl
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy.tools import build_tool_calling_model, tick, tool_prompts
from trl_scale.trainers.streamed_tools import conversing, streamed_conversations

from .helpers import cpu_args, token_parity_reward

TICK = '<call>{"name": "tick", "arguments": {}}</call>'
TOCK = '<call>{"name": "tock", "arguments": {}}</call>'
BROKEN = '<call>{"name": "broken", "arguments": {}}</call>'


async def tock() -> str:
    """The number word after the next."""
    return "six"


def broken() -> str:
    """Always fails."""
    raise RuntimeError("broken tool")


@pytest.fixture(scope="module")
def trainer(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("streamed-tools")
    path = build_tool_calling_model(tiny_llama, str(out / "tool-model"), steps=1)
    config = trl_scale.GRPOConfig(
        **cpu_args(out / "run", num_generations=4, max_completion_length=160, max_tool_calling_iterations=3)
    )
    return trl_scale.GRPOTrainer(
        model=path,
        reward_funcs=token_parity_reward,
        args=config,
        train_dataset=tool_prompts(8),
        processing_class=AutoTokenizer.from_pretrained(path),
        tools=[tick, tock, broken],
    )


def scripted_turns(tokenizer, delay: float = 0.0):
    """A stand-in for the servers: each turn's answer depends on the conversation so far, so rows of one group
    diverge: after one tool result another call (tick, the async tock or the failing one, by length), after two a
    plain answer; log-probs made up from the length."""
    eos = [tokenizer.eos_token_id]
    calls = [TICK, TOCK, BROKEN]

    def answer(prompt: list[int]) -> str:
        results = tokenizer.decode(prompt).count("<|tool|>")
        return calls[len(prompt) % 3] if results < 2 else "done"

    def turns(prompts):
        time.sleep(delay)
        ids = [tokenizer.encode(answer(p), add_special_tokens=False) + eos for p in prompts]
        return ids, [[-0.01 * (len(p) % 7 + 1)] * len(i) for p, i in zip(prompts, ids)]

    return turns


def first_turns(tokenizer, rows: int):
    texts = [TICK, TOCK, "four", BROKEN][:rows]
    ids = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in texts]
    return ids, [[-0.5] * len(i) for i in ids]


def in_the_step(trainer, rows, prompt_ids, completion_ids, logprobs, turns):
    """TRL's tool loop as TRL runs it in the step, its turns from `turns`."""
    from trl_scale.trainers.streamed_tools import first_turn_messages

    prompts = copy.deepcopy([row["prompt"] for row in rows])
    ids = [list(prompt_ids) for _ in rows]
    trainer._sync_tool_dicts = [{"tick": tick, "broken": broken} for _ in rows]
    trainer._async_tool_dicts = [{"tock": tock} for _ in rows]
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: turns(prompt_ids)
    try:
        messages = first_turn_messages(trainer.run.trl, prompts, ids, completion_ids)
        return trl.GRPOTrainer._tool_call_loop(
            trainer, prompts, ids, copy.deepcopy(completion_ids), messages, copy.deepcopy(logprobs), None, {}
        )
    finally:
        del trainer._generate_single_turn


def group(trainer, index: int):
    rows = [dict(trainer.train_dataset[index]) for _ in range(4)]
    prompt_ids = trainer._tokenize_prompts([rows[0]["prompt"]])[0][0]
    return rows, prompt_ids


def test_a_streamed_group_converses_exactly_as_trls_tool_loop_in_the_step(trainer):
    tokenizer = trainer.processing_class
    rows, prompt_ids = group(trainer, 0)
    completion_ids, logprobs = first_turns(tokenizer, 4)
    expected = in_the_step(trainer, rows, prompt_ids, completion_ids, logprobs, scripted_turns(tokenizer))
    conversations = conversing(trainer.run.trl)(rows, prompt_ids, completion_ids, logprobs, scripted_turns(tokenizer))
    streamed = streamed_conversations(conversations, completion_ids, logprobs)
    assert streamed == expected
    tool_mask, messages, _, _, calls, failures, _ = streamed
    assert calls >= 6 and failures >= 2  # several turns per row: sync, async and failing tools all called
    assert all(0 in mask for mask in tool_mask[:2]) and 1 not in {len(m) for m in messages[:2]}
    assert messages[2] == [{"role": "assistant", "content": "four"}]  # no call: one turn, as TRL leaves it


def test_groups_conversing_at_once_each_get_what_they_would_alone(trainer):
    """Eight groups' conversations in eight threads (each turn taking a while, so their loops interleave): each equal
    to its conversation run alone; the lock lets go while a turn generates (eight at once take about one turn's time
    per round, not eight)."""
    tokenizer = trainer.processing_class
    converse = conversing(trainer.run.trl)
    groups = [group(trainer, i) for i in range(8)]
    first = first_turns(tokenizer, 4)
    alone = [converse(rows, ids, *first, scripted_turns(tokenizer)) for rows, ids in groups]
    concurrent = []
    active, most = [0], [0]
    lock = threading.Lock()
    turns = scripted_turns(tokenizer, delay=0.2)

    def counted(prompts):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        try:
            return turns(prompts)
        finally:
            with lock:
                active[0] -= 1

    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda g: converse(g[0], g[1], *first, counted), groups))
    assert concurrent == alone
    assert most[0] >= 4  # turns of several groups generating at the same time


def test_a_conversation_not_starting_with_its_batch_completion_is_refused(trainer):
    tokenizer = trainer.processing_class
    rows, prompt_ids = group(trainer, 0)
    completion_ids, logprobs = first_turns(tokenizer, 4)
    conversations = conversing(trainer.run.trl)(rows, prompt_ids, completion_ids, logprobs, scripted_turns(tokenizer))
    with pytest.raises(RuntimeError, match="does not start with its batch's completion"):
        streamed_conversations(conversations[::-1], completion_ids, logprobs)


def test_the_tool_loop_leaves_the_trainers_rows_and_first_turns_as_they_were(trainer):
    """TRL's loop appends each turn's messages to the prompts it is given and extends the completions: run in the
    stream on the trainer's own rows and the batch's first turns, it would change what the step later scores,
    rewards and logs (before, only a real-vLLM test noticed)."""
    tokenizer = trainer.processing_class
    rows, prompt_ids = group(trainer, 0)
    completion_ids, logprobs = first_turns(tokenizer, 4)
    before = copy.deepcopy((rows, prompt_ids, completion_ids, logprobs))
    conversations = conversing(trainer.run.trl)(rows, prompt_ids, completion_ids, logprobs, scripted_turns(tokenizer))
    assert any(len(c.completion_ids) > len(first) for c, first in zip(conversations, completion_ids))  # it conversed
    assert (rows, prompt_ids, completion_ids, logprobs) == before


def picture() -> list:
    """A picture of the count."""
    from PIL import Image

    return [{"type": "image", "image": Image.new("RGB", (4, 4))}, {"type": "text", "text": "a picture"}]


@pytest.fixture(scope="module")
def picture_trainer(trainer, tmp_path_factory):
    """A text-only policy whose tool answers with an image (TRL 1.16's content blocks)."""
    path = trainer.model.config._name_or_path
    return trl_scale.GRPOTrainer(
        model=path,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path_factory.mktemp("picture"), num_generations=4)),
        train_dataset=tool_prompts(8),
        processing_class=AutoTokenizer.from_pretrained(path),
        tools=[picture],
    )


@pytest.mark.parametrize("where", ["step", "stream"])
def test_a_tool_answering_with_an_image_to_a_text_only_policy_is_refused_naming_it(picture_trainer, where):
    """TRL renders the blocks with the text template as the list's repr; refused in TRL's loop in the step and in
    the streamed loop alike."""
    tokenizer = picture_trainer.processing_class
    rows, prompt_ids = group(picture_trainer, 0)
    call = tokenizer.encode('<call>{"name": "picture", "arguments": {}}</call>', add_special_tokens=False)
    completion_ids = [call + [tokenizer.eos_token_id] for _ in rows]
    logprobs = [[-0.5] * len(ids) for ids in completion_ids]
    turns = scripted_turns(tokenizer)
    with pytest.raises(ValueError, match=r"tool 'picture' answered with an image, but the policy is text-only"):
        if where == "step":
            prompts = copy.deepcopy([row["prompt"] for row in rows])
            ids = [list(prompt_ids) for _ in rows]
            picture_trainer._sync_tool_dicts = [{"picture": picture} for _ in rows]
            picture_trainer._async_tool_dicts = [{} for _ in rows]
            picture_trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: turns(prompt_ids)
            from trl_scale.trainers.streamed_tools import first_turn_messages

            messages = first_turn_messages(picture_trainer.run.trl, prompts, ids, completion_ids)
            loop = trl.GRPOTrainer._tool_call_loop
            loop(picture_trainer, prompts, ids, completion_ids, messages, logprobs, None, {})
        else:
            conversing(picture_trainer.run.trl)(rows, prompt_ids, completion_ids, logprobs, turns)
