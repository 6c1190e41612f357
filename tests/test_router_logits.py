"""An MoE policy whose config asks for its router's logits, generating in the trainer (`trainers/router_logits.py`):
stock TRL stops at the first generation (transformers computes the router's loss inside `generate` with the whole
attention mask); trl-scale generates with the router's logits off and trains, the loss keeping TRL's aux term."""

from __future__ import annotations

import pytest
import trl
from datasets import Dataset
from transformers import AutoConfig, AutoTokenizer

import trl_scale
from trl_scale.toy import build_tiny_model, counting_reward

from .helpers import cpu_args


@pytest.fixture(scope="module")
def router_logits_moe(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("moe"), family="qwen3_moe", output_router_logits=True)


def _trainer(module, model: str, tmp_path, **fields):
    """Four prompts of different lengths per batch: left-padded (without padding the shapes happen to agree)."""
    config = module.GRPOConfig(
        **cpu_args(tmp_path, max_steps=2, per_device_train_batch_size=8),
        num_generations=2,
        max_completion_length=6,
        **fields,
    )
    prompts = ["one two", "one two three four five six", "three", "two three four"] * 4
    return module.GRPOTrainer(
        model=model,
        reward_funcs=counting_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(model),
    )


def test_stock_trl_stops_at_the_first_generation(router_logits_moe, tmp_path):
    with pytest.raises(RuntimeError, match="must match the size"):
        _trainer(trl, router_logits_moe, tmp_path).train()


def test_local_generation_of_an_moe_policy_asking_for_router_logits_trains(router_logits_moe, tmp_path):
    trainer = _trainer(trl_scale, router_logits_moe, tmp_path)
    assert "router_logits_in_generation" in trainer.features.names()
    trainer.train()
    assert trainer.state.global_step == 2
    losses = [log for log in trainer.state.log_history if "loss" in log]
    assert all(log["aux_loss"] > 0 for log in losses), losses  # TRL's router loss, still in the training loss
    # every scoring call packed, the loss's router term with it (`scoring/router_loss.py`)
    assert all(log["padding_free/pad_fraction_removed"] > 0 for log in losses), losses
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert model.config.output_router_logits is True  # asked for none only while generating


def test_the_plan_reads_the_models_config_and_its_init_kwargs(router_logits_moe, tiny_llama, tmp_path):
    plain_moe = build_tiny_model(tmp_path / "plain", family="qwen3_moe")
    assert AutoConfig.from_pretrained(plain_moe).output_router_logits is False
    assert "router_logits_in_generation" not in _trainer(trl_scale, plain_moe, tmp_path).features.names()
    asked = _trainer(trl_scale, plain_moe, tmp_path, model_init_kwargs={"output_router_logits": True})
    assert "router_logits_in_generation" in asked.features.names()
    vllm = dict(use_vllm=True, vllm_mode="server", vllm_server_base_urls=["http://127.0.0.1:1"])
    from trl_scale.trainers.plan import RunPlan

    config = trl_scale.GRPOConfig(**cpu_args(tmp_path), **vllm)
    plan = RunPlan.from_arguments("GRPOTrainer", {"model": router_logits_moe, "args": config})
    assert not plan.router_logits  # the servers generate: nothing to turn off in the trainer


def test_a_granitemoe_policy_trains_where_stock_trl_stops_at_its_router_loss(tmp_path):
    """GraniteMoE's config names `num_local_experts`, not the `num_experts` TRL's loss forward reads for the router
    loss it turns on (`router_aux_loss_coef` 0.001): stock TRL stops at the first loss; trl-scale packs the call and
    computes the loss with the experts the config names."""
    granite = build_tiny_model(tmp_path / "granite", family="granitemoe")
    with pytest.raises(AttributeError, match="num_experts"):
        _trainer(trl, granite, tmp_path / "trl").train()
    trainer = _trainer(trl_scale, granite, tmp_path / "ours")
    trainer.train()
    losses = [log for log in trainer.state.log_history if "loss" in log]
    assert trainer.state.global_step == 2 and all(log["aux_loss"] > 0 for log in losses), losses
