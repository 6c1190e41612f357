"""Tree packing in the scoring engine (issue 61): a scoring call's rows that share a prefix forwarded once as a trie.

Ground truth is each row scored alone through TRL's own fused forward, and today's packed rows (`tree_packing=False`):
log-probs, entropies and gradients within 1e-5 (fp32) on every family the packing probe knows exact, with a group's
prompt, a DPO pair's prompt and a conversation's earlier turns in one call. Planted faults (a segment that does not
see its path, a shared node's gradient counted once) turn the comparisons red; the settings are read from the
config, the trainer YAML and the command line."""

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

import trl_scale
from trl_scale.cli import main
from trl_scale.scoring import install_packed_scoring, token_scores, tree_forward
from trl_scale.scoring.tree import PrefixTrie, TreeRows

from .helpers import ROOT

FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gpt2", "mistral", "gemma3", "gemma2"]  # gemma2: eager, dense mask
TOLERANCE = 1e-5


def _batch(seed: int = 0, prompt: int = 4, longest: int = 8):
    """TRL's layout (left-padded prompts, right-padded completions, labels on completions) holding: a group of four
    completions of one prompt, a DPO-like pair of another, a conversation and its continuation (the second row's
    prompt is the first row whole), and a row sharing nothing. Rows of at most `longest` tokens (the toy windows)."""
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, 90, (n,), generator=generator).tolist()

    group = tokens(prompt)
    pair = tokens(prompt - 1)
    turn = tokens(3)
    rows = [(group, tokens(n)) for n in (4, 1, 3, 2)]
    rows += [(pair, tokens(3)), (pair, tokens(2))]
    first = tokens(2)
    rows += [(turn, first), (turn + first, tokens(longest - 5)), (tokens(2), tokens(3))]
    width_p = max(len(p) for p, _ in rows)
    width_c = max(len(c) for _, c in rows)
    ids, mask, labels = [], [], []
    for p, c in rows:
        assert len(p) + len(c) <= longest
        left, right = width_p - len(p), width_c - len(c)
        ids.append([0] * left + p + c + [0] * right)
        mask.append([0] * left + [1] * (len(p) + len(c)) + [0] * right)
        labels.append([-100] * width_p + c + [-100] * right)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def _objective(out):
    return (out.log_probs * out.label_mask).sum() + 0.3 * (out.entropy * out.label_mask).sum()


def _scored(model, ids, mask, labels):
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    grads = torch.autograd.grad(_objective(out), [p for p in model.parameters() if p.requires_grad])
    return out, grads


def _models(path, **tree):
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    rows, trees = copy.deepcopy(model), copy.deepcopy(model)
    install_packed_scoring(rows, temperature=0.7, outputs=("entropy",), tree_packing=False)
    config = install_packed_scoring(trees, temperature=0.7, outputs=("entropy",), **({"tree_packing": True} | tree))
    return model, rows, trees, config


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_rows_score_as_each_row_alone_and_as_packed_rows(zoo, family):
    model, rows, trees, config = _models(zoo(family))
    ids, mask, labels = _batch()
    tree_out, tree_grads = _scored(trees, ids, mask, labels)
    rows_out, rows_grads = _scored(rows, ids, mask, labels)
    stats = config.stats.pop()
    assert stats["tree_packing/fraction_of_calls"] == 1.0 and stats["tree_packing/share_ratio"] > 1.3
    for name in ("log_probs", "entropy"):
        assert (getattr(tree_out, name) - getattr(rows_out, name)).abs().max().item() <= TOLERANCE, name
    assert torch.equal(tree_out.label_mask, rows_out.label_mask)
    assert _max_diff(tree_grads, rows_grads) <= TOLERANCE
    total = 0.0  # each row alone, through TRL's own forward
    for row in range(ids.size(0)):
        real = mask[row].bool()
        start, length = int(real.nonzero()[0]), int(real.sum())
        alone = model(input_ids=ids[row, real][None], labels=labels[row, real][None], fused_lm_head=True)
        got = tree_out.log_probs[row, start : start + length - 1]
        assert (got - alone.log_probs[0]).abs().max().item() <= TOLERANCE, row
        total = total + _objective(alone)
    alone_grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])
    assert _max_diff(tree_grads, alone_grads) <= TOLERANCE


