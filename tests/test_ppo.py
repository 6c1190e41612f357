"""PPOTrainer: its algebra against plain references, learning on the toy task, exact resume, the critic's
save/load, and clear errors for bad input."""

import copy
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import trl_scale
from trl_scale import ppo_core
from trl_scale.toy import COUNT_TARGET_LENGTH, build_tiny_model, counting_prompts, counting_reward
from trl_scale.toy.demo import evaluate_counting, warm_up

from .helpers import cpu_args, paired, step_logs, token_parity_reward

# ---- algebra vs plain Python ---------------------------------------------------------------------------------


def _gae_reference(rewards, values, mask, gamma, lam):
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        n = int(sum(m_row))  # completions are right-padded: the first n tokens are real
        adv = [0.0] * len(r_row)
        gae = 0.0
        for t in reversed(range(n)):
            next_value = v_row[t + 1] if t + 1 < n else 0.0
            delta = r_row[t] + gamma * next_value - v_row[t]
            gae = delta + gamma * lam * gae
            adv[t] = gae
        advantages.append(adv)
        returns.append([adv[t] + v_row[t] if t < n else 0.0 for t in range(len(r_row))])
    return advantages, returns


def test_gae_and_returns_match_python_loops():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    values = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0] * 6])
    advantages, returns = ppo_core.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    assert torch.allclose(advantages, torch.tensor(ref_adv, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.allclose(returns, torch.tensor(ref_ret, dtype=torch.float64), atol=1e-12, rtol=0)


def _gae_with_holes_reference(rewards, values, mask, gamma, lam):
    """GAE as a plain loop over each row's real tokens only (mask 1): tool-result tokens (holes) are not steps, so
    the step before a hole bootstraps from the value after it; holes carry the advantage of the next real token."""
    advantages = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        steps = [t for t, m in enumerate(m_row) if m]
        adv = [0.0] * len(r_row)
        gae = 0.0
        for i in reversed(range(len(steps))):
            t = steps[i]
            next_value = v_row[steps[i + 1]] if i + 1 < len(steps) else 0.0
            gae = r_row[t] + gamma * next_value - v_row[t] + gamma * lam * gae
            adv[t] = gae
        for t in reversed(range(len(r_row))):  # holes take the advantage of the next real token (0 after the end)
            if not m_row[t]:
                later = [u for u in steps if u > t]
                adv[t] = adv[later[0]] if later else 0.0
        advantages.append(adv)
    return advantages


def test_gae_passes_over_tool_result_holes_like_a_loop_over_real_tokens():
    generator = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    values = torch.randn(3, 7, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]])
    advantages, returns = ppo_core.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    reference = torch.tensor(
        _gae_with_holes_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8), dtype=torch.float64
    )
    assert torch.allclose(advantages, reference, atol=1e-12, rtol=0)
    assert torch.allclose(returns, (reference + values * mask) * mask, atol=1e-12, rtol=0)


