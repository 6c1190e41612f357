"""Evaluation during training as a trainer feature: TRL evaluates (`eval_strategy`, `eval_steps`,
`num_generations_eval`) by generating and scoring each evaluation batch as a training one, and logs the mean reward
per function as `eval_rewards/<name>/mean`. This adds each function's pass@k (`EvaluationArguments`) from the same
rewards, gathered over every process, under `eval_rewards/<name>/pass@<k>`. Where the evaluation's completions come
from in each rollout mode is the rollout's concern (`ServerRollout.generate_and_score`: generated now, at the
current weights, never from or into the stream)."""

from __future__ import annotations

from ..evaluation import pass_rates
from .feature import Feature


class Evaluation(Feature):
    name = "evaluation"

    def rewards(self, run, proceed, *args):
        rewards_per_func = proceed(*args)
        if not run.trl.model.training:
            log_pass_rates(run.trl, rewards_per_func)
        return rewards_per_func


def log_pass_rates(trl, rewards_per_func) -> None:
    """Each reward function's pass@k over this evaluation batch (every process's rows: TRL's reward call gathers
    them, each prompt's `num_generations_eval` completions consecutive), into TRL's eval metrics."""
    args = trl.args
    group_size = trl.num_generations_eval
    ks = args.pass_at_ks()
    columns = rewards_per_func.detach().float().cpu().T.tolist()
    for name, rewards in zip(trl.reward_func_names, columns, strict=True):
        for k, rate in pass_rates(rewards, group_size, ks, args.eval_success_threshold).items():
            trl.metrics("eval")[f"rewards/{name}/pass@{k}"].append(rate)
