"""Tool-using rollouts, streamed: a prompt group's later turns are generated in the stream, right after its first.

TRL runs its tool loop (`_tool_call_loop`) inside the training step: parse each completion's tool calls, call the
tools, append their results and generate the next turn, up to `max_tool_calling_iterations`. Streaming runs that
same loop, TRL's own code, for one prompt group in the stream's thread as soon as the group's first turn is back:
each later turn is one more request per conversation, routed and failed over as every streamed request, with the
weights the servers hold then. The step then takes the whole conversations (`streamed_conversations`) instead of
generating turns itself, so a batch whose answers call tools no longer waits for their later turns.

The loop runs on a view of the trainer (`_GroupView`): the trainer's attributes, but the group's own tool tables and a
`_generate_single_turn` that sends the turn to the servers. One lock serialises the loops' own work (tools, the
tokenizer) across the stream's threads, as TRL calls a batch's tools one after another; it is let go while a turn
generates, so many conversations wait on the servers at once. Async tools run on TRL's event loop, as in TRL.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
from dataclasses import dataclass

from ..rollout.images import row_images
from .construction import trl_base_class


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


class TrainerView:
    """The trainer as one of TRL's methods sees it when called for one prompt group: the trainer's attributes, those
    set on the view (the group's own) shadowing them."""

    def __init__(self, trainer, **own):
        self._trainer = trainer
        vars(self).update(own)

    def __getattr__(self, name: str):
        return getattr(self._trainer, name)


class _GroupView(TrainerView):
    """The trainer as TRL's tool loop sees it, for one prompt group in a stream thread. Built by `_group_view`, an
    instance of the trainer's own class too: TRL's loop calls `super()._prepare_inputs` for tools that answer with
    images, which takes only an instance of TRL's class."""

    def __init__(self, trainer, num_rows: int, send_turns, lock: threading.Lock, episode=None, timeout=None):
        super().__init__(trainer)
        # the trainer's features hook what TRL's loop calls on the view (a tool answer's check): the adapter reads
        # them from the instance's own attributes, which the view's are
        self.features = vars(trainer).get("features")
        self._send_turns = send_turns
        self._lock = lock
        self._sync_tool_dicts, self._async_tool_dicts = [], []
        for row in range(num_rows):  # TRL's per-rollout tables: standalone tools, then the row's environment's methods
            methods = episode.tool_methods(row, timeout) if episode is not None else []
            sync_tools, async_tools = {}, {}
            for tool in [*trainer._standalone_tools, *methods]:
                (async_tools if inspect.iscoroutinefunction(tool) else sync_tools)[tool.__name__] = tool
            self._sync_tool_dicts.append(sync_tools)
            self._async_tool_dicts.append(async_tools)
        if episode is not None:
            self._batch_environments = list(episode.names)  # the group's, not the step's

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations=1, has_tool_images=False):
        # each row's images in the order their tokens sit: the prompt's, then those its tools answered with (TRL
        # merges them so); the server reads no multimodal fields, it renders the images itself
        with_images = {"images": images} if images is not None and any(images) else {}
        self._lock.release()  # other conversations run their tools while this turn generates
        try:
            return self._send_turns([list(ids) for ids in prompt_ids], **with_images)
        finally:
            self._lock.acquire()


@functools.cache
def _group_view_class(trainer_class: type) -> type:
    # the view's own methods first, then the trainer's (bound to the view: they read its shadowing attributes)
    return type(f"GroupView[{trainer_class.__name__}]", (_GroupView, trainer_class), {})


def _group_view(trainer, *args) -> _GroupView:
    """`_GroupView(trainer, *args)`, of a class that is also the trainer's (never initialised as a trainer: the
    trainer's attributes are read through the view)."""
    cls = _group_view_class(type(trainer))
    view = object.__new__(cls)
    _GroupView.__init__(view, trainer, *args)
    for name in _class_values(cls) & vars(trainer).keys() - vars(view).keys():
        setattr(view, name, getattr(trainer, name))  # the trainer's own value, not its class's default
    return view


@functools.cache
def _class_values(cls: type) -> frozenset[str]:
    """The names `cls` gives plain values (a class-level default an instance may set): a view would read those
    from its class rather than from the trainer."""
    return frozenset(
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if not name.startswith("__") and not callable(value) and not hasattr(value, "__get__")
    )


def first_turn_messages(
    trainer, prompts: list, prompt_ids: list[list[int]], completion_ids: list[list[int]], names: list | None = None
) -> list:
    """Each completion's first turn as TRL's `_generate` decodes it before its tool loop: conversational prompts
    with the tokenizer's response template get their tool calls parsed (with environments, `names`: each row's
    environment's tools)."""
    from trl.chat_template_utils import parse_response  # what TRL's _generate calls
    from trl.data_utils import is_conversational

    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)  # TRL's _tokenizer
    templated = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    if templated is None or not is_conversational({"prompt": prompts[0]}):
        return decoded_completions(trainer, prompts, completion_ids)
    tools = [trainer.tools] * len(completion_ids) if names is None else [trainer._env_tools[n] for n in names]
    return [
        [parse_response(tokenizer, ids, prefix=prompt_ids[i], tools=tools[i])] for i, ids in enumerate(completion_ids)
    ]


def decoded_completions(trainer, prompts: list, completion_ids: list[list[int]]) -> list:
    """Completions decoded as TRL's `_generate` decodes them without parsing tool calls (RLOO's always; GRPO's
    without a response template): texts, or one assistant message each for conversational prompts."""
    from trl.data_utils import is_conversational

    texts = trainer.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
    if not is_conversational({"prompt": prompts[0]}):
        return texts
    return [[{"role": "assistant", "content": text}] for text in texts]


def conversing(trainer, lock: threading.Lock | None = None, timeout: float | None = None):
    """The `converse` a streaming generation runs per prompt group (see `ServerRolloutGeneration.enable_async`):
    TRL's tool loop over the group's rows, in the stream's thread. With an episode (environments), `prompt_ids`
    holds each row's and the tools include each row's environment's methods (bounded by `timeout`)."""
    lock = lock or threading.Lock()
    tool_call_loop = trl_base_class(trainer)._tool_call_loop

    def converse(rows, prompt_ids, completion_ids, logprobs, send_turns, episode=None) -> list[Conversation]:
        prompts = copy.deepcopy([row["prompt"] for row in rows])
        ids = [list(prompt_ids) for _ in rows] if episode is None else [list(p) for p in prompt_ids]
        names = None if episode is None else episode.names
        with lock:
            completions = first_turn_messages(trainer, prompts, ids, completion_ids, names)
            view = _group_view(trainer, len(rows), send_turns, lock, episode, timeout)
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