def test_the_score_lands_on_the_last_real_token_and_reaches_every_turn():
    """verl's example: mask [1,1,0,0,1,1,0] (a tool result at 2-3, padding at 6), score 1, zero values, no KL:
    every real token and the hole between them get advantage 1, the padding 0."""
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    rewards, _ = ppo_core.shaped_rewards(torch.tensor([1.0]), torch.zeros(1, 7), mask, kl_coef=0.1)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]  # not at mask.sum() - 1 = 3, a tool token
    advantages, _ = ppo_core.compute_gae(rewards, torch.zeros(1, 7), mask, gamma=1.0, lam=1.0)
    assert advantages.tolist() == [[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def test_a_completion_ends_with_eos_only_at_its_last_real_token():
    eos, pad = 2, 2  # padding that reuses the EOS id
    ids = torch.tensor([[5, 6, eos, pad], [5, eos, 7, 8], [5, 6, 7, 8], [pad, pad, pad, pad]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    # row 1: an EOS inside (a tool turn), not at the end; row 3: nothing generated
    assert ppo_core.ends_with(ids, mask, [eos]).tolist() == [True, False, False, False]


def test_value_clipping_is_around_the_old_values():
    old = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    returns = torch.tensor([[3.0, 1.0, -3.0, 0.5]])
    values = torch.tensor([[2.5, 1.9, -1.5, 0.9]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = ppo_core.clipped_value_loss(values, old, returns, mask, cliprange=0.2)
    # token 0: clipped to 2.2 -> (0.8)^2 > (0.5)^2; token 1: inside [1.8, 2.2]; token 2: clipped to -1.2 ->
    # (1.8)^2 > (1.5)^2; token 3 is masked out
    expected = 0.5 * (0.8**2 + 0.9**2 + 1.8**2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 3, abs=1e-6)


def test_kl_estimators_from_their_formulas():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    k1 = ppo_core.kl_penalty(logp, ref, "k1")
    k3 = ppo_core.kl_penalty(logp, ref, "k3")
    for i in range(3):
        assert k1[i].item() == pytest.approx(logp[i].item() - ref[i].item(), abs=1e-12)
        r = math.exp(ref[i].item() - logp[i].item())
        assert k3[i].item() == pytest.approx((r - 1) - math.log(r), abs=1e-12)
    assert (k3 >= 0).all()
    with pytest.raises(ValueError, match="k2"):
        ppo_core.kl_penalty(logp, ref, "k2")


def test_shaped_rewards_put_the_score_on_the_last_real_token():
    kl = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    rewards, non_score = ppo_core.shaped_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.1, -0.1, 1.9, 0.0], [-0.1, -0.1, -0.1, -1.1]])
    assert torch.allclose(rewards, expected, atol=1e-6)
    assert non_score.sum().item() == pytest.approx(-0.7)


def test_value_clipping_takes_the_pessimistic_loss():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    values = torch.tensor([[0.5, 0.1, 0.5]])
    loss, clipfrac = ppo_core.clipped_value_loss(values, old, returns, torch.ones(1, 3), cliprange=0.2)
    # token 0: clipped to 0.2 -> (0.8)^2 > (0.5)^2; token 1: inside the range; token 2: unclipped (1.5)^2 is worse
    expected = 0.5 * (0.8**2 + 0.9**2 + 1.5**2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3, abs=1e-6)


def test_clipped_policy_loss_matches_its_formula():
    logp = torch.tensor([[0.3, -0.3, 0.0]])
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    per_token, stats = ppo_core.clipped_policy_loss(logp, old, adv, torch.ones(1, 3), 0.2)
    ratio = logp.exp()
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert torch.allclose(per_token, expected)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    assert stats["approxkl"].item() == pytest.approx(0.5 * (0.09 + 0.09) / 3, abs=1e-6)


def test_whitening_has_zero_mean_and_unit_variance_on_the_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    whitened = ppo_core.masked_whiten(values, mask)
    assert whitened[0, :3].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened[0, :3].var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


# ---- the trainer ---------------------------------------------------------------------------------------------


def _ppo(model_path, out, reward=token_parity_reward, **overrides):
    settings = dict(max_completion_length=8, max_steps=4, num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.05)
    settings.update(overrides)
    return trl_scale.PPOTrainer(
        model=model_path,
        reward_funcs=reward,
        args=trl_scale.PPOConfig(**cpu_args(out, **settings)),
        train_dataset=counting_prompts(64, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )


@pytest.mark.slow  # > 20 s on 2 cores; still in CI (CI deselects only gpu and vllm)
def test_ppo_learns_to_count(tmp_path):
    """Calibrated (seed 0, 200 rollouts of 32): training reward 0.11 -> 0.79, held-out 0.11 -> 0.83. Broken on purpose
    the same run stops far lower: values read one token off, 0.28 / 0.36; the KL penalty's sign flipped, 0.30 / 0.32.
    Both thresholds (+0.45) sit between."""
    base = build_tiny_model(tmp_path / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    warm_up(model, tokenizer, steps=60)
    before = evaluate_counting(model, tokenizer)
    sft = str(tmp_path / "sft")  # the reference model is loaded from the policy's path, as TRL does
    model.save_pretrained(sft)
    tokenizer.save_pretrained(sft)
    trainer = trl_scale.PPOTrainer(
        model=sft,
        reward_funcs=counting_reward,
        args=trl_scale.PPOConfig(
            **cpu_args(
                tmp_path / "ppo",
                max_steps=200,
                per_device_train_batch_size=32,
                max_completion_length=COUNT_TARGET_LENGTH,
                lr_scheduler_type="constant",
                num_ppo_epochs=1,
                kl_coef=0.01,
                activation_checkpointing=False,
            )
        ),
        train_dataset=counting_prompts(8192, seed=0),
        processing_class=tokenizer,
    )
    trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    print(f"training reward {sum(rewards[:10]) / 10:.3f} -> {sum(rewards[-10:]) / 10:.3f}")
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.45, rewards
    after = evaluate_counting(trainer.model, tokenizer)
    print(f"held-out counting reward {before:.3f} -> {after:.3f}")
    assert after > before + 0.45, (before, after)
    logged = trainer.state.log_history[0]
    for key in (
        "objective/kl",
        "objective/entropy",
        "objective/rlhf_reward",
        "policy/approxkl",
        "policy/clipfrac",
        "val/vpred",
        "val/error",
        "val/clipfrac",
        "reward",
    ):
        assert key in logged, key


def test_resume_from_checkpoint_continues_exactly(tiny_llama, tmp_path):
    """A run that checkpoints at step 2, and a fresh trainer resumed from that checkpoint, give the same three
    steps after it: losses, the final policy and critic weights, both optimizers and the critic's scheduler."""
    keys = ("loss", "grad_norm", "reward", "loss/value", "val/vpred", "objective/kl")
    settings = dict(num_ppo_epochs=1, num_mini_batches=1, save_strategy="steps", save_steps=2, max_steps=5)
    full = _ppo(tiny_llama, tmp_path / "full", **settings)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "value_model" / "config.json").exists()
    assert (checkpoint / "critic_optimizer.pt").exists() and (checkpoint / "critic_scheduler.pt").exists()
    resumed = _ppo(tiny_llama, tmp_path / "resumed", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # The resumed history holds the checkpoint's two steps, then the three it ran.
    expected, got = step_logs(full, keys)[2:], step_logs(resumed, keys)[2:]
    assert len(got) == 3 and len(expected) == 3
    for e, g in zip(expected, got):
        for key in keys:
            assert g[key] == pytest.approx(e[key], abs=1e-6), (key, g[key], e[key])
    for a, b in ((full.model, resumed.model), (full.value_model, resumed.value_model)):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.allclose(x, y, atol=1e-6), name
    for a, b in ((full.critic.optimizer, resumed.critic.optimizer), (full.optimizer, resumed.optimizer)):
        for x, y in zip(a.state_dict()["state"].values(), b.state_dict()["state"].values(), strict=True):
            assert torch.allclose(x["exp_avg"], y["exp_avg"], atol=1e-6)
    assert full.critic.scheduler.state_dict() == resumed.critic.scheduler.state_dict()
    assert full.critic.scheduler.get_last_lr() == resumed.critic.scheduler.get_last_lr()


def test_critic_is_saved_beside_the_policy_and_loads_back(tiny_llama, tmp_path):
    trainer = _ppo(tiny_llama, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    critic = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "final"), subfolder="value_model")
    live = trainer.accelerator.unwrap_model(trainer.value_model)
    for (name, a), (_, b) in zip(critic.state_dict().items(), live.state_dict().items()):
        assert torch.equal(a, b), name
    assert "value-model" in (tmp_path / "final" / "value_model" / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))


def test_value_model_defaults_to_the_reward_model(tiny_llama, tiny_reward_model, tmp_path):
    trainer = _ppo(tiny_llama, tmp_path, reward=[tiny_reward_model], max_steps=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model)
    critic = trainer.accelerator.unwrap_model(trainer.value_model)
    assert torch.equal(critic.score.weight, reward_model.score.weight)
    trainer.train()  # a reward model as reward function, and as critic, train end to end


def test_reward_returning_none_is_a_clear_error(tiny_llama, tmp_path):
    def sometimes_none(completions, **kwargs):
        return [None] + [0.5] * (len(completions) - 1)

    trainer = _ppo(tiny_llama, tmp_path, reward=sometimes_none, max_steps=1)
    with pytest.raises(ValueError, match="sometimes_none.*None or NaN"):
        trainer.train()


def test_value_model_with_another_tokenizer_is_rejected(tiny_llama, tmp_path):
    other = build_tiny_model(tmp_path / "other", kind="reward", words=["alpha", "beta", "gamma"])
    with pytest.raises(ValueError, match="different tokenizer"):
        trl_scale.PPOTrainer(
            model=tiny_llama,
            reward_funcs=token_parity_reward,
            value_model=other,
            args=trl_scale.PPOConfig(**cpu_args(tmp_path / "run", max_completion_length=8)),
            train_dataset=counting_prompts(16),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        )


def test_ppo_config_rejects_bad_fields(tmp_path):
    with pytest.raises(ValueError, match="kl_estimator"):
        trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False, kl_estimator="k9")
    with pytest.raises(ValueError, match="kl_coef"):
        trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False, beta=0.1)
    config = trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False, num_ppo_epochs=3, num_mini_batches=2)
    assert (config.num_iterations, config.steps_per_generation, config.num_generations) == (3, 2, 1)
    # TRL <= 1.12: a mini-batch is gradient_accumulation_steps micro-batches, one optimizer step
    config = trl_scale.PPOConfig(
        output_dir=str(tmp_path), bf16=False, num_mini_batches=2, gradient_accumulation_steps=4
    )
    assert config.steps_per_generation == 8


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_entropy_quantile", 0.2),
        ("entropy_coef", 0.01),
        ("off_policy_mask_threshold", 0.5),
        ("delta", 2.0),
        ("importance_sampling_level", "sequence"),
        ("router_aux_loss_coef", 0.001),
        ("scale_rewards", "batch"),
        ("use_adaptive_entropy", True),
        ("use_bias_correction_kl", False),
        ("steps_per_generation", 3),
        ("num_iterations", 3),
        ("epsilon", 0.3),
    ],
)
def test_grpo_loss_options_ppo_does_not_apply_are_rejected_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"PPOTrainer does not apply {field}="):
        trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False, **{field: value})


