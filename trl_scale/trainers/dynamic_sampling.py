"""Dynamic sampling wired into TRL's online step (see `trl_scale.rollout.dynamic_sampling`).

TRL's `_generate_and_score_completions` generates, scores and computes advantages in one call, over the rows it is
given. With dynamic sampling on, the rows are generated and their rewards computed first, in rounds (the batch's own
rows, then top-ups while groups are missing and the budget allows); the chosen groups' rows then go through TRL's
step, which is answered from what the rounds produced (`_generate` and `_calculate_rewards` are served, not run
again), so advantages, old and reference log-probs, metrics and the completions table are TRL's, over the chosen
rows. Every process runs the same rounds of the same size (TRL's generation and rewards gather across processes).
"""

from __future__ import annotations

import json
import math
import os

import torch

from ..logs import get_logger
from ..rollout.dynamic_sampling import CandidateRows, TopUpPrompts, choose_groups, groups_with_signal
from ..sharding.data_parallel import writes_group_files

logger = get_logger(__name__)

TOP_UP_STATE_NAME = "dynamic_sampling_rank{rank}.json"
# What the generation backend records per completion of its last call and the step reads after it (version spans
# for the streaming metrics; sampler log-probs for RLOO's correction): kept with each candidate row.
GENERATION_PER_ROW = ("last_versions", "last_version_spans", "last_sampler_logprobs")


