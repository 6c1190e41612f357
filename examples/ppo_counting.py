"""PPO with a critic on the toy counting task, on CPU, offline (about a minute on 2 cores).

    python examples/ppo_counting.py [--backend ray]

The same script shape works for a real run: swap the tiny model for your SFT checkpoint, the toy dataset for
yours (a "prompt" column) and the reward for your reward functions or reward model paths.
"""

import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_scale import PPOConfig, PPOTrainer
from trl_scale.toy import COUNT_TARGET_LENGTH, build_tiny_model, counting_prompts, counting_reward
from trl_scale.toy.demo import evaluate_counting, warm_up


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", default="outputs/ppo-counting")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # An "SFT checkpoint": a tiny model warmed up on noisy counting text, saved like any checkpoint.
    base = build_tiny_model(os.path.join(args.output_dir, "base-model"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    warm_up(model, tokenizer, steps=60)
    sft = os.path.join(args.output_dir, "sft-model")
    model.save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    before = evaluate_counting(model, tokenizer)

    trainer = PPOTrainer(
        model=sft,  # the reference model is loaded from the same path
        reward_funcs=counting_reward,
        args=PPOConfig(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=32,
            max_completion_length=COUNT_TARGET_LENGTH,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            num_ppo_epochs=1,
            kl_coef=0.01,
            logging_steps=10,
            report_to="none",
            save_strategy="no",
            bf16=False,
            use_cpu=True,
            activation_checkpointing=False,
            backend=args.backend,
        ),
        train_dataset=counting_prompts(args.max_steps * 32),
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()  # policy + value_model/
    after = evaluate_counting(trainer.model, tokenizer)
    print(f"counting reward: {before:.3f} before PPO, {after:.3f} after; saved to {args.output_dir}")


if __name__ == "__main__":
    main()
