"""Scoring calls with images (issue 62): run padded (each row's images stay with it) and scored by the chunked
head, which projects only the labelled tokens (an image's hundreds of prompt tokens never reach the LM head):
log-probs, entropies and gradients as TRL's fused forward gives them, on a tiny Gemma 3."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl.trainer.utils import add_fused_lm_head

from trl_scale.scoring import PackingStats, install_packed_scoring

TOLERANCE = 1e-5


def _batch(processor, seed: int = 0):
    """Three prompts with an image each (random pixels), their chat template and a few answer tokens, right-padded;
    labels only on the answers, as TRL's trainers score them."""
    rng = np.random.default_rng(seed)
    images = [Image.fromarray((rng.random((28, 28, 3)) * 255).astype("uint8")) for _ in range(3)]
    rows, answers = [], [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    for i, (image, answer) in enumerate(zip(images, answers)):
        content = [{"type": "image", "image": image}, {"type": "text", "text": "count " * (i + 1)}]
        encoded = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        rows.append((list(encoded["input_ids"][0]), answer))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((3, width), processor.tokenizer.pad_token_id)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (prompt, answer) in enumerate(rows):
        ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        mask[i, : len(prompt) + len(answer)] = 1
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    token_type_ids = (ids == processor.tokenizer.image_token_id).long()
    return ids, mask, labels, {"pixel_values": pixel_values, "token_type_ids": token_type_ids}


def _scored(model, ids, mask, labels, images):
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **images)
    objective = (out.log_probs * out.label_mask).sum() + 0.3 * (out.entropy * out.label_mask).sum()
    grads = torch.autograd.grad(objective, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return out, grads


def _check_scored_alike(expected, expected_grads, got, got_grads, fields=("log_probs", "entropy")) -> torch.Tensor:
    """Ours scored as TRL's padded fused forward: each of `fields` within TOLERANCE on the labelled tokens, each
    gradient within TOLERANCE of the largest; returns the label mask."""
    label_mask = expected.label_mask.bool()
    for field in fields:
        gap = (getattr(expected, field) - getattr(got, field))[label_mask].abs().max().item()
        assert gap <= TOLERANCE, (field, gap)
    pairs = [(a, b) for a, b in zip(expected_grads, got_grads) if a is not None]
    largest = max(a.abs().max().item() for a, _ in pairs)
    assert max((a - b).abs().max().item() for a, b in pairs) <= TOLERANCE * max(1.0, largest)
    return label_mask


def _left_padded(ids, mask, labels, images):
    """The same rows with their padding on the left (TRL's prompts), images and token types moved with them."""
    shifts = (mask.size(1) - mask.sum(1)).tolist()
    moved = [torch.stack([row.roll(shift) for row, shift in zip(t, shifts)]) for t in (ids, mask, labels)]
    return *moved, dict(
        images, token_type_ids=torch.stack([row.roll(s) for row, s in zip(images["token_type_ids"], shifts)])
    )


@pytest.mark.parametrize("attention,padding", [("sdpa", "right"), ("sdpa", "left"), ("eager", "right")])
def test_a_call_with_images_is_packed_and_scored_by_the_chunked_head_as_trls_forward_scores_it(
    tiny_vlm, attention, padding
):
    """Gemma 3 (one tensor per image, image tokens in the ids): the call's rows packed into one row, each image
    with its own sequence, scored by the chunked head: log-probs, entropies and gradients as TRL's padded fused
    forward gives them (<= 1e-5), on sdpa and eager, padded on either side."""
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, attn_implementation=attention).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ours, stats = copy.deepcopy(model), PackingStats()
    installed = install_packed_scoring(ours, temperature=0.7, outputs=("entropy",), stats=stats)
    assert installed is not None
    ids, mask, labels, images = _batch(processor)
    if padding == "left":
        ids, mask, labels, images = _left_padded(ids, mask, labels, images)
    (expected, expected_grads), (got, got_grads) = (_scored(m, ids, mask, labels, images) for m in (model, ours))
    label_mask = _check_scored_alike(expected, expected_grads, got, got_grads)
    # our head scored it, packed, not TRL's forward
    assert stats.pop() == {"chunked_head/image_calls": 1.0, "padding_free/image_calls_packed": 1.0}

    # The images reach the forward with their own rows: the same call with the rows' images swapped scores else.
    swapped = dict(images, pixel_values=images["pixel_values"].roll(1, dims=0))
    with torch.no_grad():
        other = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **swapped)
    assert (other.log_probs - got.log_probs.detach())[label_mask].abs().max().item() > 1e-3


