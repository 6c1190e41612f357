"""trl-scale's trainers are drop-in subclasses: with trl-scale's features off, 3 training steps give the same
losses, gradient norms and weights as TRL's own trainers, bit for bit (the same code runs), and nothing is packed.
(A tolerance of 1e-6 would let a path that still packs slip through: packed-vs-padded rounding is ~1e-6.)"""

import pytest
import trl

import trl_scale
from trl_scale.toy import counting_prompts, preference_pairs
from trl_scale.trainers.packing import PackedScoring

from .helpers import assert_logs_close, cpu_args, max_param_diff, step_logs, token_parity_reward

ATOL = 0.0

# trl-scale features that later issues add are switched off here; this dict grows with them.
FEATURES_OFF: dict = {"padding_free": False}


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (trl_scale.GRPOTrainer, trl.GRPOTrainer),
        (trl_scale.RLOOTrainer, trl.RLOOTrainer),
        (trl_scale.DPOTrainer, trl.DPOTrainer),
        (trl_scale.GRPOConfig, trl.GRPOConfig),
        (trl_scale.RLOOConfig, trl.RLOOConfig),
        (trl_scale.DPOConfig, trl.DPOConfig),
    ],
)
def test_subclasses_trl(ours, theirs):
    assert issubclass(ours, theirs) and ours is not theirs


def _online_run(trainer_cls, config_cls, model_path, tmp_path, features=FEATURES_OFF, peft_config=None, **overrides):
    from transformers import AutoTokenizer

    config_kwargs = cpu_args(tmp_path, num_generations=4, max_completion_length=8, beta=0.05, **overrides)
    config_kwargs.update({k: v for k, v in features.items() if k in config_cls.__dataclass_fields__})
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config_cls(**config_kwargs),
        train_dataset=counting_prompts(64, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_online_trainers_match_trl(method, tiny_llama, tmp_path):
    ours = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
    }
    theirs = {"grpo": (trl.GRPOTrainer, trl.GRPOConfig), "rloo": (trl.RLOOTrainer, trl.RLOOConfig)}
    reference = _online_run(*theirs[method], tiny_llama, tmp_path / "trl")
    candidate = _online_run(*ours[method], tiny_llama, tmp_path / "ours")
    keys = ("loss", "grad_norm", "reward", "entropy", "kl")
    expected = step_logs(reference, keys)
    assert all(e["grad_norm"] > 0 for e in expected), "the run must produce gradients for the parity to mean anything"
    assert_logs_close(step_logs(candidate, keys), expected, ATOL)
    assert max_param_diff(candidate.model, reference.model) <= ATOL
    _assert_nothing_packed(candidate)


def _assert_nothing_packed(trainer):
    assert trainer.features.get(PackedScoring).stats is None
    assert not any("padding_free/" in key for entry in trainer.state.log_history for key in entry)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert not hasattr(model, "_trl_scale_packed_scoring")


def _dpo_run(trainer_cls, config_cls, model_path, tmp_path):
    from transformers import AutoTokenizer

    config_kwargs = cpu_args(tmp_path, max_length=64)
    config_kwargs.update({k: v for k, v in FEATURES_OFF.items() if k in config_cls.__dataclass_fields__})
    trainer = trainer_cls(
        model=model_path,
        args=config_cls(**config_kwargs),
        train_dataset=preference_pairs(32, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    return trainer


def test_dpo_matches_trl(tiny_llama, tmp_path):
    reference = _dpo_run(trl.DPOTrainer, trl.DPOConfig, tiny_llama, tmp_path / "trl")
    candidate = _dpo_run(trl_scale.DPOTrainer, trl_scale.DPOConfig, tiny_llama, tmp_path / "ours")
    keys = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")
    expected = step_logs(reference, keys)
    assert expected[-1]["loss"] < expected[0]["loss"] or expected[0]["grad_norm"] > 0
    assert_logs_close(step_logs(candidate, keys), expected, ATOL)
    assert max_param_diff(candidate.model, reference.model) <= ATOL
    _assert_nothing_packed(candidate)


def test_model_card_and_tags_name_trl_scale(tiny_llama, tmp_path):
    trainer = _dpo_run(trl_scale.DPOTrainer, trl_scale.DPOConfig, tiny_llama, tmp_path)
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "trl-scale" in card and "dpo" in card
    assert "trl-scale" in trainer.model.model_tags


def test_grpo_with_a_lora_adapter_is_packed_and_takes_trls_steps(tiny_llama, tmp_path):
    """With a PEFT adapter, PEFT calls the patched forward with `inputs_embeds=None` and other unset fields: those
    calls are packed too (the policy, and the reference as the adapter-disabled policy), where an earlier engine
    took any extra keyword as unpackable and fell back to TRL's padded forward, silently. The packed run takes
    TRL's steps within packing's rounding."""
    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer

    lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    reference = _online_run(trl.GRPOTrainer, trl.GRPOConfig, tiny_llama, tmp_path / "trl", peft_config=lora)
    candidate = _online_run(
        trl_scale.GRPOTrainer,
        trl_scale.GRPOConfig,
        tiny_llama,
        tmp_path / "ours",
        features={"padding_free": True},
        peft_config=lora,
    )
    keys = ("loss", "grad_norm", "reward", "entropy", "kl")
    expected = step_logs(reference, keys)
    assert all(e["grad_norm"] > 0 for e in expected) and any(e["kl"] > 0 for e in expected)
    assert_logs_close(step_logs(candidate, keys), expected, 1e-5)
    stats = candidate.features.get(PackedScoring).stats
    stats.pop()
    batch = AutoTokenizer.from_pretrained(tiny_llama)(["1 2 3 4 5", "6 7"], return_tensors="pt", padding=True)
    with torch.no_grad():
        candidate._get_per_token_logps_and_entropies(candidate.model, batch.input_ids, batch.attention_mask, 3)
        with candidate.accelerator.unwrap_model(candidate.model).disable_adapter():  # the reference
            candidate._get_per_token_logps_and_entropies(candidate.model, batch.input_ids, batch.attention_mask, 3)
    assert (stats.calls, stats.fallbacks) == (2, 0)
