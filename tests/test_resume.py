"""Exact resume for every trainer: a run stopped at step 2 and resumed from its checkpoint continues as the
uninterrupted run does: the same steps 3-4, final weights (policy and critic), optimizer and scheduler states. A
resume that changes the packing settings gives the same numbers to the tolerance of packed-vs-padded rounding."""

import pytest
import torch
from transformers import AutoTokenizer

import trl_scale
from trl_scale.toy import counting_prompts, preference_pairs

from .helpers import cpu_args, paired, saved_state, step_logs, token_parity_reward

KEYS = {
    "grpo": ("loss", "grad_norm", "reward", "entropy", "kl"),
    "rloo": ("loss", "grad_norm", "reward", "entropy", "kl"),
    "dpo": ("loss", "grad_norm", "rewards/margins", "logps/chosen", "logps/rejected"),
    "ppo": ("loss", "grad_norm", "reward", "loss/value", "val/vpred", "objective/kl"),
}


def _trainer(method, model_path, out, **overrides):
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, lr_scheduler_type="linear", warmup_steps=1)
    settings.update(overrides)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if method == "dpo":
        config = trl_scale.DPOConfig(**cpu_args(out, max_length=64, **settings))
        return trl_scale.DPOTrainer(
            model=model_path, args=config, train_dataset=preference_pairs(64, seed=0), processing_class=tokenizer
        )
    online = dict(max_completion_length=8, **settings)
    if method == "ppo":
        config = trl_scale.PPOConfig(**cpu_args(out, kl_coef=0.05, num_ppo_epochs=2, num_mini_batches=2, **online))
        trainer_cls = trl_scale.PPOTrainer
    else:
        config_cls = getattr(trl_scale, f"{method.upper()}Config")
        config = config_cls(**cpu_args(out, num_generations=4, beta=0.05, **online))
        trainer_cls = getattr(trl_scale, f"{method.upper()}Trainer")
    return trainer_cls(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config,
        train_dataset=counting_prompts(64, seed=0),
        processing_class=tokenizer,
    )


