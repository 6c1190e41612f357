"""The config fields of evaluation during training, mixed into the GRPO, RLOO and PPO configs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..numbers import check_field_types, check_whole


@dataclass
class EvaluationArguments:
    """Config fields of evaluation during training (GRPO, RLOO, PPO; every rollout mode). TRL's own fields switch
    it on: `eval_strategy`, `eval_steps`, `num_generations_eval`, `per_device_eval_batch_size`."""

    FIELDS_DOC = """
    > Evaluation during training

    eval_pass_at_k (`list[int]` or `None`, defaults to `None`):
        The k of the pass@k logged for each reward function at each evaluation, as `eval_rewards/<name>/pass@<k>`
        next to TRL's `eval_rewards/<name>/mean`: the chance that at least one of k of a prompt's
        `num_generations_eval` completions passes (unbiased estimate, averaged over the evaluation's prompts). Each
        k is between 1 and `num_generations_eval`. `None`: 1 and `num_generations_eval`.
    eval_success_threshold (`float`, defaults to `1.0`):
        A completion passes a reward function when its reward is at least this (a NaN reward, the function not
        scoring it, is no pass).
"""  # its section of each config's docstring (`config_docstring`)

    eval_pass_at_k: list[int] | None = field(
        default=None,
        metadata={
            "help": "The k of the pass@k logged per reward function at each evaluation "
            "(eval_rewards/<name>/pass@<k>), each between 1 and num_generations_eval. None: 1 and "
            "num_generations_eval."
        },
    )
    eval_success_threshold: float = field(
        default=1.0,
        metadata={"help": "A completion passes a reward function (for pass@k) when its reward is at least this."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_field_types(self, EvaluationArguments)
        if self.eval_pass_at_k is not None:
            self.eval_pass_at_k = self._checked_ks(self.eval_pass_at_k)
            if str(getattr(self, "eval_strategy", "no")) in ("no", "IntervalStrategy.NO") and not self.do_eval:
                raise ValueError(
                    f"eval_pass_at_k={self.eval_pass_at_k} is logged by evaluation, and eval_strategy='no' runs none. "
                    "Fix: eval_strategy='steps' (with eval_steps and an eval_dataset), do_eval=True if you call "
                    "trainer.evaluate() yourself, or drop eval_pass_at_k"
                )

    def _eval_generations(self) -> int:
        """The completions per evaluation prompt, as TRL takes them: `num_generations_eval`, else `num_generations`."""
        return getattr(self, "num_generations_eval", None) or getattr(self, "num_generations", None) or 1

    def _checked_ks(self, ks) -> list[int]:
        n = self._eval_generations()
        fix = f"each k of pass@k is a whole number from 1 to num_generations_eval={n} (the completions per prompt)"
        if isinstance(ks, (int, str)) or not hasattr(ks, "__iter__") or not list(ks):
            raise ValueError(f"eval_pass_at_k={ks!r}: use a non-empty list of whole numbers, e.g. [1, {n}]")
        for k in ks:
            check_whole("eval_pass_at_k", k, minimum=1, fix=fix)
            if k > n:
                raise ValueError(f"eval_pass_at_k={list(ks)!r}: {fix}")
        return sorted(set(ks))

    def pass_at_ks(self) -> list[int]:
        """The k to log: those asked for, else 1 and `num_generations_eval`."""
        if self.eval_pass_at_k is not None:
            return list(self.eval_pass_at_k)
        return sorted({1, self._eval_generations()})
