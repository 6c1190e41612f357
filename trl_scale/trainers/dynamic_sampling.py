"""Dynamic sampling wired into TRL's online step (see `trl_scale.rollout.dynamic_sampling`).

TRL's `_generate_and_score_completions` generates, scores and computes advantages in one call, over the rows it is
given. With dynamic sampling on, the rows are generated and their rewards computed first, in rounds (the batch's own
rows, then top-ups while groups are missing and the budget allows); the chosen groups' rows then go through TRL's
step, which is answered from what the rounds produced (`_generate` and `_calculate_rewards` are served from the
chosen rows, handed over once each, not run again), so advantages, old and reference log-probs, metrics and the
completions table are TRL's, over the chosen rows. Every process runs the same rounds of the same size (TRL's
generation and rewards gather across processes).
"""

from __future__ import annotations

import math

import torch

from ..logs import get_logger
from ..rollout.dynamic_sampling import CandidateRows, TopUpPrompts, choose_groups, groups_with_signal
from ..rollout.record import GeneratedBatch
from .feature import Feature

logger = get_logger(__name__)

# Each candidate row keeps its completion's part of the rollout's record (`rollout.record`: version spans for the
# streaming metrics, sampler log-probs for RLOO's correction); the chosen rows' parts make the step's record.
RECORD_ROW = "generation:record"