def _max_diff(a: dict, b: dict) -> float:
    """Largest difference between two (nested) state dicts of tensors and numbers, which must share their keys."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            worst = max(worst, _max_diff(x, y))
        elif isinstance(x, torch.Tensor):
            assert x.shape == y.shape, key
            worst = max(worst, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), key
            worst = max([worst] + [_max_diff({0: p}, {0: q}) for p, q in zip(x, y)])
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            worst = max(worst, abs(x - y))
        else:
            assert x == y, (key, x, y)
    return worst


def _states(trainer) -> dict:
    model = trainer.accelerator.unwrap_model(trainer.model)
    states = {
        "policy": {k: v.detach() for k, v in model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict()["state"],
        "scheduler": trainer.lr_scheduler.state_dict(),
    }
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        state = critic.state()
        states.update(critic=state["model"], critic_optimizer=state["optimizer"]["state"])
        states["critic_scheduler"] = state["scheduler"]
    return states


@pytest.mark.parametrize("method", ["grpo", "rloo", "dpo", "ppo"])
def test_resume_continues_exactly(method, tiny_llama, tmp_path):
    full = _trainer(method, tiny_llama, tmp_path / "full")
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"
    resumed = _trainer(method, tiny_llama, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))

    expected, got = step_logs(full, KEYS[method]), step_logs(resumed, KEYS[method])
    assert len(expected) == len(got) == 4  # the resumed history holds the checkpoint's 2 steps, then its own 2
    for step, (e, g) in enumerate(zip(expected[2:], got[2:]), start=3):
        # Rollout metrics (reward, KL) are logged only on steps that generate; loss and grad norm on every step.
        assert e.keys() == g.keys() and {"loss", "grad_norm"} <= set(e), (step, e, g)
        for key in e:
            assert g[key] == pytest.approx(e[key], abs=1e-6), (method, step, key, g[key], e[key])
    full_states, resumed_states = _states(full), _states(resumed)
    assert full_states.keys() == resumed_states.keys()
    for name in full_states:
        assert _max_diff(full_states[name], resumed_states[name]) <= 1e-6, (method, name)
    assert resumed_states["scheduler"]["last_epoch"] == 4 and full.state.global_step == resumed.state.global_step


@pytest.mark.parametrize("change", [{"padding_free": False}, {"token_budget": 16}])
def test_resume_across_a_changed_packing_setting(change, tiny_llama, tmp_path):
    """Packing is a layout, not state: a run resumed with other packing settings continues with the same numbers to
    the rounding of packed vs padded scoring (1e-6 here, so 1e-4 after two Adam steps)."""
    full = _trainer("grpo", tiny_llama, tmp_path / "full")
    full.train()
    resumed = _trainer("grpo", tiny_llama, tmp_path / "resumed", **change)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    expected, got = step_logs(full, KEYS["grpo"])[2:], step_logs(resumed, KEYS["grpo"])[2:]
    assert len(expected) == len(got) == 2
    for e, g in paired(expected, got):
        for key in KEYS["grpo"]:
            assert g[key] == pytest.approx(e[key], abs=1e-4), (key, g[key], e[key])
    assert _max_diff(_states(full)["policy"], _states(resumed)["policy"]) <= 1e-4


def test_a_rank_that_reaches_the_checkpoint_before_its_folder_exists_still_saves_its_rollout(
    tiny_llama, tmp_path, monkeypatch
):
    """Under several processes, rank 1 saves its rollout while rank 0 may still be writing the model, before the
    checkpoint folder exists. (A two-process PPO run in CI lost rank 1 to FileNotFoundError this way.)"""
    from transformers import TrainingArguments

    trainer = _trainer("grpo", tiny_llama, tmp_path / "run", max_steps=1)
    trainer.train()
    assert trainer._buffered_inputs is not None
    monkeypatch.setattr(TrainingArguments, "should_save", property(lambda self: False))  # as on rank 1
    folder = tmp_path / "run" / "checkpoint-not-yet-created"
    trainer._save_optimizer_and_scheduler(str(folder))
    assert saved_state(folder, "rollout_resume") is not None


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_resume_inside_a_rollout_window_continues_exactly(method, tiny_llama, tmp_path):
    """GRPO and RLOO with a rollout spanning 2 optimizer steps × 2 iterations: checkpoint-3 lies inside a window,
    and the resumed run trains on the saved rollout (TRL would sample a new one and diverge)."""
    window = dict(steps_per_generation=2, num_iterations=2, max_steps=6, save_steps=3)
    full = _trainer(method, tiny_llama, tmp_path / "full", **window)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert saved_state(checkpoint, "rollout_resume") is not None
    resumed = _trainer(method, tiny_llama, tmp_path / "resumed", **window)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    expected, got = step_logs(full, ("loss", "grad_norm")), step_logs(resumed, ("loss", "grad_norm"))
    for e, g in paired(expected[3:], got[3:]):
        assert g == pytest.approx(e, abs=1e-6)
    assert _max_diff(_states(full)["policy"], _states(resumed)["policy"]) <= 1e-6


def test_resume_inside_a_rollout_window_on_another_number_of_processes_is_refused(tiny_llama, tmp_path):
    """Saved by 2 processes (two rollout buffers), resumed by 1: a clear error before any step, never a hang."""
    import shutil

    run = _trainer("grpo", tiny_llama, tmp_path / "run", steps_per_generation=2, max_steps=1, save_steps=1)
    run.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    shutil.copy(checkpoint / "trl_scale_state_rank0.pt", checkpoint / "trl_scale_state_rank1.pt")  # as 2 ranks save
    resumed = _trainer("grpo", tiny_llama, tmp_path / "resumed", steps_per_generation=2, max_steps=2)
    with pytest.raises(ValueError, match=r"saved inside a rollout window by 2 process\(es\).*this run has 1.*Fix"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 1 and (checkpoint / "trl_scale_state_rank1.pt").exists()


def test_resume_inside_a_rollout_window_with_another_window_is_refused(tiny_llama, tmp_path):
    """Saved at step 1 of a 4-step window, resumed with steps_per_generation=2: the saved rollout is cut in 4 and TRL
    would index it by 2 (a raw IndexError, or the wrong micro-batches). Refused before any step, naming both."""
    run = _trainer("grpo", tiny_llama, tmp_path / "run", steps_per_generation=4, max_steps=1, save_steps=1)
    run.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    resumed = _trainer("grpo", tiny_llama, tmp_path / "resumed", steps_per_generation=2, max_steps=2)
    with pytest.raises(ValueError, match=r"rollout window of steps_per_generation=4 \(now 2\).*Fix: resume with"):
        resumed.train(resume_from_checkpoint=str(checkpoint))


@pytest.mark.parametrize("damage", ["value_model", "everything_of_the_critic"])
def test_resume_from_a_ppo_checkpoint_without_its_critic_says_what_is_missing(damage, tiny_llama, tmp_path):
    import shutil

    run = _trainer("ppo", tiny_llama, tmp_path / "run", max_steps=1, save_steps=1)
    run.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    shutil.rmtree(checkpoint / "value_model")
    if damage == "everything_of_the_critic":  # as a GRPO checkpoint would be
        (checkpoint / "critic_optimizer.pt").unlink()
        match = r"it has no critic \(value_model/\): it was not saved by PPOTrainer"
    else:
        match = r"critic's weights \(value_model/model.safetensors\) are missing, though PPOTrainer saved them"
    resumed = _trainer("ppo", tiny_llama, tmp_path / "resumed", max_steps=2)
    with pytest.raises(FileNotFoundError, match=match + r".*Fix: restore value_model/"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
