"""Routing replay (`routing_replay=True`) as a trainer feature: the routes each completion's server chose (vLLM's
`routed_experts`, on the batch's record) go into a book by sequence as the batch is generated, before TRL scores it;
the policy's (and a separate reference model's) MoE routers take them in every forward of those tokens
(`scoring/routing_replay.py`); `routing/agreement` logs the share of (token, layer) whose trainer-chosen experts
were the sampler's, over the forwards since the last log."""

from __future__ import annotations

import torch

from ..errors import RolloutError
from ..scoring.routing_replay import RouteBook, RouteReplay
from .feature import Feature


class RoutingReplay(Feature):
    """Server rollout of an MoE policy with `routing_replay=True`."""

    name = "routing_replay"

    def __init__(self):
        self.book = RouteBook()
        self.replays: list[RouteReplay] = []
        # the step state whose records were booked last, and how many of them (a record is booked once: the records
        # of a build only grow; the tool loop's fold replaces the newest with a first-turn record already booked)
        self._booked: tuple[object, int] = (None, 0)

    @classmethod
    def build(cls, plan) -> RoutingReplay | None:
        return cls() if plan.routing_replay and plan.rollout.server else None

    def setup(self, run) -> None:
        from accelerate.utils import is_peft_model

        trl = run.trl
        policy = trl.accelerator.unwrap_model(trl.model)
        if is_peft_model(policy):  # the adapter off is the reference: the same routers, the same hooks
            policy = policy.get_base_model()
        self.replays.append(RouteReplay(policy, self.book))
        reference = trl.ref_model
        if isinstance(reference, torch.nn.Module):  # a Ray group's handle scores elsewhere
            self.replays.append(RouteReplay(trl.accelerator.unwrap_model(reference), self.book))

    def generate(self, run, proceed, *args, **kwargs):
        output = proceed(*args, **kwargs)
        self._book(run.step)
        return output

    def tool_call_loop(self, run, proceed, *args, **kwargs):
        """TRL's tool loop sends a conversation's later turns as requests of their own (each turn's prompt the whole
        conversation so far, so its routes cover the sequence TRL scores): booked here, before the rollout's own
        hook folds the loop's records into the batch's first-turn record."""
        output = proceed(*args, **kwargs)
        self._book(run.step)
        return output

    def _book(self, state) -> None:
        """The routes of the build's records not booked yet; a record without them names its servers."""
        records = state.records.all()
        state_booked, count = self._booked
        new = records[count:] if state_booked is state else records
        self._booked = (state, len(records))
        missing, total = set(), 0
        for record in new:
            routes = record.routes or (None,) * len(record)
            servers = record.servers or (None,) * len(record)
            missing.update(str(url) for url, known in zip(servers, routes) if known is None)
            total += sum(known is None for known in routes)
            for known in record.routes:
                if known is not None:
                    self.book.add(list(known[0]), known[1])
        if missing:
            raise RolloutError(
                f"routing_replay=True, but {sorted(missing)} returned no routes for {total} completions. Fix: start "
                "each server with --enable-return-routed-experts (vLLM: with its V2 model runner, "
                "VLLM_USE_V2_MODEL_RUNNER=1; trl-scale serve takes the same flag), or routing_replay=False"
            )

    def log(self, run, logs: dict[str, float]) -> None:
        matched = sum(replay.agreement.matched for replay in self.replays)
        compared = sum(replay.agreement.compared for replay in self.replays)
        if compared:
            logs["routing/agreement"] = matched / compared
            logs["routing/replayed_token_layers"] = float(compared)
        rows = sum(replay.agreement.rows for replay in self.replays)
        if rows:  # a training row whose sequence no server's routes cover (a streamed tool conversation) keeps its own
            logs["routing/rows_without_routes"] = sum(r.agreement.rows_without_routes for r in self.replays) / rows
        for replay in self.replays:
            replay.agreement = type(replay.agreement)()