def test_a_segment_blind_to_its_path_or_a_shared_gradient_counted_once_is_caught(zoo, monkeypatch):
    """The two ways tree rows go wrong, planted past the probe: the comparisons above see each."""
    _, rows, trees, _ = _models(zoo("qwen2"))
    ids, mask, labels = _batch()
    rows_out, rows_grads = _scored(rows, ids, mask, labels)
    monkeypatch.setattr(tree_forward, "probe_tree", lambda backbone, kernel: (True, ""))
    segments = PrefixTrie._segments

    def blind(self, order, start, path):  # each segment's keys: itself only, not the path above it
        return segments(self, order, start, [[edge] for edge in range(len(path))])

    monkeypatch.setattr(PrefixTrie, "_segments", blind)
    blind_out, _ = _scored(copy.deepcopy(trees), ids, mask, labels)
    assert (blind_out.log_probs - rows_out.log_probs).abs().max().item() > 1e-2
    monkeypatch.setattr(PrefixTrie, "_segments", segments)

    def once(hidden, nodes):  # a shared node's hidden state read with gradient by its first reader only
        seen, picked = set(), []
        for node in nodes.tolist():
            picked.append(hidden[node] if node not in seen else hidden[node].detach())
            seen.add(node)
        return torch.stack(picked)

    monkeypatch.setattr(tree_forward, "gathered", once)
    once_out, once_grads = _scored(trees, ids, mask, labels)
    assert (once_out.log_probs - rows_out.log_probs).abs().max().item() <= TOLERANCE  # the same numbers forward ...
    assert _max_diff(once_grads, rows_grads) > 1e-3  # ... not the same gradients