def test_a_grpo_option_ppo_does_not_know_is_refused_when_set(tmp_path, monkeypatch):
    """An option a newer TRL adds (here: one taken out of the classification) is refused when set, never ignored."""
    from trl_scale.trainers import ppo_config

    monkeypatch.setattr(ppo_config, "GRPO_FIELDS_PPO_APPLIES", ppo_config.GRPO_FIELDS_PPO_APPLIES - {"top_k"})
    trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False)  # at its default: fine
    with pytest.raises(ValueError, match=r"PPOTrainer does not know top_k=5: GRPO options of a TRL newer"):
        trl_scale.PPOConfig(output_dir=str(tmp_path), bf16=False, top_k=5)


def test_gradient_accumulation_gives_each_epoch_new_micro_batches(tiny_llama, tmp_path):
    """GA=2, one mini-batch, 2 epochs: each optimizer step sees the rollout's 2 different micro-batches, and the
    second epoch's ratios move off 1 (the first epoch's step changed the policy)."""
    seen = []
    trainer = _ppo(
        tiny_llama,
        tmp_path,
        max_steps=2,
        num_ppo_epochs=2,
        num_mini_batches=1,
        gradient_accumulation_steps=2,
        per_device_train_batch_size=4,
        learning_rate=5e-2,
    )
    compute_loss = trainer._compute_loss

    def recording(model, inputs):
        seen.append(inputs["completion_ids"].clone())
        return compute_loss(model, inputs)

    trainer._compute_loss = recording
    trainer.train()
    assert len(seen) == 4  # 2 optimizer steps x 2 micro-batches
    assert not torch.equal(seen[0], seen[1])  # one step's micro-batches are different rows
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[3])  # the second epoch, same rollout
    ratios = [e["val/ratio"] for e in trainer.state.log_history if "val/ratio" in e]
    assert ratios and abs(ratios[-1] - 1.0) > 1e-6


