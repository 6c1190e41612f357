"""Tool-using rollouts, streamed: a prompt group's later turns are generated in the stream, right after its first.

TRL runs its tool loop (`_tool_call_loop`) inside the training step: parse each completion's tool calls, call the
tools, append their results and generate the next turn, up to `max_tool_calling_iterations`. Streaming runs that
same loop, TRL's own code, for one prompt group in the stream's thread as soon as the group's first turn is back:
each later turn is one more request per conversation, routed and failed over as every streamed request, with the
weights the servers hold then. The step then takes the whole conversations (`streamed_conversations`) instead of
generating turns itself, so a batch whose answers call tools no longer waits for their later turns.

The loop runs on a view of the trainer (`_GroupView`, made by `trl_facade`): the trainer's attributes, but the
group's own tool tables and a `_generate_single_turn` that sends the turn to the servers. One lock serialises the
loops' own work (tools, the tokenizer) across the stream's threads, as TRL calls a batch's tools one after another;
it is let go while a turn generates, so many conversations wait on the servers at once. Async tools run on TRL's
event loop, as in TRL.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

from ..rollout.images import row_images


@dataclass(frozen=True)
class Conversation:
    """One completion's whole rollout as TRL's tool loop leaves it: all turns' tokens (tool results included, masked
    by `tool_mask` 0), their sampler log-probs (0.0 on tool results), its messages, and the tool calls it made (and
    how many failed)."""

    completion_ids: list[int]
    tool_mask: list[int]
    logprobs: list[float]
    messages: list[dict]
    tool_images: list
    tool_calls: int
    tool_failures: int


def first_turn_messages(
    trl, prompts: list, prompt_ids: list[list[int]], completion_ids: list[list[int]], names: list | None = None
) -> list:
    """Each completion's first turn as TRL's `_generate` decodes it before its tool loop: conversational prompts
    with the tokenizer's response template get their tool calls parsed (with environments, `names`: each row's
    environment's tools)."""
    from trl.chat_template_utils import parse_response  # what TRL's _generate calls
    from trl.data_utils import is_conversational

    tokenizer = trl.tokenizer
    templated = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    if templated is None or not is_conversational({"prompt": prompts[0]}):
        return decoded_completions(trl, prompts, completion_ids)
    tools = [trl.tools] * len(completion_ids) if names is None else [trl.environment_tools[n] for n in names]
    return [
        [parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=tools[i])] for i, ids in enumerate(completion_ids)
    ]


def decoded_completions(trl, prompts: list, completion_ids: list[list[int]]) -> list:
    """Completions decoded as TRL's `_generate` decodes them without parsing tool calls (RLOO's always; GRPO's
    without a response template): texts, or one assistant message each for conversational prompts."""
    from trl.data_utils import is_conversational

    texts = trl.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    if not is_conversational({"prompt": prompts[0]}):
        return texts
    return [[{"role": "assistant", "content": text}] for text in texts]


def conversing(trl, lock: threading.Lock | None = None, timeout: float | None = None):
    """The `converse` a streaming generation runs per prompt group (see `ServerRolloutGeneration.enable_async`):
    TRL's tool loop over the group's rows, in the stream's thread. With an episode (environments), `prompt_ids`
    holds each row's and the tools include each row's environment's methods (bounded by `timeout`)."""
    lock = lock or threading.Lock()
    tool_call_loop = trl.trl_method("_tool_call_loop")

    def converse(rows, prompt_ids, completion_ids, logprobs, send_turns, episode=None) -> list[Conversation]:
        prompts = copy.deepcopy([row["prompt"] for row in rows])
        ids = [list(prompt_ids) for _ in rows] if episode is None else [list(p) for p in prompt_ids]
        names = None if episode is None else episode.names
        with lock:
            completions = first_turn_messages(trl, prompts, ids, completion_ids, names)
            view = trl.group_view(len(rows), send_turns, lock, episode, timeout)
            first_ids, first_logprobs = [list(c) for c in completion_ids], [list(v) for v in logprobs]
            # each row's images, as TRL's step hands them to its loop (server rollout reads no multimodal fields)
            prompt_images = row_images(rows) if episode is None else episode.images
            mask, messages, completion_ids, logprobs, calls, failures, tool_images = tool_call_loop(
                view, prompts, ids, first_ids, completions, first_logprobs, prompt_images, {}
            )
        # the group's counts ride on its first conversation: a batch's sum is TRL's count
        return [
            Conversation(
                completion_ids[i],
                mask[i],
                logprobs[i],
                messages[i],
                tool_images[i],
                calls if i == 0 else 0,
                failures if i == 0 else 0,
            )
            for i in range(len(rows))
        ]

    return converse


def streamed_conversations(conversations: list, completion_ids: list[list[int]], logprobs):
    """TRL's tool loop's return for a streamed batch, from its conversations (their first turns must be the batch's
    completions): (tool_mask, completions, completion_ids, logprobs, tool calls, tool failures, tool images)."""
    for conversation, first_turn in zip(conversations, completion_ids, strict=True):
        if conversation.completion_ids[: len(first_turn)] != list(first_turn):
            raise RuntimeError("streamed tool rollout: a conversation does not start with its batch's completion")
    return (
        [list(c.tool_mask) for c in conversations],
        [copy.deepcopy(c.messages) for c in conversations],
        [list(c.completion_ids) for c in conversations],
        None if logprobs is None else [list(c.logprobs) for c in conversations],
        sum(c.tool_calls for c in conversations),
        sum(c.tool_failures for c in conversations),
        [list(c.tool_images) for c in conversations],
    )
