"""Optional Ray backend: the critic and reward models on their own role groups, behind the unchanged Trainer API.

A role group is a placement group of `num_workers` bundles (`num_gpus_per_worker` GPUs, `num_cpus_per_worker`
CPUs each) holding one actor per bundle. The trainer never holds these models: it sends token ids (padding
removed, as `UnpaddedRows`) or texts through Ray's object store and gets scores, values or update statistics back.
Every remote call has a timeout; a worker that dies or stalls is reported as an error naming its role (`RoleError`).

With several workers, a role is data parallel inside its group: rows are split over the workers, and the critic's
workers form their own torch.distributed group (gloo on CPU, NCCL on GPU) to average gradients.

With several trainer processes (`accelerate launch`), only the main process starts and calls the groups: every
rank's rows are gathered to it (`main_process`), so the critic takes one optimizer step per micro-step, as the
local backend's data-parallel critic does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers.utils import logging

from ..scoring.packing import UnpaddedRows
from .main_process import call_on_main, run_on_main, start_on_main

logger = logging.get_logger(__name__)


class RoleError(RuntimeError):
    """A role group's worker died, stalled past its timeout, or could not start."""

    def __init__(self, message: str, worker_died: bool = False):
        super().__init__(message)
        self.worker_died = worker_died


@dataclass
class Placement:
    num_workers: int = 1
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0

    @classmethod
    def from_config(cls, value: dict | None, field_name: str) -> Placement:
        value = dict(value or {})
        unknown = set(value) - {"num_workers", "num_gpus_per_worker", "num_cpus_per_worker"}
        if unknown:
            raise ValueError(
                f"{field_name} has unknown keys {sorted(unknown)}; use num_workers, "
                "num_gpus_per_worker, num_cpus_per_worker"
            )
        placement = cls(**value)
        if placement.num_workers < 1:
            raise ValueError(f"{field_name}.num_workers={placement.num_workers}: use at least 1")
        # GPUs are not checked here: on a cluster they may exist only on worker nodes. A placement the cluster
        # cannot satisfy fails as a RoleError when its placement group is not ready within ray_call_timeout.
        return placement