def _qwen2_vl_batch(tokenizer, config, seed: int = 0):
    """Three rows, each an image of its own patch grid (so each its own 3-D positions) between vision markers, then
    text and an answer; pixel values and grids made by hand (the tiny Qwen2-VL has no processor: see toy)."""
    generator = torch.Generator().manual_seed(seed)
    grids = torch.tensor([[1, 4, 6], [1, 2, 2], [1, 6, 4]])  # (frames, patch rows, patch columns)
    rows = []
    for i, (_, height, width) in enumerate(grids.tolist()):
        image = [config.vision_start_token_id] + [config.image_token_id] * (height * width // 4)
        text = tokenizer.encode(" count" * (i + 1), add_special_tokens=False)
        answer = torch.randint(10, 200, (3 + i,), generator=generator).tolist()
        rows.append((image + [config.vision_end_token_id] + text, answer))
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((3, width), tokenizer.pad_token_id)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, (prompt, answer) in enumerate(rows):
        start = width - len(prompt) - len(answer)  # left padding, as TRL pads prompts
        ids[i, start:] = torch.tensor(prompt + answer)
        mask[i, start:] = 1
        labels[i, width - len(answer) :] = torch.tensor(answer)
    patches = int(grids.prod(dim=1).sum())
    pixel_values = torch.randn(patches, 3 * 2 * 7 * 7, generator=generator)
    marked = (ids == config.image_token_id).long()  # what Qwen2-VL's processor returns beside the ids
    return ids, mask, labels, {"pixel_values": pixel_values, "image_grid_thw": grids, "mm_token_type_ids": marked}


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny_qwen2_vl(tmp_path_factory, request) -> str:
    """A tiny Qwen2-VL, and a Qwen2.5-VL (windowed vision attention): patch grids, 3-D positions."""
    from trl_scale.toy import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_qwen2_vl_call_with_3d_positions_is_packed_and_scored_as_trls_forward_scores_it(tiny_qwen2_vl, attention):
    """Qwen2-VL's image tokens take (time, height, width) positions from each row's own grid: computed on the padded
    call as the model computes them, packed with the ids behind per-sequence plain positions, and the chunked head
    scores the packed rows' answers as TRL's padded fused head (<= 1e-5: log-probs, entropies, gradients)."""
    from transformers import AutoTokenizer

    path = tiny_qwen2_vl
    model = AutoModelForImageTextToText.from_pretrained(path, attn_implementation=attention).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ours, stats = copy.deepcopy(model), PackingStats()
    assert install_packed_scoring(ours, temperature=0.7, outputs=("entropy",), stats=stats) is not None
    ids, mask, labels, images = _qwen2_vl_batch(AutoTokenizer.from_pretrained(path), model.config)
    (expected, expected_grads), (got, got_grads) = (_scored(m, ids, mask, labels, images) for m in (model, ours))
    label_mask = _check_scored_alike(expected, expected_grads, got, got_grads)
    assert stats.pop() == {"chunked_head/image_calls": 1.0, "padding_free/image_calls_packed": 1.0}
    # each row's patches reach its own image tokens: rows 0 and 2 (24 patches each) given each other's, their answers
    # score otherwise, by far more than the tolerance
    pixels = images["pixel_values"]
    swapped = dict(images, pixel_values=torch.cat([pixels[28:], pixels[24:28], pixels[:24]]))
    with torch.no_grad():
        other = ours(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **swapped)
    moved = (other.log_probs - got.log_probs.detach()).abs()
    assert moved[[0, 2]][label_mask[[0, 2]]].max().item() > 100 * TOLERANCE


def test_the_probe_finds_qwen2_vl_rows_inexact_without_their_3d_positions(tiny_qwen2_vl, monkeypatch):
    """Packed with plain positions (each sequence's 0, 1, 2, ... on all three axes, as text packing gives them), a
    Qwen2-VL image's tokens lose their (height, width) places: the probe finds it off, and the call is scored
    padded."""
    from trl_scale.scoring import image_packing

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl).eval()
    assert image_packing.probe_image_packing(model.base_model) == (True, "")

    def plain(backbone, input_ids, attention_mask, images):
        return (attention_mask.long().cumsum(1) - 1).clamp(min=0)[None].expand(3, -1, -1)

    monkeypatch.setattr(image_packing, "grid_positions", plain)
    exact, reason = image_packing.probe_image_packing(model.base_model)
    assert not exact and "differs from it alone" in reason, reason


def test_the_probe_finds_transformers_own_packed_masks_inexact_with_images(tiny_vlm, monkeypatch):
    """transformers' packed-sequence masks read each image block at the token's place in its sequence, not in the
    row: the probe (images at other places in each sequence) finds them off, so trl-scale builds its own."""
    from trl_scale.scoring import image_packing

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    assert image_packing.probe_image_packing(model.base_model) == (True, "")
    monkeypatch.setattr(image_packing, "packed_masks", lambda *args: None)  # transformers' masks from position_ids
    exact, reason = image_packing.probe_image_packing(model.base_model)
    assert not exact and "differs from it alone" in reason, reason


