"""PPO on a vision-language policy: the images reach the policy's old log-probs, its loss, the reference and the
critic, checked against plain forwards of the same models (a tiny Gemma 3 built offline by `build_tiny_vlm`)."""

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoProcessor, LlamaConfig, LlamaForSequenceClassification

import trl_scale

from .helpers import cpu_args, step_logs

IMAGE_INPUTS = ("pixel_values", "token_type_ids")  # what Gemma 3's processor adds to a prompt's token ids


def _image_prompts(n: int) -> Dataset:
    """Conversational prompts, each with its own random image (TRL turns the `image` column into content lists)."""
    rng = np.random.default_rng(0)
    words = [" one two", " three", " cat dog", " red blue green"]
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": words[i % len(words)]}],
                "image": Image.fromarray((rng.random((28, 28, 3)) * 255).astype("uint8")),
            }
            for i in range(n)
        ]
    )


def _length_reward(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids)) / 8 + (ids[0] % 3 if ids else 0) for ids in completion_ids]


def _ppo(tiny_vlm, tmp_path, **overrides):
    settings = dict(
        per_device_train_batch_size=4,
        max_completion_length=6,
        max_steps=1,
        kl_coef=0.05,  # a reference model, which must get the images too (its KL at step 1 is then 0)
        num_ppo_epochs=1,
        num_mini_batches=1,
    )
    settings.update(overrides)
    return trl_scale.PPOTrainer(
        model=tiny_vlm,
        reward_funcs=_length_reward,
        args=trl_scale.PPOConfig(**cpu_args(tmp_path, **settings)),
        train_dataset=_image_prompts(8),
        processing_class=AutoProcessor.from_pretrained(tiny_vlm),
    )


def _plain_logps(model, input_ids, attention_mask, logits_to_keep, temperature, images):
    """Log-probs of the completion tokens from one padded forward with full logits (no trl-scale code)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images).logits
    logits = logits[:, -logits_to_keep - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)


def _plain_values(critic, input_ids, attention_mask, prompt_len, num_tokens, images):
    """The critic's value of each completion token's state, from one padded forward of its backbone and head."""
    hidden = critic.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **images)
    values = critic.score(hidden.last_hidden_state).squeeze(-1).float()
    return values[:, prompt_len - 1 : prompt_len - 1 + num_tokens]


def test_images_reach_the_old_logprobs_the_loss_the_reference_and_the_critic(tiny_vlm, tmp_path):
    trainer = _ppo(tiny_vlm, tmp_path)
    checked = {}
    rollout = trainer._generate_and_score_completions

    def checked_rollout(inputs):
        batch = rollout(inputs)
        images = {key: batch[key] for key in IMAGE_INPUTS}
        text_only = {}
        prompt_len, num_tokens = batch["prompt_ids"].size(1), batch["completion_ids"].size(1)
        input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        mask = batch["completion_mask"].bool()
        with torch.no_grad():
            for name, inputs_ in (("images", images), ("text_only", text_only)):
                logps = _plain_logps(
                    trainer.model, input_ids, attention_mask, num_tokens, trainer.temperature, inputs_
                )
                values = _plain_values(trainer.value_model, input_ids, attention_mask, prompt_len, num_tokens, inputs_)
                checked[name] = (
                    (batch["old_per_token_logps"] - logps)[mask].abs().max().item(),
                    (batch["values"] - values)[mask].abs().max().item(),
                )
        checked["mean_value"] = (batch["values"] * mask).sum().item() / mask.sum().item()
        return batch

    trainer._generate_and_score_completions = checked_rollout
    trainer.train()

    logps_error, values_error = checked["images"]
    # fp32; TRL's log-prob path and full logits differ in summation order (measured 2e-5 here)
    assert logps_error < 1e-4 and values_error < 1e-5, checked
    # The images change both forwards: a rollout that dropped them would be caught above.
    text_logps_gap, text_values_gap = checked["text_only"]
    assert text_logps_gap > 1e-3 and text_values_gap > 1e-3, checked

    (log,) = step_logs(trainer, ("val/ratio", "policy/approxkl", "objective/kl", "val/vpred"))
    # One epoch over one mini-batch: the loss's forward is the rollout's (ratio 1) only if it gets the images too;
    # the reference starts as the policy, so its KL is 0 only if it gets them as well.
    assert log["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert log["policy/approxkl"] == pytest.approx(0.0, abs=1e-8)
    assert log["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    # The critic's loss forward sees the images: its first predictions are the rollout's values.
    assert log["val/vpred"] == pytest.approx(checked["mean_value"], abs=1e-5)


def test_vision_language_ppo_saves_a_critic_that_reads_images(tiny_vlm, tmp_path):
    from transformers import AutoModelForSequenceClassification

    trainer = _ppo(tiny_vlm, tmp_path, max_steps=2)
    trainer.train()
    trainer.save_model()
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path, subfolder="value_model")
    assert type(critic).__name__ == "Gemma3ForSequenceClassification"
    weights = dict(trainer.value_model.named_parameters())
    for name, parameter in critic.named_parameters():
        torch.testing.assert_close(parameter, weights[name], rtol=0, atol=0)


def test_a_text_only_critic_is_refused_for_an_image_dataset(tiny_vlm, tiny_llama, tmp_path):
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    text_critic = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(processor.tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_labels=1,
            pad_token_id=processor.tokenizer.pad_token_id,
        )
    )
    with pytest.raises(ValueError, match=r"image columns.*value_model is a LlamaForSequenceClassification"):
        trl_scale.PPOTrainer(
            model=tiny_vlm,
            reward_funcs=_length_reward,
            value_model=text_critic,
            args=trl_scale.PPOConfig(**cpu_args(tmp_path, max_completion_length=6)),
            train_dataset=_image_prompts(4),
            processing_class=processor,
        )
    # value_model=None on a text-only policy: the policy itself takes no images, refused first (by the run plan,
    # before the critic, built from it, would be)
    with pytest.raises(ValueError, match=r"image columns \['image'\], but the policy is text-only"):
        trl_scale.PPOTrainer(
            model=tiny_llama,
            reward_funcs=_length_reward,
            args=trl_scale.PPOConfig(**cpu_args(tmp_path, max_completion_length=6)),
            train_dataset=_image_prompts(4),
        )
