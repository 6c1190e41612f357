"""TRL's `rollout_func`, streamed: called once per prompt group in the stream, as soon as the group is sent, instead of
once per batch inside the step.

TRL calls `rollout_func(prompts, trainer)` in `_generate` with the step's whole slice of prompts (each prompt
`num_generations` times) and trains on what it returns: `prompt_ids`, `completion_ids`, `logprobs` (the sampler's),
and extra keys handed to the reward functions (`env_mask` becomes `tool_mask`). Streamed, each group's call gets the
group's prompts and a view of the trainer whose `vllm_generation.generate(prompts, images, num_generations)` (TRL's
own interface) sends to the servers through the stream: routed and failed over as every streamed request, the
group's weight versions recorded from its first request to its last, so the staleness bound and the correction hold
for its tokens. In the step, TRL's own `_generate` runs with `rollout_func` answering from the streamed groups (their
prompts checked to be the step's), so TRL's decoding, masks and reward plumbing are TRL's.

What trl-scale cannot see: a rollout_func that reaches the servers another way (`vllm_generation.vllm_client`, its
own HTTP client). Its requests are not routed by the stream; their tokens are taken to be as new as the moment the
function returned, as old as the group's dispatch, which holds only if those requests were made within the call.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

from ..rollout.choices import generate_output
from ..rollout.images import image_urls, multimodal_prompts, row_images
from ..rollout.record import GeneratedBatch
from ..rollout.step_state import StepState

ROLLOUT_KEY = "trl_scale_rollout"  # a streamed choice's row of its group's rollout_func output
REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class GroupGeneration:
    """What a streamed `rollout_func` sees as the trainer's `vllm_generation`: TRL's `generate` for one prompt group's
    prompts, each unique prompt one request through the stream (no gathering across ranks: each rank's stream sends
    its own groups). Other attributes are the trainer's generation's (sampling settings, ...)."""

    def __init__(self, generation, send, dispatched):
        self._generation, self._send, self._dispatched = generation, send, dispatched
        self.newest = -1  # the newest weights any token it generated can come from

    def __getattr__(self, name: str):
        return getattr(self._generation, name)

    def generate(self, prompts, images=None, num_generations: int = 1, profiler=None):
        choices = []
        for index, ids in enumerate(prompts[::num_generations]):
            # the group's version is its first request's: later requests (its next turns) must not move it
            dispatched, self._dispatched = self._dispatched, None
            urls = image_urls(images[index * num_generations]) if images is not None else ()
            with_images = {"images": urls} if urls else {}  # rendered once for the request's G completions
            got, newest = self._send(list(ids), num_generations, dispatched, **with_images)
            self.newest = max(self.newest, newest)
            choices.extend(got)
        return generate_output(prompts, choices, *self._generation.turn_outputs(choices))

    def sync_weights(self) -> None:
        raise RuntimeError(
            "a streamed rollout_func called vllm_generation.sync_weights(): the trainer syncs between steps, and "
            "each group is trained within async_rollout_staleness syncs of its generation. Fix: drop the call"
        )


def rolling_out(trl):
    """The stream's `rollout` hook: the user's `rollout_func` for one group, on a view of the trainer (see module).
    The function is taken now: the step replaces TRL's attribute while it replays a batch, as the stream goes on."""
    function = trl.rollout_func

    def rollout(rows: list, send, dispatched) -> tuple[list[dict], int]:
        prompts = copy.deepcopy(multimodal_prompts(rows, row_images(rows)))  # as TRL's step builds them (a copy)
        generation = GroupGeneration(trl.vllm_generation, send, dispatched)
        output = function(prompts, trl.view(vllm_generation=generation))
        missing = sorted(set(REQUIRED) - set(output))
        if missing:
            raise ValueError(f"rollout_func must return keys {missing} in its output dict.")  # TRL's words
        for key in REQUIRED:
            if len(output[key]) != len(rows):
                raise ValueError(f"rollout_func returned {len(output[key])} {key} for a group of {len(rows)} rows")
        choices = [
            {
                "token_ids": list(output["completion_ids"][i]),
                ROLLOUT_KEY: {k: v[i] if isinstance(v, list) else v for k, v in output.items()},
            }
            for i in range(len(rows))
        ]
        return choices, generation.newest

    return rollout


@contextmanager
def replayed_rollouts(trl, streamed, state: StepState):
    """Within the block (a streamed batch's step), TRL's `rollout_func` call answers from the streamed groups' outputs,
    in the batch's row order, once (its record added to the build's `state.records`); the prompts asked for must be the
    batch's. Each extra key becomes one value per
    row (a group's scalar, broadcast by TRL, stays that group's)."""
    if trl.rollout_func is None or not streamed.choices or ROLLOUT_KEY not in streamed.choices[0]:
        yield
        return
    rows = [choice[ROLLOUT_KEY] for choice in streamed.choices]

    def replaying(restore):
        def replay(prompts, _trainer):
            if copy.deepcopy(prompts) != multimodal_prompts(streamed.rows, row_images(streamed.rows)):
                raise RuntimeError("streamed rollout_func: TRL asked for other prompts than the streamed batch's")
            restore()  # answers one call
            state.records.add(GeneratedBatch(tuple(streamed.spans)))  # TRL's rollout_func path calls no generate()
            return {key: [row[key] for row in rows] for key in rows[0]}

        return replay

    with trl.rollout_func_replaced(replaying):
        yield