def init_ray(address: str | None = None) -> None:
    """Connect to `address`, or start a local cluster (token auth off for it: local tests, no network)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)


class _RoleWorker:
    """Runs inside a Ray actor: loads its model from a path and serves one role ('reward' or 'critic')."""

    def __init__(self, role: str, model_path: str, settings: dict):
        torch.set_num_threads(max(1, int(settings.get("num_threads", 1))))
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.role = role
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if role == "reference":
            self._load_reference(model_path, settings)
            return
        if role == "reward":
            model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1).to(self.device)
            self.tokenizer = AutoTokenizer.from_pretrained(settings.get("tokenizer_path") or model_path)
            model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling at the last non-pad token, as TRL
            model.eval()
            self.model = model
        else:
            from ..critic import CriticUpdater, load_critic

            critic = load_critic(model_path, settings["seed"]).to(self.device)
            self.updater = CriticUpdater(critic, **settings["updater"])

    def _load_reference(self, model_path: str, settings: dict) -> None:
        """The frozen reference policy, scored as TRL scores its `ref_model`: its fused log-prob head (and
        trl-scale's packed scoring when the trainer packs)."""
        from transformers import AutoModelForCausalLM
        from trl.trainer.utils import add_fused_lm_head

        from ..scoring import install_packed_scoring

        dtype = settings.get("dtype")
        dtype = getattr(torch, dtype) if dtype not in (None, "auto") else dtype
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=settings.get("attn_implementation")
        ).to(self.device)
        model.eval()
        temperature = settings.get("temperature", 1.0)
        add_fused_lm_head(
            model, temperature=temperature, cast_lm_head_to_fp32=settings.get("cast_lm_head_to_fp32", False)
        )
        self.padding_free = settings.get("padding_free", False)
        if self.padding_free:
            install_packed_scoring(
                model,
                temperature=temperature,
                outputs=(),
                token_budget=settings.get("token_budget"),
                logprob_chunk_size=settings.get("logprob_chunk_size", 256),
            )
        self.autocast_dtype = getattr(torch, settings["autocast_dtype"]) if settings.get("autocast_dtype") else None
        self.model = model

    def ping(self) -> str:
        return self.role

    def rendezvous_address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, rank: int, world_size: int, address: str, port: int) -> None:
        """Join the group's own process group and start from rank 0's weights."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        with torch.no_grad():
            for parameter in self.updater.critic.parameters():
                dist.broadcast(parameter.data, src=0)

    @torch.no_grad()
    def rewards(self, texts: list[str]) -> list[float]:
        if not texts:  # more workers than texts
            return []
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        return self.model(**inputs).logits[:, 0].float().cpu().tolist()

    @torch.no_grad()
    def logps(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        """Per-token log-probs of each row's last ``num_tokens`` tokens, as TRL's `_get_per_token_logps...`."""
        out = []
        for piece in pieces:
            if piece.rows.num_rows == 0:  # more workers than rows
                out.append(torch.zeros(0, piece.num_tokens))
                continue
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, : -piece.num_tokens] = -100
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                output = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True
                )
            out.append(output.log_probs[:, -piece.num_tokens :].float().cpu())
        return out

    def values(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        out = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            out.append(self.updater.values(input_ids, attention_mask, piece.prompt_len, piece.num_tokens).cpu())
        return out

    def step(self, pieces: list[RoleRows], train: bool) -> list[tuple[torch.Tensor, dict]]:
        """One micro-step of the critic over every piece (one per trainer rank): backward on each, then a single
        optimizer step at the end of the accumulation window."""
        results = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            old_values, returns, mask = (t.to(self.device) for t in (piece.old_values, piece.returns, piece.mask))
            loss, stats = self.updater.loss_and_backward(
                input_ids,
                attention_mask,
                piece.prompt_len,
                old_values,
                returns,
                mask,
                train=train,
                loss_scale=piece.loss_scale,
            )
            results.append((loss.cpu(), {k: v.cpu() for k, v in stats.items()}))
        if train:
            self.updater.end_micro_step()
        return results

    def set_scheduler(self, *args):
        self.updater.set_scheduler(*args)

    def state(self):
        return self.updater.state()

    def load_state(self, state):
        self.updater.load_state(state)


class RoleGroup:
    """One role's placement group and workers, with bounded remote calls.

    A stateless role (reward, reference) restarts a dead worker in its bundle and retries the call once, so a
    lost worker costs a reload, not the run. The critic's state (weights, optimizer) lives in its workers, so a dead
    critic worker stops the run with a `RoleError` naming the role; the last checkpoint resumes it.
    """

    STATELESS_ROLES = ("reward", "reference")

    def __init__(self, role: str, model_path: str, placement: Placement, settings: dict, timeout: float = 300.0):
        from ray.util.placement_group import placement_group

        self.role, self.timeout = role, timeout
        self.model_path, self.placement, self.settings = model_path, placement, settings
        self.restartable = role in self.STATELESS_ROLES
        bundle = {"CPU": placement.num_cpus_per_worker}
        if placement.num_gpus_per_worker:
            bundle["GPU"] = placement.num_gpus_per_worker
        self.placement_group = placement_group([bundle] * placement.num_workers, strategy="PACK")
        self._call(self.placement_group.ready(), "placement")
        self.workers = [self._start_worker(index) for index in range(placement.num_workers)]
        try:
            self._call([w.ping.remote() for w in self.workers], "start")
            if role == "critic" and len(self.workers) > 1:
                address, port = self._call(self.workers[0].rendezvous_address.remote(), "rendezvous")
                world = len(self.workers)
                refs = [w.init_process_group.remote(i, world, address, port) for i, w in enumerate(self.workers)]
                self._call(refs, "process group")
        except RoleError as error:
            raise RoleError(f"{role} group could not start its workers for {model_path!r}: {error}") from error

    def _start_worker(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(_RoleWorker).options(
            num_cpus=self.placement.num_cpus_per_worker,
            num_gpus=self.placement.num_gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index
            ),
            max_restarts=0,  # restarts are the group's decision (stateless roles only), not Ray's
        )
        return actor.remote(self.role, self.model_path, self.settings)

    @property
    def worker(self):
        return self.workers[0]

    def _call(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=self.timeout)
        except GetTimeoutError as error:
            raise RoleError(
                f"{self.role} group: {what} took longer than {self.timeout}s (ray_call_timeout)"
            ) from error
        except RayActorError as error:
            raise RoleError(f"{self.role} group: its worker died during {what}: {error}", worker_died=True) from error

    def call(self, method: str, *args):
        """`method` on the first worker (state, one-off queries)."""
        return self._call(getattr(self.worker, method).remote(*args), method)

    def call_all(self, method: str, *args):
        return self._call([getattr(w, method).remote(*args) for w in self.workers], method)

    def map(self, method: str, per_worker_args: list[tuple]) -> list:
        """`method` on every worker, each with its own arguments; a stateless role restarts dead workers and
        retries once."""

        def run():
            return self._call([getattr(w, method).remote(*a) for w, a in zip(self.workers, per_worker_args)], method)

        try:
            return run()
        except RoleError as error:
            if not (self.restartable and error.worker_died):
                raise
            restarted = self._restart_dead_workers()
            logger.warning(f"{self.role} group: restarted worker(s) {restarted} after: {error}. Retrying {method}.")
            return run()

    def _restart_dead_workers(self) -> list[int]:
        import ray
        from ray.exceptions import RayActorError

        restarted = []
        for index, worker in enumerate(self.workers):
            try:
                ray.get(worker.ping.remote(), timeout=self.timeout)
            except RayActorError:
                self.workers[index] = self._start_worker(index)
                restarted.append(index)
        self._call([self.workers[i].ping.remote() for i in restarted], "restart")
        return restarted

    def shutdown(self) -> None:
        """Kill the workers and free the placement group's resources (Ray keeps placement groups until removed)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is None:
            return
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self.placement_group)
        self.placement_group = None

    def __del__(self):
        try:
            import ray

            if ray.is_initialized():
                self.shutdown()
        except Exception:  # interpreter shutdown or a cluster already gone: nothing left to free
            pass


