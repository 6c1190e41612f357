"""How the files beside this one were made: by trl-scale at commit 1581e27, the last before the features' state went
into one file per rank (`trainers/feature_state.py`). A GRPO run with dynamic sampling (every group flat, so top-ups
are drawn) and a rollout spanning 2 optimizer steps, checkpointed inside the window at step 1; its
`rollout_buffer_rank0.pt` and `dynamic_sampling_rank0.json` are kept here. Rerun (from a checkout of 1581e27):

    PYTHONPATH=. python tests/data/legacy_checkpoint/make.py OUT
"""

import os
import sys

from transformers import AutoTokenizer

import trl_scale
from tests.helpers import cpu_args
from trl_scale.toy import build_tiny_model, counting_prompts


def flat_reward(completion_ids, **kwargs):
    return [0.5] * len(completion_ids)


def main(out: str) -> None:
    model = build_tiny_model(os.path.join(out, "model"), family="llama")
    settings = dict(num_generations=4, max_completion_length=8, steps_per_generation=2, max_steps=1)
    saving = dict(save_strategy="steps", save_steps=1, dynamic_sampling=True, dynamic_sampling_max_oversampling=2.0)
    config = trl_scale.GRPOConfig(**cpu_args(os.path.join(out, "run"), **settings, **saving))
    trainer = trl_scale.GRPOTrainer(
        model=model,
        reward_funcs=flat_reward,
        args=config,
        train_dataset=counting_prompts(64, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model),
    )
    trainer.train()
    print(sorted(os.listdir(os.path.join(out, "run", "checkpoint-1"))))


if __name__ == "__main__":
    main(sys.argv[1])
