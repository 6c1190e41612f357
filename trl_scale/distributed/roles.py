"""The Ray backend as the trainer sees it: the critic, reward models and reference on their own role groups,
behind the interfaces the trainer already uses (`CriticUpdater`'s, a reward function, TRL's `ref_model` scoring).

The trainer never holds these models: it sends token ids (padding removed, as `UnpaddedRows`) or texts through
Ray's object store and gets scores, values, log-probs or update statistics back. With several trainer processes
(`accelerate launch`), only the main process starts and calls the groups: every rank's rows are gathered to it
(`main_process`), so the critic takes one optimizer step per micro-step, as the local backend's data-parallel
critic does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..scoring.packing import UnpaddedRows
from ..sharding.critic_sharding import read_optimizer_files, write_optimizer_files
from .main_process import call_on_main, run_on_main, start_on_main
from .ray_backend import Placement, RoleGroup, init_ray
from .role_workers import RoleRows


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


def _refuse_multimodal(multimodal_inputs: dict | None) -> None:
    """Role groups receive token rows only; image inputs would be dropped (PPOTrainer refuses them earlier)."""
    if multimodal_inputs:
        raise ValueError(
            f"a critic on a Ray role group does not take image inputs ({sorted(multimodal_inputs)}). Fix: "
            "backend='local' for vision-language PPO"
        )


class RayCritic:
    """The `CriticUpdater` interface, served by a critic role group held by the main trainer process.

    Every rank's rows are gathered to the main process, which splits each rank's rows over the group's workers.
    Each shard's loss is weighted by its share of its rank's tokens and by 1/num_ranks, and the workers average
    their gradients, so one worker step equals the local backend's update (every rank's critic averaging its
    gradients over the ranks)."""

    def __init__(self, group: RoleGroup | None):
        self.group = group  # None on every process but the main one
        self.scheduler = None  # set once the step count is known (the workers hold the real one)
        self.grad_norm = None  # the workers step the critic: not measured in the trainer

    def values(
        self, input_ids, attention_mask, prompt_len: int, num_tokens: int, multimodal_inputs: dict | None = None
    ) -> torch.Tensor:
        _refuse_multimodal(multimodal_inputs)
        piece = RoleRows(UnpaddedRows.from_padded(input_ids, attention_mask), prompt_len, num_tokens)
        return call_on_main(piece, lambda pieces: _per_row_forward(self.group, "values", pieces)).to(input_ids.device)

    def step_async(
        self,
        input_ids,
        attention_mask,
        prompt_len,
        old_values,
        returns,
        mask,
        train=True,
        multimodal_inputs=None,
        loss_scale: float = 1.0,
    ):
        """Start the critic's update on its group and return at once; `.result()` waits (bounded) for it, so the
        policy's update runs meanwhile. A collective: every rank calls it, then `.result()`, in the same order."""
        _refuse_multimodal(multimodal_inputs)
        piece = RoleRows(
            UnpaddedRows.from_padded(input_ids, attention_mask),
            prompt_len,
            mask.size(1),
            old_values.detach().cpu(),
            returns.detach().cpu(),
            mask.detach().cpu(),
            loss_scale,
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
            scale = piece.loss_scale * len(workers) / len(pieces)  # the trainer rank's weight, averaged over ranks
            shards.append([replace(p, loss_scale=w * scale) for p, w in zip(parts, shares)])
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
    def set_scheduler(self, scheduler_type: str, num_warmup_steps: int, num_training_steps: int, kwargs=None) -> None:
        args = (scheduler_type, num_warmup_steps, num_training_steps, kwargs)
        run_on_main(lambda: self.group.call_all("set_scheduler", *args))
        self.scheduler = True

    def state(self, with_weights: bool = True) -> dict | None:
        """The critic's state on the main process, None elsewhere. Replicas are identical: the first worker's.
        Sharded, gathering is a collective of all workers, and the first one holds the whole."""

        def fetch() -> dict:
            if self.group.settings.get("sharding", "replicated") == "replicated":
                return self.group.call("state", with_weights)
            return self.group.call_all("state", with_weights)[0]

        return run_on_main(fetch)

    def load_state(self, state: dict) -> None:
        run_on_main(lambda: self.group.call_all("load_state", state))

    def worker_shard_bytes(self) -> list[dict[str, int]] | None:
        """What each critic worker holds of the critic's parameters and AdamW state (main process; None elsewhere)."""
        return run_on_main(lambda: self.group.call_all("shard_bytes"))

    def shard_bytes(self) -> dict[str, int]:
        """The trainer processes hold nothing of a critic on its group."""
        return {"parameters": 0, "optimizer": 0}

    def weights(self) -> dict | None:
        state = self.state()
        return state["model"] if state is not None else None

    def save_training_state(self, directory: str, is_main_process: bool) -> None:
        """The workers' optimizer and scheduler, in the files a local replicated critic writes (not the weights:
        `save_model` fetched those for the same checkpoint)."""
        state = self.state(with_weights=False)
        if is_main_process:
            write_optimizer_files(directory, state["optimizer"], state["scheduler"])

    def load_training_state(self, directory: str, weights: dict) -> None:
        optimizer, scheduler = read_optimizer_files(directory)
        self.load_state({"model": weights, "optimizer": optimizer, "scheduler": scheduler})


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

    # One score per completion by construction: the trainer's reward-output checks leave it unwrapped, so the
    # trainer's `reward_funcs` keep this object (and its `group`).
    __trl_scale_checked__ = True

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
        # the seed of a new value head, as locally; FSDP2 needs the workers' process group, so only with several
        sharding = placement.sharding if placement.num_workers > 1 else "replicated"
        settings = {"updater": updater_settings, "seed": args.seed, "sharding": sharding}
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