def test_the_trainer_uses_the_advantages_its_rollout_defines(tiny_llama, tmp_path, monkeypatch):
    """Wiring: values recomputed with a plain critic forward (value of the state before each token), k1 KL from the
    policy's and reference's log-probs, the score (minus the EOS penalty where the completion does not end in EOS)
    on the last token, GAE by a plain loop, whitening: equal to what the trainer trains on."""
    from trl_scale.trainers import ppo_trainer

    captured = {}
    kl_penalty = ppo_trainer.ppo_core.kl_penalty

    def spy_kl(logprobs, ref_logprobs, estimator="k1"):
        captured["logps"], captured["ref"] = logprobs.clone(), ref_logprobs.clone()
        return kl_penalty(logprobs, ref_logprobs, estimator)

    monkeypatch.setattr(ppo_trainer.ppo_core, "kl_penalty", spy_kl)
    # Three steps with two mini-batches per rollout: the last rollout comes after two updates, so the policy has left
    # the reference (a non-zero KL) and the critic has trained.
    trainer = _ppo(
        tiny_llama,
        tmp_path,
        max_steps=3,
        num_ppo_epochs=1,
        missing_eos_penalty=1.0,
        kl_coef=0.2,
        lam=0.9,
        gamma=0.95,
        learning_rate=1e-2,
    )
    generate, calculate_rewards = trainer._generate_and_score_completions, trainer._calculate_rewards

    def keep(inputs):
        critic_state = {k: v.clone() for k, v in trainer.value_model.state_dict().items()}
        batch = generate(inputs)
        captured["critic"] = critic_state
        captured["batch"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        return batch

    def keep_rewards(*args):
        rewards = calculate_rewards(*args)
        captured["rewards"] = rewards.clone()  # the batch's, as TRL gathered them
        return rewards

    trainer._generate_and_score_completions = keep
    trainer._calculate_rewards = keep_rewards
    trainer.train()
    batch = captured["batch"]
    prompt_ids, completion_ids = batch["prompt_ids"], batch["completion_ids"]
    mask = batch["completion_mask"].float()
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    values = batch["values"]
    critic = copy.deepcopy(trainer.value_model).eval()
    critic.load_state_dict(captured["critic"])  # the critic as it was at that rollout
    with torch.no_grad():
        hidden = critic.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state
        expected_values = critic.score(hidden).squeeze(-1)[:, prompt_ids.size(1) - 1 : -1] * mask
    assert torch.allclose(values, expected_values, atol=1e-5), (values - expected_values).abs().max()
    assert (captured["logps"] - captured["ref"]).abs().max() > 1e-3  # the KL term is really exercised

    kl = (captured["logps"] - captured["ref"]) * mask
    scores = captured["rewards"].nansum(1)
    lengths = mask.sum(1).long()
    final = completion_ids[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)]
    ends_with_eos = (lengths > 0) & torch.isin(final, torch.tensor(trainer.eos_token_ids))
    scores = scores - 1.0 * (~ends_with_eos).float()
    rewards = -0.2 * kl
    for row, n in enumerate(lengths.tolist()):
        if n:
            rewards[row, n - 1] += scores[row]
    advantages, returns = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.9)
    advantages, returns = torch.tensor(advantages), torch.tensor(returns)
    advantages = ppo_core.masked_whiten(advantages, mask) * mask
    assert torch.allclose(batch["advantages"], advantages, atol=1e-5), (batch["advantages"] - advantages).abs().max()
    assert torch.allclose(batch["returns"], returns, atol=1e-5)


