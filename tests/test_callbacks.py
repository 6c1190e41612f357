"""trl-scale callbacks: their figures arrive in the logs every report_to integration receives."""

import json

from transformers import AutoTokenizer, TrainerCallback

import trl_scale
from trl_scale.callbacks import CompletionSamplesCallback, MemoryCallback, StepTimeCallback, ThroughputCallback
from trl_scale.toy import counting_prompts, counting_reward

from .helpers import cpu_args


class LogRecorder(TrainerCallback):
    """Stands in for a report_to integration: it sees exactly what `on_log` consumers see."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_callback_metrics_reach_on_log_consumers(tiny_llama, tmp_path):
    recorder = LogRecorder()
    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=counting_reward,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path, num_generations=4, max_completion_length=4, max_steps=3)),
        train_dataset=counting_prompts(32),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        callbacks=[
            ThroughputCallback(peak_flops=1e12),
            MemoryCallback(),
            StepTimeCallback(),
            CompletionSamplesCallback(num_samples=3),
            recorder,
        ],
    )
    trainer.train()
    step_logs = [entry for entry in recorder.logs if "loss" in entry]
    assert len(step_logs) == 3
    for entry in step_logs:
        assert entry["throughput/tokens_per_s"] > 0 and entry["throughput/samples_per_s"] > 0
        assert 0 < entry["throughput/mfu"] < 1
        assert entry["memory/peak_rss_gib"] > 0.1
        assert entry["time/generate_s"] > 0 and entry["time/score_s"] > 0 and entry["time/reward_s"] >= 0
        assert entry["time/step_s"] >= entry["time/generate_s"]
    rows = [json.loads(line) for line in (tmp_path / "completion_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 9
    for row in rows:  # the table's rewards are the reward function's, recomputed here
        assert row["reward/counting_reward"] == counting_reward([row["prompt"]], [row["completion"]])[0]