def test_the_probe_refuses_a_kernel_that_ignores_the_path(zoo, monkeypatch):
    """Without the planted pass: the same blind segments make the probe say no, and tree_packing=True an error."""
    segments = PrefixTrie._segments
    monkeypatch.setattr(
        PrefixTrie,
        "_segments",
        lambda self, order, start, path: segments(self, order, start, [[e] for e in range(len(path))]),
    )
    _, _, trees, _ = _models(zoo("llama"))
    ids, mask, labels = _batch()
    with pytest.raises(ValueError, match=r"tree_packing=True.*'llama'.*ignores the path.*Fix: tree_packing='auto'"):
        trees(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def test_auto_shares_where_it_pays_and_steps_aside_with_a_warning_where_it_cannot(zoo, caplog):
    _, rows, auto, config = _models(zoo("llama"), tree_packing="auto")
    ids, mask, labels = _batch()
    with torch.no_grad():
        auto(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        assert config.stats.pop()["tree_packing/fraction_of_calls"] == 1.0
        alone = [8, 3]  # two rows sharing nothing: no tree
        auto(input_ids=ids[alone], attention_mask=mask[alone], labels=labels[alone], fused_lm_head=True)
        assert config.stats.pop()["tree_packing/fraction_of_calls"] == 0.0
    # a sliding window shorter than a row: packed rows, one warning naming why, the numbers of packed rows
    _, rows, auto, config = _models(zoo("mistral"), tree_packing="auto")
    ids, mask, labels = _batch(longest=10)
    with caplog.at_level(logging.WARNING, logger="trl_scale"), torch.no_grad():
        for _ in range(2):
            out = auto(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    expected = rows(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert torch.equal(out.log_probs, expected.log_probs)
    warned = [r.getMessage() for r in caplog.records if "tree packing steps aside" in r.getMessage()]
    assert len(warned) == 1 and "sliding window of 8 tokens" in warned[0]
    assert config.stats.pop()["tree_packing/fraction_of_calls"] == 0.0


def test_the_token_budget_counts_unique_tokens(zoo):
    """Eight rows holding one 12-token prompt: 104 tokens as rows, 28 unique. A budget of 32 is one forward of tree
    rows where packed rows need four; the numbers agree."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 90, (12,), generator=generator)
    ids = torch.stack([torch.cat([prompt, torch.randint(5, 90, (2,), generator=generator)]) for _ in range(8)])
    mask, labels = torch.ones_like(ids), ids.clone()
    labels[:, :12] = -100
    _, rows, trees, config = _models(zoo("qwen3"), token_budget=32)
    rows_config = rows._trl_scale_packed_scoring
    rows_config.settings = type(rows_config.settings)(**{**rows_config.settings.__dict__, "token_budget": 32})
    tree_out, tree_grads = _scored(trees, ids, mask, labels)
    rows_out, rows_grads = _scored(rows, ids, mask, labels)
    assert config.stats.micro_batches == 1 and config.stats.tree_tokens == 12 + 8 * 2
    assert rows_config.stats.micro_batches == 4
    assert (tree_out.log_probs - rows_out.log_probs).abs().max().item() <= TOLERANCE
    assert _max_diff(tree_grads, rows_grads) <= TOLERANCE


def test_a_rank_with_fewer_tries_runs_a_dummy_forward(zoo, monkeypatch):
    """As for packed rows: pretend another rank needs two more forwards; the numbers stay exact."""
    import trl_scale.scoring.engine as engine

    _, rows, trees, config = _models(zoo("llama"))
    monkeypatch.setattr(engine, "_same_count_on_every_rank", lambda count, device: count + 2)
    ids, mask, labels = _batch()
    tree_out, tree_grads = _scored(trees, ids, mask, labels)
    rows_out, rows_grads = _scored(rows, ids, mask, labels)
    assert config.stats.micro_batches == 3 and config.stats.tree_calls == 1
    assert (tree_out.log_probs - rows_out.log_probs).abs().max().item() <= TOLERANCE
    assert _max_diff(tree_grads, rows_grads) <= TOLERANCE


def test_a_critics_values_and_gradients_as_tree_rows(zoo):
    """`token_scores` (PPO's critic): values at every real token, and their gradients, as packed rows give them.
    The head's gradients sum hidden states over every token (up to ~30 here), so they are compared relative to the
    largest (fp32 rounding scales with it: 1.3e-5 absolute is 4.6e-7 of it). The head is made from a fixed seed: it
    is not in the checkpoint, and drawn from whatever state earlier tests left, the numbers changed with test order."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    critic = AutoModelForSequenceClassification.from_pretrained(zoo("qwen2"), num_labels=1).eval()
    ids, mask, _ = _batch()
    weights = torch.linspace(-1, 1, ids.numel()).view_as(ids)
    results = []
    for tree_packing in (True, False):
        model = copy.deepcopy(critic)
        values = token_scores(model.base_model, model.score, ids, mask, tree_packing=tree_packing)
        grads = torch.autograd.grad((values * weights).sum(), list(model.parameters()))
        results.append((values, grads))
    (tree_values, tree_grads), (row_values, row_grads) = results
    assert (tree_values - row_values).abs().max().item() <= TOLERANCE
    largest = max(g.abs().max().item() for g in row_grads)
    assert _max_diff(tree_grads, row_grads) <= TOLERANCE * max(1.0, largest)


@pytest.mark.parametrize(("given", "read"), [("auto", "auto"), (True, True), ("false", False), ("True", True)])
def test_the_setting_is_read_as_auto_true_or_false(given, read, tmp_path):
    assert trl_scale.GRPOConfig(output_dir=str(tmp_path), bf16=False, tree_packing=given).tree_packing == read


def test_bad_settings_name_the_field_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"tree_packing='sometimes': use 'auto'"):
        trl_scale.RLOOConfig(output_dir=str(tmp_path), bf16=False, tree_packing="sometimes")
    with pytest.raises(ValueError, match=r"tree_packing=True, but padding_free=False.*not be read.*Fix"):
        trl_scale.GRPOConfig(output_dir=str(tmp_path), bf16=False, tree_packing=True, padding_free=False)
    with pytest.raises(ValueError, match=r"tree_packing=True and sequence_parallel_size=2.*Fix"):
        trl_scale.DPOConfig(output_dir=str(tmp_path), bf16=False, tree_packing=True, sequence_parallel_size=2)


def test_the_trainer_yaml_and_the_command_line_reach_the_engine(tmp_path, monkeypatch):
    seen = {}

    def fake_train(self, resume_from_checkpoint=None):
        seen["settings"] = self.model._trl_scale_packed_scoring.settings

    monkeypatch.setattr(trl_scale.GRPOTrainer, "train", fake_train)
    yaml = tmp_path / "tree.yaml"
    tiny = (ROOT / "examples" / "grpo_tiny_cpu.yaml").read_text()
    yaml.write_text(tiny + "\ntree_packing: false\n")
    assert main(["grpo", "--config", str(yaml), "--output_dir", str(tmp_path / "a")]) == 0
    assert seen["settings"].tree_packing is False
    assert main(["grpo", "--config", str(yaml), "--output_dir", str(tmp_path / "b"), "--tree_packing", "true"]) == 0
    assert seen["settings"].tree_packing is True


def test_the_trie_gives_each_token_its_path_as_segments():
    """The segments the kernel attends with are the trie's paths exactly (random tries, every token)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        base = torch.randint(0, 4, (6,), generator=generator).tolist()
        rows = []
        for _ in range(int(torch.randint(1, 7, (1,), generator=generator))):
            cut = int(torch.randint(0, 7, (1,), generator=generator))
            tail = torch.randint(0, 3, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator)
            rows.append(base[:cut] + tail.tolist())
        tree = TreeRows.fold(rows)
        segments, allowed = tree.segments, torch.zeros(tree.num_tokens, tree.num_tokens, dtype=torch.bool)
        q_bounds, k_bounds = segments.cu_seq_lens_q.tolist(), segments.cu_seq_lens_k.tolist()
        for i in range(len(q_bounds) - 1):
            keys = segments.kv_index[k_bounds[i] : k_bounds[i + 1]]
            above = len(keys) - (q_bounds[i + 1] - q_bounds[i])
            for offset, query in enumerate(range(q_bounds[i], q_bounds[i + 1])):
                allowed[query, keys[: above + offset + 1]] = True
        assert torch.equal(allowed, tree.on_path()), rows
        for row, nodes in zip(rows, tree.row_nodes):
            assert tree.token_ids[nodes].tolist() == row
            assert tree.position_ids[nodes].tolist() == list(range(len(row)))


def _trainer(method: str, model_path: str, out, tree_packing):
    """A two-step run of `method` (SGD: see test_scoring's note), rows sharing prompts in every scoring call."""
    from transformers import AutoTokenizer

    from trl_scale.toy import counting_prompts, preference_pairs

    from .helpers import cpu_args, token_parity_reward

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    common = dict(max_steps=2, optim="sgd", tree_packing=tree_packing)
    if method == "dpo":
        config = trl_scale.DPOConfig(**cpu_args(out, max_length=64, **common))
        return trl_scale.DPOTrainer(
            model=model_path, args=config, train_dataset=preference_pairs(32, seed=0), processing_class=tokenizer
        )
    online = dict(max_completion_length=8, **common)
    classes = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    online |= dict(num_ppo_epochs=1, num_mini_batches=1) if method == "ppo" else dict(num_generations=4, beta=0.05)
    return classes[0](
        model=model_path,
        reward_funcs=token_parity_reward,
        args=classes[1](**cpu_args(out, **online)),
        train_dataset=counting_prompts(64, seed=0),
        processing_class=tokenizer,
    )


KEYS = {
    "grpo": ("loss", "grad_norm", "entropy", "kl", "reward"),
    "rloo": ("loss", "grad_norm", "entropy", "kl", "reward"),
    "ppo": ("loss", "loss/value", "val/vpred", "objective/kl", "grad_norm"),
    "dpo": ("loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"),
}


@pytest.mark.parametrize("method", ["grpo", "rloo", "ppo", "dpo"])
def test_each_trainer_trains_as_with_packed_rows(method, zoo, tmp_path):
    """Policy (old log-probs, loss forward and backward), reference, PPO's critic and DPO's pairs as tree rows: the
    logged numbers and the weights of packed rows, and the share of tokens saved in the logs."""
    from .helpers import max_param_diff, paired, step_logs

    runs = {}
    for tree_packing in (True, False):
        runs[tree_packing] = _trainer(method, zoo("llama"), tmp_path / str(tree_packing), tree_packing)
        runs[tree_packing].train()
    for a, b in paired(step_logs(runs[True], KEYS[method]), step_logs(runs[False], KEYS[method])):
        for key in KEYS[method]:
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])
    assert max_param_diff(runs[True].model, runs[False].model) <= 1e-5
    logged = [e for e in runs[True].state.log_history if "tree_packing/share_ratio" in e]
    assert logged and all(e["tree_packing/share_ratio"] > 1.0 for e in logged)
    rows_logs = [e for e in runs[False].state.log_history if "tree_packing/fraction_of_calls" in e]
    assert rows_logs and all(e["tree_packing/fraction_of_calls"] == 0.0 for e in rows_logs)
    if method in ("grpo", "rloo"):  # local generation prefilled each group's prompt once (the same completions: the
        # logs above); PPO's one completion per prompt shares only prompts that repeat by chance
        prefill = [e for e in runs[True].state.log_history if "shared_prefill/share_ratio" in e]
        assert prefill and all(e["shared_prefill/share_ratio"] > 1.5 for e in prefill)
        assert not any("shared_prefill/share_ratio" in e for e in runs[False].state.log_history)


def _gpt_neo(path, window: int) -> str:
    """A tiny GPT-Neo (global then local attention): its window is `window_size`, which counts distance by index in
    the layout it is given, not by position ids."""
    import transformers

    config = transformers.GPTNeoConfig(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=512, window_size=window,
        attention_types=[[["global", "local"], 1]], bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_a_window_counted_in_the_layout_keeps_tries_within_it(tmp_path, caplog):
    """GPT-Neo with a 24-token local window: the batch's rows (8 tokens at most) fit it, its trie (35 tokens) does
    not. Tree rows would be off (1.3 in hidden state); True refuses naming the window, "auto" scores packed rows
    with one warning. With a 256-token window the same trie is tree-packed and exact."""
    ids, mask, labels = _batch()
    _, rows, trees, _ = _models(_gpt_neo(tmp_path / "w24", 24))
    with pytest.raises(ValueError, match=r"attention window \(24 tokens\) counts distance in the tree's layout"):
        _scored(trees, ids, mask, labels)
    _, rows, auto, config = _models(_gpt_neo(tmp_path / "w24-auto", 24), tree_packing="auto")
    tree_forward._announced.discard("gpt_neo")
    with caplog.at_level(logging.WARNING, logger="trl_scale"), torch.no_grad():
        out = auto(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    expected = rows(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert torch.equal(out.log_probs, expected.log_probs)
    assert config.stats.pop()["tree_packing/fraction_of_calls"] == 0.0
    assert any("counts distance in the tree's layout" in r.getMessage() for r in caplog.records)
    _, rows, trees, config = _models(_gpt_neo(tmp_path / "w256", 256))
    tree_out, tree_grads = _scored(trees, ids, mask, labels)
    rows_out, rows_grads = _scored(rows, ids, mask, labels)
    assert config.stats.pop()["tree_packing/fraction_of_calls"] == 1.0
    assert (tree_out.log_probs - rows_out.log_probs).abs().max().item() <= TOLERANCE
    assert _max_diff(tree_grads, rows_grads) <= TOLERANCE


@pytest.mark.parametrize(
    ("settings", "window"),
    [
        ({"sliding_window": 16}, 16),
        ({"window_size": 256, "sliding_window": None}, 256),
        ({"attention_window": [32, 64]}, 32),
        ({"local_attention_window": 48}, 48),  # a name this code has never seen: still a window
        ({"sliding_window": 16, "use_sliding_window": False}, None),
        ({"sliding_window": 16, "sliding_window_pattern": 6, "max_window_layers": 2}, 16),  # layer counts: no window
        ({}, None),
    ],
)
def test_every_name_a_config_gives_its_window_is_read(settings, window):
    import transformers

    from trl_scale.scoring.tree import sliding_window_of

    config = transformers.LlamaConfig(**settings)
    for name, value in settings.items():
        setattr(config, name, value)
    assert sliding_window_of(config) == window


@pytest.mark.parametrize("family", ["opt", "falcon"])
def test_tree_packing_true_on_a_family_that_cannot_pack_names_tree_packing(zoo, family):
    """OPT and Falcon are scored with TRL's padded path (packing is not exact for them): tree_packing=True would be
    read by nothing, and the only word was a warning suggesting padding_free=False (which the config refuses with
    it). Refused naming tree_packing; "auto" keeps TRL's path."""
    model = AutoModelForCausalLM.from_pretrained(zoo(family)).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    with pytest.raises(ValueError, match=r"tree_packing=True, but packed scoring is not exact .*Fix: tree_packing="):
        install_packed_scoring(copy.deepcopy(model), temperature=0.7, tree_packing=True)
    assert install_packed_scoring(copy.deepcopy(model), temperature=0.7, tree_packing="auto") is None


def test_tree_packing_true_with_an_image_dataset_is_refused_before_anything_runs(tiny_vlm):
    """A call with images is packed without trees: with image columns in the dataset, tree_packing=True is refused by
    the plan (at a call with images too: tests/test_image_scoring.py)."""
    from datasets import Dataset
    from PIL import Image

    from trl_scale.trainers.plan import RunPlan

    images = Dataset.from_dict({"prompt": ["a"], "image": [Image.new("RGB", (8, 8))]})
    config = trl_scale.GRPOConfig(output_dir="out", tree_packing=True, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match=r"image columns \['image'\], and tree_packing=True"):
        RunPlan.from_arguments("GRPOTrainer", {"args": config, "model": tiny_vlm, "train_dataset": images})


def test_rows_are_folded_by_their_tokens_so_a_budget_keeps_each_prompts_rows_together():
    """Two prompts' groups interleaved in the batch (A B A B A B A B, as TRL's sampler never lays them but a shuffled
    or merged batch may): sorted by their tokens, a budget that holds one group makes two tries, one per prompt.
    Folded in batch order, each trie would take rows of both prompts and share nothing (exact, but slower)."""
    from trl_scale.scoring.tree_forward import fold_rows

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (12,), generator=generator) for _ in range(2)]
    ids = torch.stack(
        [torch.cat([prompts[row % 2], torch.randint(5, 90, (2,), generator=generator)]) for row in range(8)]
    )
    tries = fold_rows(ids, torch.ones_like(ids), token_budget=12 + 4 * 2)
    assert sorted(sorted(b % 2 for b, _ in members) for _, members in tries) == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert [trie.num_tokens for trie, _ in tries] == [12 + 4 * 2, 12 + 4 * 2]


@pytest.mark.parametrize("dropout", ["module", "attention_float"])
def test_a_model_drawing_dropout_steps_tree_rows_aside(zoo, dropout, caplog):
    """A shared tree node would drop out alike for every row that reads it (each row alone draws its own): with
    dropout active (a dropout module's p, or Llama-style attention's float rate) a call folds nothing, with one
    warning naming dropout; True refuses naming the fix. In eval mode the same model folds."""
    path = zoo("gpt2" if dropout == "module" else "llama")
    _, rows, trees, config = _models(path, tree_packing="auto")
    if dropout == "attention_float":
        for module in trees.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.1
    ids, mask, labels = _batch()
    trees.train()
    tree_forward._announced.clear()
    with caplog.at_level(logging.WARNING, logger="trl_scale"), torch.no_grad():
        trees(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert config.stats.pop()["tree_packing/fraction_of_calls"] == 0.0
    assert any("dropout is active" in r.getMessage() for r in caplog.records)
    trees.eval()
    with torch.no_grad():
        trees(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    assert config.stats.pop()["tree_packing/fraction_of_calls"] == 1.0
    trees.train()
    config.settings = type(config.settings)(**{**config.settings.__dict__, "tree_packing": True})
    with pytest.raises(ValueError, match=r"dropout is active.*disable_dropout=True"), torch.no_grad():
        trees(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
