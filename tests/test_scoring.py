"""The scoring engine: chunked head vs full logits, the packing planner and layout, packed vs padded forwards
(values and gradients), the no-mask/no-cache rule, and trainers with padding_free on vs off."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

import trl_scale
from trl_scale.scoring import (
    ChunkedLogProbHead,
    UnpaddedRows,
    install_packed_scoring,
    pack_padded_batch,
    plan_micro_batches,
    plan_rows,
    unpack,
)
from trl_scale.toy import counting_prompts, preference_pairs
from trl_scale.trainers.packing import PackedScoring

from .helpers import cpu_args, max_param_diff, padded_scoring_batch, paired, step_logs, token_parity_reward

ALL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _full_logits_reference(hidden, weight, bias, targets, temperature, softcap, scale):
    z = (hidden @ weight.T + bias) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logp = z.log_softmax(-1)
    return (
        logp.gather(1, targets[:, None])[:, 0],
        -(logp.exp() * logp).sum(-1),
        torch.logsumexp(2 * logp, -1),
        z.mean(-1),
        z.argmax(-1) == targets,
    )


# fp64: the two paths agree to rounding (~1e-14), so 1e-6 is a real bound; fp32: both round, 1e-5 relative.
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
@pytest.mark.parametrize("temperature, softcap, scale", [(1.0, None, 1.0), (0.7, 4.0, 1.0), (1.3, None, 0.5)])
def test_chunked_head_matches_full_logits(temperature, softcap, scale, dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(53, 32, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(211, 32, generator=generator, dtype=dtype).requires_grad_()
    bias = torch.randn(211, generator=generator, dtype=dtype).requires_grad_()
    targets = torch.randint(0, 211, (53,), generator=generator)
    targets[:5] = torch.randn(5, 211, generator=generator).argmax(-1)
    ours = ChunkedLogProbHead.apply(hidden, weight, bias, targets, temperature, 16, softcap, scale, ALL_OUTPUTS)
    reference = _full_logits_reference(hidden, weight, bias, targets, temperature, softcap, scale)
    for name, a, b in zip(("logp", "entropy", "log_sum_sq", "mean"), ours[:4], reference[:4]):
        assert (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item()), name
    assert torch.equal(ours[4], reference[4])
    g_lp, g_h = torch.randn(53, generator=generator, dtype=dtype), torch.randn(53, generator=generator, dtype=dtype)
    grads = torch.autograd.grad((ours[0] * g_lp + ours[1] * g_h).sum(), (hidden, weight, bias))
    ref_grads = torch.autograd.grad((reference[0] * g_lp + reference[1] * g_h).sum(), (hidden, weight, bias))
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item())


def test_planner_respects_budget_balances_and_isolates_long_sequences():
    lengths = [5, 1, 9, 3, 12, 7, 2]
    plan = plan_micro_batches(lengths, token_budget=12)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in mb) <= 12 for mb in plan)
    assert [4] in plan  # the sequence that fills the whole budget is alone
    assert plan_micro_batches([30, 2], token_budget=8) == [[0], [1]]  # longer than the budget: its own micro-batch
    exact = plan_micro_batches(lengths, token_budget=None, num_micro_batches=3)
    assert len(exact) == 3 and all(exact) and sorted(i for mb in exact for i in mb) == list(range(len(lengths)))
    padded = plan_micro_batches([4], token_budget=None, num_micro_batches=2)
    assert padded == [[0], []]  # a rank with too few sequences gets an empty slot (filled by a dummy forward)
    with pytest.raises(ValueError, match="fewer"):
        plan_micro_batches(lengths, token_budget=12, num_micro_batches=1)


def test_pack_padded_batch_layout_left_and_right_padding():
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13], [0, 0, 0, 14, 0, 0]])
    mask = (input_ids != 0).long()
    packed = pack_padded_batch(input_ids, mask)
    (mb,) = packed.micro_batches
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0]]
    assert mb.cu_seq_lens.tolist() == [0, 3, 9, 10] and mb.max_length == 6
    assert packed.pad_fraction_removed == pytest.approx(1 - 10 / 18)
    restored = unpack(mb.input_ids[0].float(), mb.flat_index, 3, 6)
    assert torch.equal(restored.long(), input_ids)


def test_dense_layout_lays_sequences_in_rows_no_wider_than_the_longest():
    """sdpa/eager layout: first fit by decreasing length into rows as wide as the longest sequence, one forward of
    [rows, width]; a row's leftover is filler whose positions restart (a sequence of its own, outputs dropped)."""
    lengths = [6, 2, 3, 4, 1]
    assert plan_rows(lengths, [0, 1, 2, 3, 4], 6) == [[0], [1, 3], [2, 4]]  # 16 tokens in 3 rows of 6
    assert plan_rows(lengths, [1, 4], None) == [[1, 4]]  # varlen: one row
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13], [0, 0, 0, 14, 0, 0], [15, 16, 0, 0, 0, 0]])
    mask = (input_ids != 0).long()
    (mb,) = pack_padded_batch(input_ids, mask, row_capacity="longest").micro_batches
    assert mb.input_ids.shape == (2, 6)  # lengths 3, 6, 1, 2 -> rows [6] and [3, 2, 1]
    assert mb.input_ids.tolist() == [[8, 9, 10, 11, 12, 13], [5, 6, 7, 14, 15, 16]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 0, 1]]
    restored = unpack(mb.real_tokens(mb.input_ids).float(), mb.flat_index, 4, 6)
    assert torch.equal(restored.long(), input_ids)
    # With filler: width 4 (the longest), rows [4], [3, 1] ... and a row [2] + 2 filler positions restarting at 0.
    input_ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0], [8, 0, 0, 0], [9, 10, 0, 0]])
    (mb,) = pack_padded_batch(input_ids, (input_ids != 0).long(), row_capacity="longest").micro_batches
    assert mb.input_ids.shape == (3, 4)
    assert mb.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert mb.seq_idx.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 1]]
    assert mb.token_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_unpadded_rows_carry_only_real_tokens_and_rebuild_the_batch():
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 0], [8, 9, 10, 11, 12, 13], [0, 0, 0, 14, 0, 0]])
    mask = (input_ids != 0).long()
    rows = UnpaddedRows.from_padded(input_ids, mask)
    assert rows.tokens.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] and rows.mask.dtype == torch.bool
    rebuilt_ids, rebuilt_mask = rows.to_padded(pad_token_id=0)
    assert torch.equal(rebuilt_ids, input_ids) and torch.equal(rebuilt_mask, mask)
    # Row shards as tensor_split makes them, including empty ones when there are more shards than rows.
    for n in (2, 3, 5):
        shards = rows.split(n)
        assert len(shards) == n
        for shard, ids, m in zip(shards, input_ids.tensor_split(n), mask.tensor_split(n)):
            assert shard.num_rows == ids.size(0)
            got_ids, got_mask = shard.to_padded()
            assert torch.equal(got_ids, ids) and torch.equal(got_mask, m)