@dataclass
class RoleRows:
    """One trainer rank's rows for a role (or one worker's shard of them), as they cross the object store: the
    critic's values and update, the reference's log-probs. ``num_tokens`` completion tokens end each row's real
    tokens' span; ``old_values``, ``returns`` and ``mask`` (``[B, num_tokens]``) only for the critic's update."""

    rows: UnpaddedRows
    prompt_len: int
    num_tokens: int
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    loss_scale: float = 1.0

    def split(self, n: int) -> list[RoleRows]:
        rows = self.rows.split(n)
        if self.mask is None:
            return [replace(self, rows=r) for r in rows]
        parts = zip(rows, self.old_values.tensor_split(n), self.returns.tensor_split(n), self.mask.tensor_split(n))
        return [replace(self, rows=r, old_values=v, returns=g, mask=m) for r, v, g, m in parts]


def _per_row_forward(group: RoleGroup, method: str, pieces: list[RoleRows]) -> list[torch.Tensor]:
    """A row-wise forward (`method`) over every rank's piece: each piece's rows split over the group's workers,
    one call per worker, and each piece's rows put back together in order."""
    workers = group.workers
    shards = [piece.split(len(workers)) for piece in pieces]  # [piece][worker]
    per_worker = group.map(method, [([s[k] for s in shards],) for k in range(len(workers))])  # [worker][piece]
    return [torch.cat([outputs[p] for outputs in per_worker]) for p in range(len(pieces))]


