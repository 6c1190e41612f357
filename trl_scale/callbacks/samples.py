"""A table of sample completions: the last few (prompt, completion, rewards) rows at each log, appended to
`<output_dir>/completion_samples.jsonl` and logged as `samples/*` scalars (their mean reward)."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback


class CompletionSamplesCallback(TrainerCallback):
    def __init__(self, num_samples: int = 4, filename: str = "completion_samples.jsonl"):
        self.num_samples = num_samples
        self.filename = filename

    def trl_scale_metrics(self, trainer, logs) -> dict[str, float]:
        buffer = getattr(trainer, "_logs", None)  # TRL's online trainers keep the last completions here
        if not buffer or not buffer.get("completion"):
            return {}
        prompts = list(buffer["prompt"])[-self.num_samples :]
        completions = list(buffer["completion"])[-self.num_samples :]
        rewards = {name: list(values)[-self.num_samples :] for name, values in buffer.get("rewards", {}).items()}
        rows = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            row = {"step": trainer.state.global_step, "prompt": prompt, "completion": completion}
            row.update({f"reward/{name}": float(values[i]) for name, values in rewards.items() if i < len(values)})
            rows.append(row)
        if trainer.is_world_process_zero():
            os.makedirs(trainer.args.output_dir, exist_ok=True)
            with open(os.path.join(trainer.args.output_dir, self.filename), "a") as f:
                for row in rows:
                    f.write(json.dumps(row, default=str) + "\n")
        means = {f"samples/mean_{k}": sum(r[k] for r in rows) / len(rows) for k in rows[0] if k.startswith("reward/")}
        return means
