"""Tree rows (`scoring/tree.py`, issue 61's first part): rows sharing a prefix folded into one trie, each shared token
forwarded once. Exact against each row's own forward (log-probs and gradients, fp32) on every family the rule calls
exact, and the rule agrees with a measurement on every family the packing probe knows. The engine's use of them
(every trainer): tests/test_tree_packing.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_scale.scoring.tree import TreeRows, tree_token_logprobs, why_not_tree
from trl_scale.toy import build_tiny_model

FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gpt2", "mistral", "gemma2", "gemma3", "lfm2")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree-models")
    return {family: build_tiny_model(root / family, family=family) for family in FAMILIES}


def _group(prompt_length: int, completions: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """A prompt group (one prompt, several completions), and a row sharing only part of the prompt."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 100, (prompt_length,), generator=generator).tolist()
    rows = [prompt + torch.randint(3, 100, (n,), generator=generator).tolist() for n in completions]
    return rows + [prompt[: prompt_length // 2] + [7, 7]]


def _row_logprobs(model, rows: list[list[int]]) -> torch.Tensor:
    out = []
    for row in rows:
        ids = torch.tensor(row)[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)


def _load(path, attention: str | None = "sdpa"):
    """fp32; `attention` None: the family's default kernel (Gemma 2 has no sdpa)."""
    torch.manual_seed(0)
    kwargs = {"attn_implementation": attention} if attention else {}
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).float()


def test_a_group_folds_into_a_trie_with_each_shared_token_once():
    rows = [[5, 6, 7, 8], [5, 6, 7, 9, 10], [5, 6, 7, 8], [5, 11]]
    tree = TreeRows.fold(rows)
    assert tree.row_tokens == 15 and tree.num_tokens == 7  # 5 6 7 8 | 9 10 | 11
    assert tree.token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 3, 4, 1]
    for row, nodes in zip(rows, tree.row_nodes):
        assert tree.token_ids[nodes].tolist() == row and tree.position_ids[nodes].tolist() == list(range(len(row)))
    path = tree.on_path()
    assert path[5].tolist() == [True, True, True, False, True, True, False]  # 10 sees 5 6 7 9 and itself, not 8
    assert path[6].tolist() == [True, False, False, False, False, False, True]
    assert tree.labels().tolist() == [token for row in rows for token in row[1:]]


@pytest.mark.parametrize(
    ("family", "attention"),
    [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen3", "sdpa"), ("phi3", "sdpa"), ("gpt2", "sdpa")],
)
def test_tree_logprobs_and_gradients_match_each_row_forwarded_alone(models, family, attention):
    rows = _group(12, (5, 3, 7, 1))
    model = _load(models[family], attention)
    assert why_not_tree(model.config, max(map(len, rows))) is None
    tree = TreeRows.fold(rows)
    assert tree.num_tokens < tree.row_tokens / 2
    weights = torch.linspace(-1.0, 2.0, len(tree.labels()))  # a loss weighting each (row, token) differently
    tree_lp = tree_token_logprobs(model, tree)
    (tree_lp * weights).sum().backward()
    tree_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    row_lp = _row_logprobs(model, rows)
    (row_lp * weights).sum().backward()
    assert (tree_lp - row_lp).abs().max().item() <= TOLERANCE
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert (tree_grads[name] - p.grad).abs().max().item() <= TOLERANCE, name


def test_a_token_attending_outside_its_path_or_a_shared_gradient_counted_once_is_caught(models, monkeypatch):
    """The two ways tree rows go wrong, planted: the comparisons above see each."""
    rows = _group(12, (5, 3, 7, 1))
    model = _load(models["llama"])
    row_lp = _row_logprobs(model, rows)
    tree = TreeRows.fold(rows)
    causal = torch.ones(tree.num_tokens, tree.num_tokens, dtype=torch.bool).tril()  # the layout's order, not paths
    monkeypatch.setattr(TreeRows, "on_path", lambda self: causal)
    assert (tree_token_logprobs(model, tree) - row_lp).abs().max().item() > 1e-2
    monkeypatch.undo()
    # a shared node's hidden state counted for its first row only (the others' use of it detached)
    weights = torch.linspace(-1.0, 2.0, len(tree.labels()))
    row_lp.mul(weights).sum().backward()
    expected = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    hidden = model.model(
        input_ids=tree.token_ids[None], position_ids=tree.position_ids[None], attention_mask=tree.attention_mask()
    ).last_hidden_state[0]
    seen, picked = set(), []
    for node in tree.predicting_nodes().tolist():
        picked.append(hidden[node] if node not in seen else hidden[node].detach())
        seen.add(node)
    logits = model.lm_head(torch.stack(picked))
    once = torch.log_softmax(logits, -1).gather(1, tree.labels()[:, None])[:, 0]
    assert (once - row_lp).abs().max().item() <= TOLERANCE  # the same numbers forward ...
    once.mul(weights).sum().backward()
    assert (model.model.embed_tokens.weight.grad - expected).abs().max().item() > 1e-3  # ... not the same gradient


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prompt_length", [3, 12])
def test_the_rule_says_exact_where_measured_exact(models, family, prompt_length):
    """`why_not_tree` against a measurement, per family and row length: the rule never calls a model exact that is
    not (hybrids with convolutions, sliding windows shorter than the row), nor refuses one that is."""
    rows = _group(prompt_length, (2, 3, 1))
    model = _load(models[family], attention=None)
    measured = (tree_token_logprobs(model, TreeRows.fold(rows)) - _row_logprobs(model, rows)).abs().max().item()
    reason = why_not_tree(model.config, max(map(len, rows)))
    assert (reason is None) == (measured <= TOLERANCE), (family, reason, measured)


def test_scoring_from_a_position_gives_those_tokens_only(models):
    """`start`: the completion tokens only (a group's prompt is context, not scored), as the rows give them."""
    rows = _group(12, (5, 3, 7, 1))[:-1]  # the group: every row holds the 12-token prompt
    model = _load(models["qwen2"])
    with torch.no_grad():
        tree_lp = tree_token_logprobs(model, TreeRows.fold(rows), start=12)
        expected = torch.cat([_row_logprobs(model, [row])[11:] for row in rows])
    assert tree_lp.shape == expected.shape == (5 + 3 + 7 + 1,)
    assert (tree_lp - expected).abs().max().item() <= TOLERANCE
