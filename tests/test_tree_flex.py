"""Tree rows on FlexAttention (`trl_scale.scoring.tree_flex`): the block mask built from the tree's intervals is the
path rule's, and a flex model scores tree rows as TRL's padded forward does. On this CPU flex runs forward only
(torch 2.13 has no flex backward on CPU): the gradients on flex are the GPU issue's."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AutoModelForCausalLM
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import install_packed_scoring
from trl_scale.scoring.tree import TreeRows
from trl_scale.scoring.tree_flex import BLOCK, block_classes, padded_leave, padded_length, tree_block_mask

from .test_tree_packing import _batch

TOLERANCE = 1e-5


def _random_tree(seed: int, rows: int, prompt: int, longest: int) -> TreeRows:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 9, (prompt,), generator=generator)
    made = []
    for _ in range(rows):
        cut = int(torch.randint(0, prompt + 1, (1,), generator=generator))  # some rows share only part of it
        tail = torch.randint(0, 9, (int(torch.randint(1, longest, (1,), generator=generator)),), generator=generator)
        made.append(torch.cat([shared[:cut], tail]))
    return TreeRows.fold(made)


@pytest.mark.parametrize("seed,rows,prompt,longest", [(0, 8, 300, 40), (1, 3, 20, 400), (2, 16, 130, 130)])
def test_the_block_mask_is_the_path_rule_block_by_block(seed, rows, prompt, longest):
    """The blocks classified from the tree's intervals equal those torch finds by evaluating the path rule on every
    (query, key) pair, padding included (each padding token attends to itself only)."""
    tree = _random_tree(seed, rows, prompt, longest)
    length = padded_length(tree.num_tokens)
    leave = padded_leave(tree, length)
    q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
    dense = (k <= q) & (q < leave[None, :])
    n = tree.num_tokens
    assert torch.equal(dense[:n, :n], tree.on_path())
    assert torch.equal(dense[n:, n:], torch.eye(length - n, dtype=bool))
    assert not dense[n:, :n].any() and not dense[:n, n:].any()

    expected = create_block_mask(lambda b, h, qi, ki: dense[qi, ki], 1, None, length, length, device="cpu")
    mine = tree_block_mask(tree, torch.device("cpu"))
    assert torch.equal(mine.to_dense(), expected.to_dense())  # every block flex visits (partial or full)
    partial, full = block_classes(leave)
    blocks = length // BLOCK
    expected_full = torch.zeros(blocks, blocks, dtype=torch.bool)
    for row in range(blocks):
        count = int(expected.full_kv_num_blocks[0, 0, row])
        expected_full[row, expected.full_kv_indices[0, 0, row, :count]] = True
    assert torch.equal(full, expected_full) and not (partial & full).any()
    assert torch.equal(mine.mask_mod(0, 0, q, k), dense)  # the rule flex applies inside the partial blocks


def test_lengths_are_bucketed_into_few_shapes():
    buckets = {padded_length(n) for n in range(1, 40_000)}
    assert len(buckets) <= 30 and all(b % BLOCK == 0 for b in buckets)
    assert all(padded_length(n) >= n and padded_length(n) <= max(BLOCK * 2, n * 1.5 + BLOCK) for n in range(1, 9000))


def test_small_blocks_are_classed_as_the_path_rule_classes_them_at_every_edge():
    """With 4-token blocks, 200 random trees hit every edge of the rule (a key block whose smallest subtree ends one
    token before the query block's end is partial, not full): the classes equal those of the dense path rule."""
    block, hit_the_edge = 4, 0
    for seed in range(200):
        tree = _random_tree(seed, rows=4, prompt=6, longest=6)
        length = -(-tree.num_tokens // block) * block
        leave = padded_leave(tree, length)
        q, k = torch.arange(length)[:, None], torch.arange(length)[None, :]
        tiles = ((k <= q) & (q < leave[None, :])).view(length // block, block, length // block, block)
        tiles = tiles.permute(0, 2, 1, 3).flatten(2)  # [q block, k block, block * block]
        below = torch.ones(length // block, length // block, dtype=torch.bool).tril(-1)
        full = tiles.all(-1) & below
        partial = (tiles.any(-1) & ~tiles.all(-1) & below) | torch.eye(length // block, dtype=torch.bool)
        got_partial, got_full = block_classes(leave, block)
        assert torch.equal(got_full, full) and torch.equal(got_partial, partial), seed
        per_block = leave.view(-1, block).min(1).values
        ends = (torch.arange(length // block) + 1) * block
        hit_the_edge += int((per_block[None, :] == ends[:, None] - 1).logical_and(below).any())
    assert hit_the_edge > 20  # the edge the rule must get right was met, many times


def test_a_length_of_exactly_three_blocks_times_a_power_of_two_is_its_own_bucket():
    """3 x 2^(k-1) blocks fill their bucket with no padding; one token more takes the next bucket."""
    for k in range(1, 8):
        blocks = 3 * 2 ** (k - 1)
        assert padded_length(blocks * BLOCK) == blocks * BLOCK, blocks
        assert padded_length(blocks * BLOCK + 1) == 4 * 2 ** (k - 1) * BLOCK, blocks


def _flex_and_padded(path):
    flex = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flex_attention").eval()
    padded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    for model in (flex, padded):
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    config = install_packed_scoring(flex, temperature=0.7, outputs=("entropy",), tree_packing=True)
    return flex, padded, config


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_rows_on_flex_score_as_trls_padded_forward(zoo, family):
    """A group, a DPO-like pair and a conversation's turns as tree rows on flex attention: log-probs and entropies
    within 1e-5 of TRL's padded sdpa forward; two calls of different lengths in one bucket compile once."""
    flex, padded, config = _flex_and_padded(zoo(family))
    with torch.no_grad():
        # different lengths in one bucket (a block), then a longer call (another bucket, compiled static)
        for seed, longest in ((0, 8), (1, 10), (2, 160)):
            ids, mask, labels = _batch(seed, prompt=longest - 4, longest=longest)
            got = flex(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            expected = padded(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            stats = config.stats.pop()
            assert stats["tree_packing/fraction_of_calls"] == 1.0 and stats["tree_packing/share_ratio"] > 1.3
            real = expected.label_mask.bool()
            for name in ("log_probs", "entropy"):
                difference = (getattr(got, name) - getattr(expected, name))[real].abs().max().item()
                assert difference <= TOLERANCE, (name, difference)
            if seed == 0:
                graphs = counters["stats"]["unique_graphs"]
            if seed == 1:
                assert counters["stats"]["unique_graphs"] == graphs  # the second length ran the first one's kernel


def test_packed_rows_on_flex_score_calls_of_new_lengths_as_trls_padded_forward(zoo):
    """Packed rows (no trees) on flex attention on CPU, three calls of three lengths: each within 1e-5 of TRL's
    padded flex forward. (Red before: the second length's recompile, to a symbolic length, failed to build in
    inductor's CPU flex template, where TRL's padded rows ran.)"""
    path = zoo("llama")
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flex_attention").eval()
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs",))
        models.append(model)
    trl_padded, packed = models
    config = install_packed_scoring(packed, temperature=0.7, tree_packing=False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for width in (10, 14, 19):
            ids = torch.randint(5, 90, (3, width), generator=generator)
            mask = torch.ones_like(ids)
            mask[0, :3] = 0  # a left-padded row
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, : width // 2] = -100
            expected = trl_padded(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            got = packed(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            assert config.stats.pop()["padding_free/micro_batches_per_call"] == 1.0  # packed, not TRL's forward
            kept = expected.label_mask.bool()
            assert (got.log_probs - expected.log_probs)[kept].abs().max().item() <= TOLERANCE, width
