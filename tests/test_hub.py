"""Model cards and push_to_hub, offline: the Hub client's calls are captured, nothing leaves the machine."""

import os

import pytest
import transformers.trainer
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts, preference_pairs

from .helpers import cpu_args, token_parity_reward


class CapturedHub:
    """Stands in for `huggingface_hub.HfApi`: records repos created and the files of each uploaded folder."""

    def __init__(self):
        self.repos, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append(repo_id)
        return type("RepoUrl", (), {"repo_id": f"user/{repo_id}"})()

    def upload_folder(self, folder_path, ignore_patterns=(), **kwargs):
        files = {}
        for root, _, names in os.walk(folder_path):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), folder_path)
                if not rel.startswith("checkpoint-") and not rel.startswith("_"):
                    files[rel] = open(os.path.join(root, name), "rb").read()
        self.uploads.append({"folder": folder_path, "files": files, **kwargs})
        return None


@pytest.fixture
def hub(monkeypatch):
    captured = CapturedHub()
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: captured)
    return captured


def test_dpo_push_to_hub_accepts_transformers_card_kwargs(tiny_llama, tmp_path, hub):
    trainer = trl_scale.DPOTrainer(
        model=tiny_llama,
        args=trl_scale.DPOConfig(
            **cpu_args(tmp_path, max_length=64, max_steps=1, push_to_hub=True, hub_model_id="tiny-dpo")
        ),
        train_dataset=preference_pairs(16),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    trainer.train()
    # TRL 1.16's own card raises TypeError on these; the Trainer API accepts them.
    trainer.push_to_hub(license="apache-2.0", language="en", finetuned_from="org/tiny-base", dataset_name="toy/prefs")
    card = hub.uploads[-1]["files"]["README.md"].decode()
    for expected in ("license: apache-2.0", "language:", "org/tiny-base", "trl-scale", "padding-free", "dpo"):
        assert expected in card, expected
    assert "model.safetensors" in hub.uploads[-1]["files"]


def test_ppo_push_includes_the_critic(tiny_llama, tmp_path, hub):
    trainer = trl_scale.PPOTrainer(
        model=tiny_llama,
        reward_funcs=token_parity_reward,
        args=trl_scale.PPOConfig(
            **cpu_args(tmp_path, max_steps=1, max_completion_length=6, push_to_hub=True, hub_model_id="tiny-ppo")
        ),
        train_dataset=counting_prompts(16),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    trainer.train()
    trainer.push_to_hub()
    files = hub.uploads[-1]["files"]
    assert "value_model/model.safetensors" in files and "value_model/config.json" in files
    assert "value-model" in files["README.md"].decode() and "ppo" in files["README.md"].decode()


def test_unknown_card_argument_is_a_clear_error(tiny_llama, tmp_path):
    trainer = trl_scale.DPOTrainer(
        model=tiny_llama,
        args=trl_scale.DPOConfig(**cpu_args(tmp_path, max_length=64, max_steps=1)),
        train_dataset=preference_pairs(16),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    with pytest.raises(TypeError, match="colour"):
        trainer.create_model_card(colour="blue")


def test_push_to_hub_works_when_the_config_did_not_ask_for_it(tiny_llama, tmp_path, hub):
    """`trainer.push_to_hub()` after a run with push_to_hub=False: transformers creates the repo then, passing
    `private` to `init_hf_repo` (a TypeError, reported as "log in", before)."""
    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(
            **cpu_args(tmp_path, max_steps=1, num_generations=4, max_completion_length=4, hub_model_id="tiny-grpo")
        ),
        train_dataset=counting_prompts(16),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    trainer.train()
    trainer.push_to_hub(private=True)
    assert hub.repos == ["tiny-grpo"] and len(hub.uploads) == 1
    assert "model.safetensors" in hub.uploads[0]["files"]