class _MovedTo:
    """A pending result whose tensors land on `device` when it is collected."""

    def __init__(self, pending, device):
        self.pending, self.device = pending, device

    def result(self):
        loss, stats = self.pending.result()
        return loss.to(self.device), {k: v.to(self.device) for k, v in stats.items()}


class RayCritic:
    """The `CriticUpdater` interface, served by a critic role group held by the main trainer process.

    Every rank's rows are gathered to the main process, which splits each rank's rows over the group's workers.
    Each shard's loss is weighted by its share of its rank's tokens and by 1/num_ranks, and the workers average
    their gradients, so one worker step equals the local backend's update (every rank's critic averaging its
    gradients over the ranks)."""

    def __init__(self, group: RoleGroup | None):
        self.group = group  # None on every process but the main one
        self.scheduler = None  # mirrors CriticUpdater: set once the step count is known

    def values(self, input_ids, attention_mask, prompt_len: int, num_tokens: int) -> torch.Tensor:
        piece = RoleRows(UnpaddedRows.from_padded(input_ids, attention_mask), prompt_len, num_tokens)
        return call_on_main(piece, self._values).to(input_ids.device)

    def _values(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        return _per_row_forward(self.group, "values", pieces)

    def step_async(self, input_ids, attention_mask, prompt_len, old_values, returns, mask, train=True):
        """Start the critic's update on its group and return at once; `.result()` waits (bounded) for it, so the
        policy's update runs meanwhile. A collective: every rank calls it, then `.result()`, in the same order."""
        piece = RoleRows(
            UnpaddedRows.from_padded(input_ids, attention_mask),
            prompt_len,
            mask.size(1),
            old_values.detach().cpu(),
            returns.detach().cpu(),
            mask.detach().cpu(),
        )
        pending = start_on_main(piece, lambda pieces: self._start_step(pieces, train))
        return _MovedTo(pending, input_ids.device)

    def _start_step(self, pieces: list[RoleRows], train: bool):
        workers = self.group.workers
        shards, weights = [], []
        for piece in pieces:
            parts = piece.split(len(workers))
            total = piece.mask.sum().clamp(min=1.0).item()
            shares = [part.mask.sum().item() / total for part in parts]
            shards.append([replace(p, loss_scale=w * len(workers) / len(pieces)) for p, w in zip(parts, shares)])
            weights.append(shares)
        refs = [worker.step.remote([s[k] for s in shards], train) for k, worker in enumerate(workers)]

        def finish() -> list[tuple[torch.Tensor, dict]]:
            per_worker = self.group._call(refs, "step")  # [worker][piece] -> (loss, stats)
            results = []
            for p, shares in enumerate(weights):
                parts = [per_worker[k][p] for k in range(len(workers))]
                loss = sum(w * part[0] for w, part in zip(shares, parts))
                stats = {key: sum(w * part[1][key] for w, part in zip(shares, parts)) for key in parts[0][1]}
                results.append((loss, stats))
            return results

        return finish

    def step(self, *args, **kwargs):
        return self.step_async(*args, **kwargs).result()

    # Called on every rank; only the main process talks to the group, and its errors reach every rank.
    def set_scheduler(self, *args) -> None:
        run_on_main(lambda: self.group.call_all("set_scheduler", *args))
        self.scheduler = True

    def state(self) -> dict | None:
        """The critic's state on the main process (workers hold identical weights), None elsewhere."""
        return run_on_main(lambda: self.group.call("state"))

    def load_state(self, state: dict) -> None:
        run_on_main(lambda: self.group.call_all("load_state", state))


class RayReference:
    """The reference policy on its own role group, standing in for TRL's `ref_model`: the trainer's scoring call
    for the reference (`_get_per_token_logps_and_entropies(self.ref_model, ...)`) comes here. A collective across
    trainer ranks, like the critic's values."""

    def __init__(self, group: RoleGroup | None):
        self.group = group  # None on every process but the main one

    def logps(self, input_ids, attention_mask, logits_to_keep: int) -> torch.Tensor:
        rows = UnpaddedRows.from_padded(input_ids, attention_mask)
        piece = RoleRows(rows, input_ids.size(1) - logits_to_keep, logits_to_keep)
        return call_on_main(piece, lambda pieces: _per_row_forward(self.group, "logps", pieces)).to(input_ids.device)


class RayRewardModel:
    """A reward model on its own role group, as a TRL reward function: texts in, one score per completion out.
    Texts are built as TRL builds them for a local reward model (chat template for conversations, else
    prompt + completion), and tokenized by the worker with the model's own tokenizer. A collective across trainer
    ranks: the main process scores every rank's texts in one call."""

    def __init__(self, group: RoleGroup | None, name: str, chat_tokenizer=None):
        self.group, self.__name__, self.chat_tokenizer = group, name, chat_tokenizer

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if prompts and isinstance(prompts[0], list):
            texts = [
                self.chat_tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        return call_on_main(texts, self._score)

    def _score(self, texts_per_rank: list[list[str]]) -> list[list[float]]:
        texts = [text for rank_texts in texts_per_rank for text in rank_texts]
        n = len(self.group.workers)
        results = self.group.map("rewards", [(texts[i::n],) for i in range(n)])
        scores = [0.0] * len(texts)
        for i, shard_scores in enumerate(results):
            scores[i::n] = shard_scores
        out, offset = [], 0
        for rank_texts in texts_per_rank:
            out.append(scores[offset : offset + len(rank_texts)])
            offset += len(rank_texts)
        return out


def _saved_model_dir(model, prefix: str) -> str:
    """A directory holding `model` (a path is returned as is; an object is saved to a temporary directory)."""
    if isinstance(model, str):
        return model
    import tempfile

    directory = tempfile.mkdtemp(prefix=prefix)
    model.save_pretrained(directory)
    return directory


def start_critic(model_source: Callable[[], Any], updater_settings: dict, args, check=None) -> RayCritic:
    """The critic group for a trainer with ``args`` (its `DistributedArguments`), started by the main process from
    ``model_source()`` (a path or a model object, built there only; ``check(path)`` validates it first). Every rank
    gets a `RayCritic`; a failure to start reaches every rank."""

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        path = _saved_model_dir(model_source(), "trl-scale-critic-")
        if check is not None:
            check(path)
        placement = Placement.from_config(args.critic_placement, "critic_placement")
        settings = {"updater": updater_settings, "seed": args.seed}  # the seed of a new value head, as locally
        return RoleGroup("critic", path, placement, settings, timeout=args.ray_call_timeout)

    return RayCritic(run_on_main(start))


def start_reward_model(model, args) -> RayRewardModel:
    """A reward model entry of `reward_funcs` (path or object) served by its own group, under the name TRL would
    give it locally."""
    from transformers import AutoTokenizer

    # TRL loads a reward model's tokenizer from its name or path; an object carries that in its config.
    source = model if isinstance(model, str) else model.config._name_or_path
    name = source.rstrip("/").split("/")[-1]

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        path = _saved_model_dir(model, "trl-scale-reward-")
        placement = Placement.from_config(args.reward_placement, "reward_placement")
        settings = {"tokenizer_path": source}
        return RoleGroup("reward", path, placement, settings, timeout=args.ray_call_timeout)

    return RayRewardModel(run_on_main(start), name, AutoTokenizer.from_pretrained(source))


def start_reference(model_path: str, settings: dict, args) -> RayReference:
    """The reference group, started by the main process from the policy's path (as TRL reloads its reference);
    ``settings``: dtype, attn_implementation, temperature, cast_lm_head_to_fp32, padding_free, token_budget,
    logprob_chunk_size, autocast_dtype."""

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        placement = Placement.from_config(args.reference_placement, "reference_placement")
        return RoleGroup("reference", model_path, placement, settings, timeout=args.ray_call_timeout)

    return RayReference(run_on_main(start))