class DynamicSamplingMixin:
    """Drops zero-variance prompt groups and tops the generation batch up (`dynamic_sampling=True`)."""

    _served: CandidateRows | None = None  # the chosen rows TRL's step is answered from
    _top_up: TopUpPrompts | None = None
    _top_up_drawn_at_resume = 0
    _warned_dynamic_budget = False

    @property
    def dynamic_sampling(self) -> bool:
        return bool(getattr(self.args, "dynamic_sampling", False)) and self.model.training

    def _check_dynamic_sampling(self) -> None:
        """Construction-time refusals (each names the fix)."""
        args = self.args
        if not getattr(args, "dynamic_sampling", False):
            return
        if getattr(self, "environment_factories", None) is not None:
            raise ValueError(
                "dynamic_sampling=True generates extra prompt groups outside TRL's step, but environment_factory "
                "rollouts reset their environments inside it. Fix: dynamic_sampling=False"
            )
        if self.num_generations < 2:  # PPO's default: one completion per prompt
            raise ValueError(
                f"dynamic_sampling=True drops prompt groups whose completions all get the same reward; with "
                f"num_generations={self.num_generations} there is no group. Fix: num_generations >= 2, or "
                "dynamic_sampling=False"
            )
        rows = args.per_device_train_batch_size * args.steps_per_generation
        if rows % self.num_generations:
            raise ValueError(
                f"dynamic_sampling=True drops and adds whole prompt groups per process, but this process's "
                f"generation batch of {rows} rows (per_device_train_batch_size x steps_per_generation) does not hold "
                f"whole groups of num_generations={self.num_generations}. Fix: make per_device_train_batch_size x "
                "steps_per_generation a multiple of num_generations"
            )

    # ---- the rounds ------------------------------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs):
        if not self.dynamic_sampling:
            return super()._generate_and_score_completions(inputs)
        self._served = self._dynamically_sampled(inputs)
        try:
            return super()._generate_and_score_completions(self._served.rows)
        finally:
            self._served = None

    def _dynamically_sampled(self, inputs: list) -> CandidateRows:
        """The rows to train: this batch's groups with a signal, topped up while some process lacks groups and the
        budget allows, filled with groups without a signal when it does not."""
        size = self.num_generations
        needed = len(inputs) // size
        budget = max(needed, math.floor(self.args.dynamic_sampling_max_oversampling * needed))
        rounds = [self._candidate_round(inputs)]
        signal = self._signal(rounds[0])
        generated = needed
        while True:
            missing = torch.tensor([max(0, needed - sum(signal))], device=self.accelerator.device)
            more = min(int(self.accelerator.gather(missing).max().item()), budget - generated)
            if more <= 0:  # every process has its groups (or the budget is spent): the same decision everywhere
                break
            rounds.append(self._top_up_round(more * size))
            signal += self._signal(rounds[-1])
            generated += more
        groups, filled = choose_groups(signal, needed)
        self._log_dynamic_sampling(needed, generated, sum(not has for has in signal), filled)
        return CandidateRows.joined(rounds).select([g * size + j for g in groups for j in range(size)])

    def _top_up_round(self, num_rows: int) -> CandidateRows:
        """New groups generated now (a synchronous run); streaming rollout takes them from the stream instead."""
        return self._candidate_round(self._top_up_rows(num_rows))

    def _top_up_rows(self, num_rows: int) -> list[dict]:
        if self._top_up is None:
            self._top_up = TopUpPrompts(
                self.train_dataset, self.num_generations, self.args.seed, self.accelerator.process_index
            )
            self._top_up.drawn = self._top_up_drawn_at_resume
        return self._top_up.draw(num_rows // self.num_generations)

    def _candidate_round(self, rows: list) -> CandidateRows:
        """`rows` generated (TRL's `_generate`, whatever the backend) and scored (TRL's `_calculate_rewards`), kept
        row by row."""
        prompts = [row["prompt"] for row in rows]
        generated = self._generate(prompts)
        if len(generated) == 8:  # GRPO (and PPO): ids, completion ids, tool mask, completions, logprobs, extra, ...
            completion_ids, completions, extra_fields = generated[1], generated[3], generated[5]
        elif len(generated) == 3:  # RLOO: prompt ids, completion ids, completions
            completion_ids, completions, extra_fields = generated[1], generated[2], {}
        else:
            raise RuntimeError(
                f"dynamic sampling: TRL's _generate returned {len(generated)} values, not the 8 (GRPO) or 3 (RLOO) "
                "trl-scale was built on (see trl_scale/seams)"
            )
        for i, row in enumerate(rows):  # as TRL merges a rollout_func's extra fields before the rewards
            row.update({key: values[i] for key, values in extra_fields.items() if isinstance(values, list)})
        # TRL's own reward computation (below trl-scale's checks, which run on the served rewards of the chosen rows)
        gathered = super()._calculate_rewards(rows, prompts, completions, completion_ids)
        start = self.accelerator.process_index * len(rows)
        per_row = {f"extra:{column}": list(values) for column, values in self._pending_extra_logs.items()}
        self._pending_extra_logs.clear()  # the chosen rows' columns are handed to TRL's step again
        backend = getattr(self, "vllm_generation", None)
        for name in GENERATION_PER_ROW:
            values = getattr(backend, name, None)
            if isinstance(values, list) and len(values) == len(rows):
                per_row[f"generation:{name}"] = list(values)
        return CandidateRows(rows, tuple(generated), gathered[start : start + len(rows)], per_row)

    def _signal(self, candidates: CandidateRows) -> list[bool]:
        return groups_with_signal(candidates.rewards, self.reward_weights, self.num_generations).tolist()

    def _log_dynamic_sampling(self, needed: int, generated: int, without_signal: int, filled: int) -> None:
        metrics = self._metrics["train"]
        gather = self.accelerator.gather
        counts = gather(torch.tensor([[needed, generated, without_signal, filled]], device=self.accelerator.device))
        needed_all, generated_all, dropped_all, filled_all = counts.sum(0).tolist()
        metrics["dynamic_sampling/groups_dropped"].append(dropped_all / generated_all)
        metrics["dynamic_sampling/oversampling"].append(generated_all / needed_all)
        metrics["dynamic_sampling/filled_without_signal"].append(filled_all / needed_all)
        if filled_all and not self._warned_dynamic_budget and self.accelerator.is_main_process:
            self._warned_dynamic_budget = True
            logger.warning(
                f"dynamic sampling: after {generated_all} groups (dynamic_sampling_max_oversampling="
                f"{self.args.dynamic_sampling_max_oversampling} x {needed_all}) only {needed_all - filled_all} had "
                f"rewards that differ; the batch is filled with {filled_all} without (zero advantage). Raise "
                "dynamic_sampling_max_oversampling, or make the task's rewards finer. Said once; "
                "dynamic_sampling/filled_without_signal logs it every step."
            )

    # ---- TRL's step, answered from the chosen rows -----------------------------------------------------------

    def _generate(self, prompts):
        served = self._served
        if served is None:
            return super()._generate(prompts)
        if list(prompts) != [row["prompt"] for row in served.rows]:
            raise RuntimeError(
                "dynamic sampling: TRL asked for completions of other prompts than the chosen rows': TRL's hook order "
                "is not the one trl-scale was built on (see trl_scale/seams)"
            )
        backend = getattr(self, "vllm_generation", None)
        for name in GENERATION_PER_ROW:
            if f"generation:{name}" in served.per_row:
                setattr(backend, name, served.per_row[f"generation:{name}"])
        return served.generated

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        served = self._served
        if served is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        for key, values in served.per_row.items():
            if key.startswith("extra:"):
                self._pending_extra_logs[key.removeprefix("extra:")].extend(values)
        return self.accelerator.gather(served.rewards)

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._top_up is not None and writes_group_files(self.accelerator):
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, TOP_UP_STATE_NAME.format(rank=self.accelerator.process_index))
            with open(path, "w") as f:
                json.dump({"drawn": self._top_up.drawn}, f)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, TOP_UP_STATE_NAME.format(rank=self.accelerator.process_index))
        if os.path.isfile(path):
            with open(path) as f:
                self._top_up_drawn_at_resume = json.load(f)["drawn"]
            self._top_up = None