def _score(model, input_ids, mask, labels):
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    valid = out.label_mask
    objective = (out.log_probs * valid).sum() + 0.3 * (out.entropy * valid).sum()
    grads = torch.autograd.grad(objective, [p for p in model.parameters() if p.requires_grad])
    return out, valid, grads


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("token_budget", [None, 10])  # 10 = the longest sequence: it fills one alone
def test_packed_matches_padded_values_and_gradients(tiny_model_path, lora, token_budget):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.eval()  # eval mode: a default KV cache would leak across packed sequences if it slipped in
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    packed_model = copy.deepcopy(model)
    base = packed_model.get_base_model() if lora else packed_model
    config = install_packed_scoring(
        base, token_budget=token_budget, logprob_chunk_size=5, temperature=0.7, outputs=("entropy",)
    )

    input_ids, mask, labels = padded_scoring_batch(tokenizer)
    reference, valid, ref_grads = _score(model, input_ids, mask, labels)
    packed, packed_valid, grads = _score(packed_model, input_ids, mask, labels)
    assert config.stats.calls == 1 and config.stats.fallbacks == 0
    assert torch.equal(valid, packed_valid)
    assert (packed.log_probs - reference.log_probs).abs().max().item() <= 1e-5
    assert (packed.entropy - reference.entropy).abs().max().item() <= 1e-5
    assert (packed.log_probs[~valid] == 0).all()
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() <= 1e-5
    if token_budget is not None:
        assert max(config.stats.tokens_per_micro_batch) <= token_budget