def test_the_model_card_says_padding_free_only_where_rows_pack(tmp_path, tiny_llama, monkeypatch):
    """A vision-language model whose text packing the probe finds inexact keeps the engine for its image calls only:
    its card does not claim padding-free; one whose text rows pack, and a text model that packs, do. Qwen2-VL is
    both: its text rows pack with their positions in its `[4, rows, width]` form, and not with plain `[rows, width]`
    ones (copied to its three axes, they keep no token to its sequence)."""
    from transformers import AutoModelForCausalLM

    from trl_scale.scoring import support, use_packing
    from trl_scale.toy import build_tiny_qwen2_vl
    from trl_scale.trainers.packing import PackedScoring

    qwen2_vl = build_tiny_qwen2_vl(tmp_path / "qwen2-vl")
    feature = PackedScoring()
    for model, packs in (
        (AutoModelForImageTextToText.from_pretrained(qwen2_vl), True),
        (AutoModelForCausalLM.from_pretrained(tiny_llama), True),
        (AutoModelForImageTextToText.from_pretrained(qwen2_vl), False),
    ):
        if not packs:
            monkeypatch.setattr(support, "takes_mrope", lambda backbone: False)
        use_packing(model.base_model, None, probe_now=True)  # the first scoring call's probe
        feature.packed_backbone = (model.base_model, None)
        assert feature.card_tags(None) == (["padding-free"] if packs else []), type(model).__name__


def test_a_qwen2_vl_text_call_is_packed_and_scored_as_trls_forward_scores_it(tiny_qwen2_vl):
    """A call without images on Qwen2-VL (a text-only batch of an image dataset) runs packed: log-probs, entropies
    and gradients within 1e-5 of TRL's padded fused forward."""
    from transformers import AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ours, stats = copy.deepcopy(model), PackingStats()
    assert install_packed_scoring(ours, temperature=0.7, outputs=("entropy",), stats=stats) is not None
    ids, mask, labels, _ = _qwen2_vl_batch(AutoTokenizer.from_pretrained(tiny_qwen2_vl), model.config)
    text = ids != model.config.image_token_id
    ids = ids.where(text, 5)  # the image tokens turned into a word: text rows of the same lengths
    (expected, expected_grads), (got, got_grads) = (_scored(m, ids, mask, labels, {}) for m in (model, ours))
    _check_scored_alike(expected, expected_grads, got, got_grads)
    assert stats.pop().get("padding_free/pad_fraction_removed", 0) > 0  # packed: its padding went


@pytest.mark.parametrize("budget", [30, None])
def test_a_call_with_images_packs_its_rows_with_their_images(tiny_vlm, budget):
    """Rows with two images, one and none, packed two to a row where they fit, each with its own images: scored as
    TRL's padded forward (<= 1e-5). One forward per call whatever the token budget (ranks of a sharded model then
    run as many forwards through the vision tower)."""
    from trl_scale.scoring.image_packing import packed_rows, packs_images

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ours, stats = copy.deepcopy(model), PackingStats()
    install_packed_scoring(ours, temperature=0.7, outputs=("entropy",), stats=stats, token_budget=budget)
    rng = np.random.default_rng(1)
    rows, images = [], []
    for count in (1, 2, 0, 1):
        drawn = [Image.fromarray((rng.random((28, 28, 3)) * 255).astype("uint8")) for _ in range(count)]
        content = [{"type": "image", "image": image} for image in drawn] + [{"type": "text", "text": " count"}]
        encoded = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        rows.append(list(encoded["input_ids"][0]) + [20, 21, 22])
        images += drawn
    width = max(len(r) for r in rows)
    ids = torch.full((4, width), processor.tokenizer.pad_token_id)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
        labels[i, width - 3 :] = torch.tensor(row[-3:])
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    inputs = {"pixel_values": pixels, "token_type_ids": (ids == processor.tokenizer.image_token_id).long()}
    assert max(len(row) for row in packed_rows(mask.sum(1).tolist())) >= 2  # two sequences share a row
    assert packs_images(ours.base_model, inputs)  # probed now: the forwards counted below are the call's
    forwards = []
    hook = ours.base_model.register_forward_hook(lambda *args: forwards.append(1))
    expected, expected_grads = _scored(model, ids, mask, labels, inputs)
    got, got_grads = _scored(ours, ids, mask, labels, inputs)
    _check_scored_alike(expected, expected_grads, got, got_grads, fields=("log_probs",))
    hook.remove()
    assert stats.pop()["padding_free/image_calls_packed"] == 1.0 and len(forwards) == 1


def test_tree_packing_true_is_refused_at_a_call_with_images(tiny_vlm):
    """A call with images is packed without trees: tree_packing=True (images that reach scoring from a tool, on a
    dataset without image columns, which the plan cannot see) is refused at the call, naming the setting."""
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    assert install_packed_scoring(model, temperature=0.7, outputs=("entropy",), tree_packing=True) is not None
    ids, mask, labels, images = _batch(processor)
    with pytest.raises(ValueError, match=r"tree_packing=True, but this scoring call has images"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **images)