def test_ppo_packed_and_padded_critic_agree(tiny_llama, tmp_path):
    settings = dict(max_steps=2, optim="sgd", num_ppo_epochs=1, num_mini_batches=1)
    on = _ppo(tiny_llama, tmp_path / "on", padding_free=True, **settings)
    on.train()
    off = _ppo(tiny_llama, tmp_path / "off", padding_free=False, **settings)
    off.train()
    keys = ("loss", "loss/value", "val/vpred", "objective/kl", "grad_norm")
    for a, b in paired(step_logs(on, keys), step_logs(off, keys)):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert os.path.isdir(tmp_path / "on")


def test_the_local_and_ray_critics_implement_one_critic_interface():
    """PPOTrainer talks to `Critic` only: both implementations carry every member, with the same parameters."""
    import inspect

    from trl_scale.critic import Critic, CriticUpdater
    from trl_scale.critic.ray import RayCritic

    members = [name for name in vars(Critic) if not name.startswith("_")]
    assert {"values", "step_async", "set_scheduler", "weights", "shard_bytes"} <= set(members)
    for implementation in (CriticUpdater, RayCritic):
        for name in members:
            expected = inspect.signature(getattr(Critic, name)).parameters
            got = inspect.signature(getattr(implementation, name)).parameters
            assert list(got) == list(expected), (implementation.__name__, name, list(got))
        source = inspect.getsource(implementation)
        for attribute in Critic.__annotations__:  # scheduler, grad_norm
            assert f"self.{attribute}" in source or f"def {attribute}" in source, (implementation.__name__, attribute)