def test_packed_forward_never_gets_a_mask_or_a_cache(tiny_llama):
    """The leak guard: in eval mode transformers would build a cache, and any 2D mask disables packing detection;
    both let packed sequences attend to each other. Every backbone call must see neither."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    add_fused_lm_head(model, outputs=("log_probs",))
    install_packed_scoring(model)
    seen = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(tiny_llama))
    packed = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert seen and all(k.get("attention_mask") is None and k.get("use_cache") is False for k in seen)
    assert all(k.get("past_key_values") is None for k in seen)
    # And the consequence the rule prevents: with an all-ones mask on the packed row the values change.
    mb = pack_padded_batch(input_ids, mask).micro_batches[0]
    leaked = model.model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=torch.ones_like(mb.input_ids),
        use_cache=False,
    )
    clean = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None, use_cache=False)
    assert (leaked.last_hidden_state - clean.last_hidden_state).abs().max() > 1e-3
    assert packed.log_probs.shape == (input_ids.shape[0], input_ids.shape[1] - 1)


@pytest.mark.parametrize("field, value", [("token_budget", 0), ("logprob_chunk_size", -1)])
def test_bad_scoring_config_names_the_field(field, value, tmp_path):
    with pytest.raises(ValueError, match=field):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), bf16=False, **{field: value})


# SGD, not Adam: Adam's first step is ~lr * sign(grad), which turns rounding-level gradient differences on
# near-zero entries into lr-sized weight differences and would hide real ones.
def _grpo_like(trainer_cls, config_cls, model_path, tmp_path, **overrides):
    overrides.setdefault("optim", "sgd")
    config = config_cls(
        **cpu_args(tmp_path, num_generations=4, max_completion_length=8, beta=0.05, max_steps=2, **overrides)
    )
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=token_parity_reward,
        args=config,
        train_dataset=counting_prompts(64, seed=0),
        processing_class=AutoTokenizer.from_pretrained(model_path),
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_online_trainers_padding_free_on_vs_off(method, tiny_qwen2, tmp_path):
    classes = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
    }
    off = _grpo_like(*classes[method], tiny_qwen2, tmp_path / "off", padding_free=False)
    on = _grpo_like(*classes[method], tiny_qwen2, tmp_path / "on", padding_free=True, token_budget=24)
    keys = ("loss", "grad_norm", "entropy", "kl", "reward")
    for a, b in paired(step_logs(on, keys), step_logs(off, keys)):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert max_param_diff(on.model, off.model) <= 1e-5
    logged = [e for e in on.state.log_history if "padding_free/pad_fraction_removed" in e]
    assert logged and all(0.0 < e["padding_free/pad_fraction_removed"] < 1.0 for e in logged)
    assert all(e["padding_free/tokens_per_micro_batch"] <= 24 for e in logged)
    assert not any("padding_free/pad_fraction_removed" in e for e in off.state.log_history)


def test_dpo_padding_free_on_vs_off(tiny_llama, tmp_path):
    def run(out, **kw):
        trainer = trl_scale.DPOTrainer(
            model=tiny_llama,
            args=trl_scale.DPOConfig(**cpu_args(out, max_length=64, max_steps=2, optim="sgd", **kw)),
            train_dataset=preference_pairs(32, seed=0),
            processing_class=AutoTokenizer.from_pretrained(tiny_llama),
        )
        trainer.train()
        return trainer

    off, on = run(tmp_path / "off", padding_free=False), run(tmp_path / "on", padding_free=True)
    assert on.args.padding_free is True  # TRL's constructor must not have switched it off
    keys = ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins", "entropy", "mean_token_accuracy")
    for a, b in paired(step_logs(on, keys), step_logs(off, keys)):
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert max_param_diff(on.model, off.model) <= 1e-5
    assert any("padding_free/pad_fraction_removed" in e for e in on.state.log_history)


def test_a_rank_with_fewer_micro_batches_runs_a_dummy_forward(tiny_llama, monkeypatch):
    """Under ZeRO-3/FSDP every rank must run as many forwards as the busiest one. Pretend another rank needs two
    more: this rank splits its batch and adds a dummy forward, and the values and gradients stay exact."""
    import trl_scale.scoring.engine as engine

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    packed_model = copy.deepcopy(model)
    config = install_packed_scoring(packed_model, outputs=("entropy",), tree_packing=False)  # rows (trees: their test)
    calls = []
    real_forward = packed_model.model.forward
    monkeypatch.setattr(packed_model.model, "forward", lambda *a, **k: calls.append(k) or real_forward(*a, **k))
    monkeypatch.setattr(engine, "_same_count_on_every_rank", lambda count, device: count + 5)  # 4 sequences -> 6
    input_ids, mask, labels = padded_scoring_batch(AutoTokenizer.from_pretrained(tiny_llama))
    reference, valid, ref_grads = _score(model, input_ids, mask, labels)
    packed, _, grads = _score(packed_model, input_ids, mask, labels)
    assert len(calls) == 6 and config.stats.micro_batches == 6  # 4 single-sequence rows + 2 dummies
    assert (packed.log_probs - reference.log_probs).abs().max().item() <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() <= 1e-5


def test_dpo_precomputed_reference_goes_through_the_packed_engine(tiny_llama, tmp_path):
    """TRL precomputes reference log-probs inside its constructor; they must be scored by the same packed engine as
    the policy (before the fix they took TRL's padded path: no packed call during construction)."""
    trainer = trl_scale.DPOTrainer(
        model=tiny_llama,
        args=trl_scale.DPOConfig(
            **cpu_args(tmp_path, max_length=64, max_steps=1, learning_rate=0.0, precompute_ref_log_probs=True)
        ),
        train_dataset=preference_pairs(16, seed=0),
        processing_class=AutoTokenizer.from_pretrained(tiny_llama),
    )
    assert trainer.features.get(PackedScoring).stats is not None
    assert (
        trainer.features.get(PackedScoring).stats.calls == 2
        and trainer.features.get(PackedScoring).stats.fallbacks == 0
    )  # 16 pairs / 8 per batch
    assert "ref_chosen_logps" in trainer.train_dataset.column_names
    trainer.train()
    (logs,) = step_logs(trainer, ("rewards/chosen", "rewards/rejected"))
    # learning_rate 0: the policy is the reference, so both rewards vanish (to the rounding of two packings).
    assert abs(logs["rewards/chosen"]) <= 1e-6 and abs(logs["rewards/rejected"]) <= 1e-6
