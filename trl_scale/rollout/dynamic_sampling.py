"""Dynamic sampling (DAPO's): a prompt group whose completions all get the same reward (all right or all wrong) has
zero advantage under a group baseline and teaches nothing, so it is dropped and the generation batch is topped up
with new groups until it holds only groups with a signal, or until `dynamic_sampling_max_oversampling` times its
groups have been generated (then it trains on what there is: the missing groups are filled with dropped ones,
whose advantages are zero, and a warning says so once).

The parts here know nothing of the trainer: which groups have a signal (`groups_with_signal`), which to train
(`choose_groups`), the generated rows kept row by row so the chosen ones can be handed to TRL's step
(`CandidateRows`), and where new prompts come from in a synchronous run (`TopUpPrompts`). The trainer's wiring
(`trl_scale.trainers.dynamic_sampling`) runs the rounds; with streaming rollout the top-up comes from the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numbers import check_field_types, check_number


@dataclass
class DynamicSamplingArguments:
    """Config fields of dynamic sampling (GRPO, RLOO, PPO; any generation backend; synchronous or asynchronous)."""

    FIELDS_DOC = """
    > Dynamic sampling

    dynamic_sampling (`bool`, defaults to `False`):
        Drop the prompt groups whose rewards are all equal (zero variance: zero advantage, no gradient) and top the
        generation batch up with new groups, as DAPO does (huggingface/trl#3708). Rewards are the weighted sum of the
        reward functions, as the advantages use them. A synchronous run draws the new prompts from the training
        dataset in its own seeded order (resumed from checkpoints); streaming rollout takes the next finished groups
        of the stream. Needs `num_generations ≥ 2` and whole groups per process (`per_device_train_batch_size ×
        steps_per_generation` a multiple of `num_generations`).
    dynamic_sampling_max_oversampling (`float`, defaults to `3.0`):
        The most groups generated for one generation batch, as a multiple of the groups it trains. When that many
        have been generated and too few had a signal, the batch is filled with dropped groups (zero advantage) and a
        warning says so once. Metrics: `dynamic_sampling/groups_dropped` (fraction of the groups generated),
        `dynamic_sampling/oversampling` (groups generated / groups trained), `dynamic_sampling/filled_without_signal`
        (fraction of the trained groups that had none).
    """

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Drop prompt groups whose rewards all equal (zero advantage) and top the batch up with new "
            "groups (DAPO's dynamic sampling)."
        },
    )
    dynamic_sampling_max_oversampling: float = field(
        default=3.0,
        metadata={
            "help": "The most groups generated per generation batch, as a multiple of the groups it trains; then the "
            "batch is filled with dropped groups (zero advantage), with a warning once."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        check_number(
            "dynamic_sampling_max_oversampling",
            self.dynamic_sampling_max_oversampling,
            minimum=1,
            fix="it is the most groups generated per batch as a multiple of the groups trained, so a number >= 1 "
            "(e.g. 3)",
        )
        check_field_types(self, DynamicSamplingArguments)


def groups_with_signal(rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """One bool per group of `group_size` consecutive rows: are its rewards (weighted sum over the reward functions,
    as the advantages use them) not all equal? Equal within `torch.isclose`, TRL's test for `frac_reward_zero_std`."""
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    std = rewards.view(-1, group_size).std(dim=1)
    return ~torch.isclose(std, torch.zeros_like(std))


def choose_groups(signal: list[bool], needed: int) -> tuple[list[int], int]:
    """The groups to train, in generation order: the first `needed` with a signal; if there are fewer, the first
    groups without one fill the rest. Returns (group indices, how many of them have no signal)."""
    with_signal = [i for i, has in enumerate(signal) if has][:needed]
    missing = needed - len(with_signal)
    fill = [i for i, has in enumerate(signal) if not has][:missing]
    if len(fill) < missing:
        raise ValueError(f"{len(signal)} groups generated, {needed} needed")
    return sorted(with_signal + fill), len(fill)


def _rows_of(value, indices: list[int], count: int):
    """`value` (one of TRL's per-row results) at `indices`: a list with one entry per row is indexed, a dict of such
    lists is indexed per key, anything else (None, an empty list: no tool images) is kept."""
    if isinstance(value, list) and len(value) == count:
        return [value[i] for i in indices]
    if isinstance(value, dict):
        return {key: _rows_of(item, indices, count) for key, item in value.items()}
    return value


def _joined(parts: list):
    """The per-row results of several rounds, one after another (as `_rows_of` reads them)."""
    first = parts[0]
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if isinstance(first, dict):
        return {key: _joined([part[key] for part in parts]) for key in first}
    return first


@dataclass
class CandidateRows:
    """Rows generated and scored for one generation batch, row by row: the trainer's rows, what TRL's `_generate`
    returned for them, their rewards (this process's rows, every reward function) and what else the step reads per
    row (`per_row`: the reward functions' `log_extra` columns, the generation's version spans and sampler
    log-probs)."""

    rows: list
    generated: tuple
    rewards: torch.Tensor
    per_row: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, indices: list[int]) -> CandidateRows:
        n = len(self.rows)
        return CandidateRows(
            rows=[self.rows[i] for i in indices],
            generated=tuple(_rows_of(value, indices, n) for value in self.generated),
            rewards=self.rewards[indices],
            per_row=_rows_of(self.per_row, indices, n),
        )

    @staticmethod
    def joined(parts: list[CandidateRows]) -> CandidateRows:
        """One after another. A per-row field some rounds lack (a `log_extra` column one round wrote) is None on
        their rows."""
        keys = sorted({key for part in parts for key in part.per_row})
        per_row = {key: [v for part in parts for v in part.per_row.get(key, [None] * len(part))] for key in keys}
        return CandidateRows(
            rows=[row for part in parts for row in part.rows],
            generated=tuple(_joined([part.generated[i] for part in parts]) for i in range(len(parts[0].generated))),
            rewards=torch.cat([part.rewards for part in parts]),
            per_row=per_row,
        )


class TopUpPrompts:
    """New prompt groups for a synchronous run's top-up, drawn from the training dataset: each epoch a permutation
    of its rows seeded by (seed, epoch, process), each row `group_size` times (as TRL's sampler repeats a prompt).
    Independent of the trainer's own sampler, whose order and epochs it leaves as they are; `drawn` is saved with
    checkpoints, and a resume draws on from there."""

    def __init__(self, dataset, group_size: int, seed: int, process_index: int):
        if len(dataset) == 0:
            raise ValueError("dynamic sampling draws new prompts from the training dataset, which is empty")
        self.dataset = dataset
        self.group_size = group_size
        self.seed = seed
        self.process_index = process_index
        self.drawn = 0  # groups drawn so far
        self._order: tuple[int, list[int]] | None = None  # (epoch, its permutation)

    def _index(self, draw: int) -> int:
        epoch, position = divmod(draw, len(self.dataset))
        if self._order is None or self._order[0] != epoch:
            # arithmetic, not hash(): the same order in every process and every resume
            seed = (self.seed * 1_000_003 + epoch * 7_919 + self.process_index * 104_729 + 0x70F) % 2**63
            order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(seed)).tolist()
            self._order = (epoch, order)
        return self._order[1][position]

    def draw(self, groups: int) -> list[dict]:
        rows = []
        for _ in range(groups):
            row = self.dataset[self._index(self.drawn)]
            rows.extend(dict(row) for _ in range(self.group_size))
            self.drawn += 1
        return rows
