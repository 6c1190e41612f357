"""Evaluation during training: pass@k of each reward function over an evaluation batch's prompt groups, and the
config fields that set it (`EvaluationArguments`). TRL runs the evaluation (`eval_strategy`, `eval_steps`,
`num_generations_eval`); the trainers' `Evaluation` feature adds these figures to its `eval_` metrics."""

from .arguments import EvaluationArguments
from .pass_at_k import pass_at_k, pass_rates

__all__ = ["EvaluationArguments", "pass_at_k", "pass_rates"]
