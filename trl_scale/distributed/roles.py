"""The Ray backend as the trainer sees it: reward models and the reference on their own role groups, behind the
interfaces the trainer already uses (a reward function, TRL's `ref_model` scoring); the critic's group is the
critic package's (`critic.ray.RayCritic`), built on the helpers here.

The trainer never holds these models: it sends token ids (padding removed, as `UnpaddedRows`) or texts through
Ray's object store and gets scores, values, log-probs or update statistics back. With several trainer processes
(`accelerate launch`), only the main process starts and calls the groups: every rank's rows are gathered to it
(`main_process`), so the critic takes one optimizer step per micro-step, as the local backend's data-parallel
critic does.
"""

from __future__ import annotations

import torch

from ..scoring.packing import UnpaddedRows
from .main_process import call_on_main, run_on_main
from .ray_backend import RoleGroup, init_ray
from .role_workers import ReferenceWorkerSettings, RewardWorkerSettings, RoleRows
from .row_images import RowImages


def per_row_forward(group: RoleGroup, method: str, pieces: list[RoleRows]) -> list[torch.Tensor]:
    """A row-wise forward (`method`) over every rank's piece: each piece's rows split over the group's workers,
    one call per worker, and each piece's rows put back together in order."""
    workers = group.workers
    shards = [piece.split(len(workers)) for piece in pieces]  # [piece][worker]
    per_worker = group.map(method, [([s[k] for s in shards],) for k in range(len(workers))])  # [worker][piece]
    return [torch.cat([outputs[p] for outputs in per_worker]) for p in range(len(pieces))]


class RayReference:
    """The reference policy on its own role group, standing in for TRL's `ref_model`: the trainer's scoring call
    for the reference (`_get_per_token_logps_and_entropies(self.ref_model, ...)`) comes here. A collective across
    trainer ranks, like the critic's values."""

    def __init__(self, group: RoleGroup | None):
        self.group = group  # None on every process but the main one

    def logps(self, input_ids, attention_mask, logits_to_keep: int, images: RowImages | None = None) -> torch.Tensor:
        """The reference's log-probs of each row's last `logits_to_keep` tokens; `images`: the rows' image inputs
        (each worker gets its rows' own)."""
        rows = UnpaddedRows.from_padded(input_ids, attention_mask)
        piece = RoleRows(rows, input_ids.size(1) - logits_to_keep, logits_to_keep, images=images)
        return call_on_main(piece, lambda pieces: per_row_forward(self.group, "logps", pieces)).to(input_ids.device)


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


def saved_model_dir(model, prefix: str) -> str:
    """A directory holding `model` (a path is returned as is; an object is saved to a temporary directory)."""
    if isinstance(model, str):
        return model
    import tempfile

    directory = tempfile.mkdtemp(prefix=prefix)
    model.save_pretrained(directory)
    return directory


def start_reward_model(model, args) -> RayRewardModel:
    """A reward model entry of `reward_funcs` (path or object) served by its own group, under the name TRL would
    give it locally."""
    from transformers import AutoTokenizer

    # TRL loads a reward model's tokenizer from its name or path; an object carries that in its config.
    source = model if isinstance(model, str) else model.config._name_or_path
    name = source.rstrip("/").split("/")[-1]

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        path = saved_model_dir(model, "trl-scale-reward-")
        settings = RewardWorkerSettings(tokenizer_path=source)
        return RoleGroup("reward", path, args.placement("reward"), settings, timeout=args.ray_call_timeout)

    return RayRewardModel(run_on_main(start), name, AutoTokenizer.from_pretrained(source))


def start_reference(model_path: str, settings: ReferenceWorkerSettings, args) -> RayReference:
    """The reference group, started by the main process from the policy's path (as TRL reloads its reference)."""

    def start() -> RoleGroup:
        init_ray(args.ray_address)
        return RoleGroup("reference", model_path, args.placement("reference"), settings, timeout=args.ray_call_timeout)

    return RayReference(run_on_main(start))