class DynamicSampling(Feature):
    """Drops zero-variance prompt groups and tops the generation batch up (`dynamic_sampling=True`)."""

    name = "dynamic_sampling"
    STEPS_ASIDE = {"generate_and_score": "on an evaluation batch (TRL's own)"}

    @classmethod
    def build(cls, plan) -> DynamicSampling | None:
        rollout = plan.rollout
        if not plan.dynamic_sampling:
            return None
        return cls(rollout.server, rollout.takes_groups, rollout.environments, bool(rollout.asynchronous.staleness))

    def __init__(
        self, server: bool = False, streamed: bool = False, environments: bool = False, asynchronous: bool = False
    ):
        self.server = server  # trl-scale's client generates: its records follow the rows
        self.asynchronous = asynchronous  # async_rollout_staleness >= 1
        self.streamed = streamed  # the step's rows are finished prompt groups from the stream: top-ups join it
        self.environments = environments  # TRL's environment_factory
        self.top_up: TopUpPrompts | None = None
        self.drawn_at_resume = 0
        self.warned_budget = False

    @staticmethod
    def active(trl) -> bool:
        return trl.model.training  # built only with dynamic_sampling=True; evaluation batches stay TRL's

    def check(self, run) -> None:
        """Construction-time refusals (each names the fix)."""
        args = run.trl.args
        if self.environments and not self.asynchronous:
            raise ValueError(
                "dynamic_sampling=True with environment_factory and synchronous rollout: the top-up rounds generate "
                "outside TRL's step, which is where it resets the environments. Fix: async_rollout_staleness=1 (or "
                "more; the stream runs each group's episode, a top-up's too), or dynamic_sampling=False"
            )
        size = run.trl.num_generations
        if size < 2:  # PPO's default: one completion per prompt
            raise ValueError(
                f"dynamic_sampling=True drops prompt groups whose completions all get the same reward; with "
                f"num_generations={size} there is no group. Fix: num_generations >= 2, or dynamic_sampling=False"
            )
        rows = args.per_device_train_batch_size * args.steps_per_generation
        if rows % size:
            raise ValueError(
                f"dynamic_sampling=True drops and adds whole prompt groups per process, but this process's "
                f"generation batch of {rows} rows (per_device_train_batch_size x steps_per_generation) does not hold "
                f"whole groups of num_generations={size}. Fix: make per_device_train_batch_size x "
                "steps_per_generation a multiple of num_generations"
            )

    # ---- the rounds ------------------------------------------------------------------------------------------

    def generate_and_score(self, run, proceed, inputs):
        if not self.active(run.trl):  # an evaluation batch: TRL's
            run.trace.stepped_aside(self.name, "generate_and_score")
            return proceed(inputs)
        served = self.sample(run, inputs)
        # the chosen rows answer TRL's `_generate` and `_calculate_rewards` inside the step (each once); the step's
        # state closes with the build, so a step that failed leaves nothing for the next
        run.step.chosen_completions.give(served)
        run.step.chosen_rewards.give(served)
        return proceed(served.rows)

    def sample(self, run, inputs: list) -> CandidateRows:
        """The rows to train: this batch's groups with a signal, topped up while some process lacks groups and the
        budget allows, filled with groups without a signal when it does not."""
        size = run.trl.num_generations
        needed = len(inputs) // size
        budget = max(needed, math.floor(run.trl.args.dynamic_sampling_max_oversampling * needed))
        rounds = [self.candidate_round(run, inputs)]
        signal = self._signal(run.trl, rounds[0])
        generated = needed
        accelerator = run.trl.accelerator
        while True:
            missing = torch.tensor([max(0, needed - sum(signal))], device=accelerator.device)
            more = min(int(accelerator.gather(missing).max().item()), budget - generated)
            if more <= 0:  # every process has its groups (or the budget is spent): the same decision everywhere
                break
            rounds.append(self.top_up_round(run, more * size))
            signal += self._signal(run.trl, rounds[-1])
            generated += more
        groups, filled = choose_groups(signal, needed)
        self._log(run.trl, needed, generated, sum(not has for has in signal), filled)
        return CandidateRows.joined(rounds).select([g * size + j for g in groups for j in range(size)])

    def top_up_round(self, run, num_rows: int) -> CandidateRows:
        """New prompt groups: generated now (a synchronous run), or, streaming, joining the stream, and the next
        finished groups (not necessarily those) taken, within the staleness bound as every streamed group."""
        if not self.streamed:
            return self.candidate_round(run, self.top_up_rows(run.trl, num_rows))
        ahead = run.trl.vllm_generation.ahead
        streamed = ahead.take_streamed(num_rows, new_rows=self.top_up_rows(run.trl, num_rows))
        run.step.serve(streamed)
        return self.candidate_round(run, streamed.rows)

    def top_up_rows(self, trl, num_rows: int) -> list[dict]:
        if self.top_up is None:
            self.top_up = TopUpPrompts(
                trl.train_dataset, trl.num_generations, trl.args.seed, trl.accelerator.process_index
            )
            self.top_up.drawn = self.drawn_at_resume
        return self.top_up.draw(num_rows // trl.num_generations)

    def candidate_round(self, run, rows: list) -> CandidateRows:
        """`rows` generated and scored by what runs under this feature (TRL's `_generate`, whatever the backend, and
        TRL's `_calculate_rewards`; trl-scale's checks run on the served rewards of the chosen rows), kept row by
        row."""
        prompts = [row["prompt"] for row in rows]
        if self.environments:  # streamed episodes: TRL renders and parses
            # each prompt with its environment's tools, named per row as its own step names them
            run.trl.set_batch_environments(
                [row.get("environment") if run.trl.multi_environment else None for row in rows]
            )
        generated = run.below(self, "generate")(prompts)
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
        gathered = run.below(self, "rewards")(rows, prompts, completions, completion_ids)
        start = run.trl.accelerator.process_index * len(rows)
        per_row = {f"extra:{column}": list(values) for column, values in run.trl.pending_extra_logs.items()}
        run.trl.pending_extra_logs.clear()  # the chosen rows' columns are handed to TRL's step again
        record = run.step.records.newest() if self.server else None
        if record is not None and len(record) == len(rows):
            per_row[RECORD_ROW] = [record.rows(i, i + 1) for i in range(len(rows))]
        return CandidateRows(rows, tuple(generated), gathered[start : start + len(rows)], per_row)

    def _signal(self, trl, candidates: CandidateRows) -> list[bool]:
        return groups_with_signal(candidates.rewards, trl.reward_weights, trl.num_generations).tolist()

    def _log(self, trl, needed: int, generated: int, without_signal: int, filled: int) -> None:
        metrics = trl.metrics("train")
        accelerator = trl.accelerator
        counts = accelerator.gather(
            torch.tensor([[needed, generated, without_signal, filled]], device=accelerator.device)
        )
        needed_all, generated_all, dropped_all, filled_all = counts.sum(0).tolist()
        metrics["dynamic_sampling/groups_dropped"].append(dropped_all / generated_all)
        metrics["dynamic_sampling/oversampling"].append(generated_all / needed_all)
        metrics["dynamic_sampling/filled_without_signal"].append(filled_all / needed_all)
        if filled_all and not self.warned_budget and accelerator.is_main_process:
            self.warned_budget = True
            logger.warning(
                f"dynamic sampling: after {generated_all} groups (dynamic_sampling_max_oversampling="
                f"{trl.args.dynamic_sampling_max_oversampling} x {needed_all}) only {needed_all - filled_all} had "
                f"rewards that differ; the batch is filled with {filled_all} without (zero advantage). Raise "
                "dynamic_sampling_max_oversampling, or make the task's rewards finer. Said once; "
                "dynamic_sampling/filled_without_signal logs it every step."
            )

    # ---- TRL's step, answered from the chosen rows -----------------------------------------------------------

    def generate(self, run, proceed, prompts):
        served = run.step.chosen_completions.take_if_given()
        if served is None:
            return proceed(prompts)
        if list(prompts) != [row["prompt"] for row in served.rows]:
            raise RuntimeError(
                "dynamic sampling: TRL asked for completions of other prompts than the chosen rows': TRL's hook order "
                "is not the one trl-scale was built on (see trl_scale/seams)"
            )
        if RECORD_ROW in served.per_row:  # the step's record: the chosen rows' parts, in their order
            run.step.records.add(GeneratedBatch.joined(served.per_row[RECORD_ROW]))
        return served.generated

    def rewards(self, run, proceed, inputs, prompts, completions, completion_ids_list):
        served = run.step.chosen_rewards.take_if_given()
        if served is None:
            return proceed(inputs, prompts, completions, completion_ids_list)
        for key, values in served.per_row.items():
            if key.startswith("extra:"):
                run.trl.pending_extra_logs[key.removeprefix("extra:")].extend(values)
        return run.trl.accelerator.gather(served.rewards)

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def state_dict(self, run) -> dict | None:
        """How many top-up prompts were drawn: a resume draws the next ones."""
        return {"drawn": self.top_up.drawn} if self.top_up is not None else None

    def load_state_dict(self, run, state: dict, path: str) -> None:
        self.drawn_at_resume, self.top_up = state["drawn"], None
