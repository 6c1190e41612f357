"""Weight syncs send checkpoint names, and each tensor is checked to land on a weight the servers hold
(`trl_scale/checkpoint_names.py`, `trl_scale/rollout/weight_names.py`)."""

from __future__ import annotations

import typing

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from trl_scale.checkpoint_names import checkpoint_tensors, checkpoint_views, read_checkpoint_shapes
from trl_scale.rollout.weight_names import ServerWeights, WeightPlacementError, buffer_names, server_weights
from trl_scale.toy import build_tiny_model
from trl_scale.toy.models import ModelFamily

FAMILIES = typing.get_args(ModelFamily)
FUSED = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), family="qwen3_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_zoo_familys_walk_under_checkpoint_names_is_its_checkpoint(tmp_path, family):
    """Each family's parameters, renamed as a sync sends them, are its saved checkpoint: the same names, shapes and
    values (a mixture of experts' fused experts split per expert); the placement check passes."""
    path = build_tiny_model(tmp_path, family=family)
    model = AutoModelForCausalLM.from_pretrained(path)
    sent = dict(checkpoint_tensors(model, ((n, p.detach()) for n, p in model.named_parameters())))
    saved = load_file(f"{path}/model.safetensors")
    # persistent buffers no optimizer moves (DeepSeek-V3's routing bias) are the checkpoint's on every server alike:
    # a sync walks the parameters
    buffers = {name for name, _ in model.named_buffers() if name in model.state_dict()}
    assert {name.rsplit(".", 1)[-1] for name in buffers} <= {"e_score_correction_bias"}, buffers
    saved = {name: tensor for name, tensor in saved.items() if name not in buffers}
    assert sorted(sent) == sorted(saved)
    for name, tensor in sent.items():
        assert torch.equal(tensor, saved[name]), name
    held = ServerWeights(read_checkpoint_shapes(path), path, frozenset(buffer_names(model)))
    held.check((n, t.shape) for n, t in sent.items())
    if buffers:  # red: the buffers not exempted, the check would refuse the family's every sync
        with pytest.raises(WeightPlacementError, match="e_score_correction_bias"):
            ServerWeights(read_checkpoint_shapes(path), path).check((n, t.shape) for n, t in sent.items())


def test_a_sync_under_the_models_fused_names_is_refused_naming_the_tensor(tiny_moe):
    """What syncs sent before: the MoE model's own names. The check names the first fused tensor (vLLM's loader would
    skip it). Also the red check of the mapping: one tensor's conversion dropped, the sync fails naming it."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    held = server_weights([tiny_moe])
    own = [(n, p.shape) for n, p in model.named_parameters()]
    with pytest.raises(WeightPlacementError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' has no place"):
        held.check(own)
    walk = [(n, p.detach()) for n, p in model.named_parameters()]
    converted = [item for n, t in walk if n != FUSED for item in checkpoint_tensors(model, [(n, t)])]
    with pytest.raises(WeightPlacementError, match=r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'.*gets no"):
        held.check([(n, t.shape) for n, t in converted])
    with pytest.raises(WeightPlacementError, match=r"has no place"):
        held.check([(n, t.shape) for n, t in converted] + [(FUSED, dict(walk)[FUSED].shape)])


def test_the_check_names_a_shape_that_differs_and_an_adapter_on_a_module_the_servers_lack(tiny_moe):
    held = server_weights([tiny_moe])
    shapes = dict(held.shapes)
    name = "model.embed_tokens.weight"
    wrong = [(n, s if n != name else (s[0] + 1, s[1])) for n, s in shapes.items()]
    with pytest.raises(WeightPlacementError, match=r"'model\.embed_tokens\.weight' has shape"):
        held.check(wrong)
    held.check_adapter(["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    with pytest.raises(WeightPlacementError, match=r"wraps 'model\.layers\.0\.mlp\.experts'"):
        held.check_adapter(["base_model.model.model.layers.0.mlp.experts.lora_A.weight"])


def test_no_readable_checkpoint_leaves_the_sync_unchecked_and_says_so(tmp_path, caplog):
    assert server_weights(["org/not-here", str(tmp_path), None]) is None
    assert "not checked" in caplog.text and "org/not-here" in caplog.text


def test_checkpoint_views_put_each_checkpoint_tensor_back_where_it_came_from(tiny_moe):
    """`trl-scale serve`'s inverse: a checkpoint's tensors written through the views rebuild the model exactly."""
    source = AutoModelForCausalLM.from_pretrained(tiny_moe)
    with torch.no_grad():
        for parameter in source.parameters():
            parameter.add_(torch.randn_like(parameter))
    target = AutoModelForCausalLM.from_pretrained(tiny_moe)
    views = checkpoint_views(target)
    assert f"{FUSED.rsplit('.', 1)[0]}.7.up_proj.weight" in views
    params = dict(target.named_parameters())
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(source, ((n, p.detach()) for n, p in source.named_parameters())):
            if name in views:
                parameter, positions = views[name]
                params[parameter].view(-1)[positions.reshape(-1)] = tensor.reshape(-1)
            else:
                params[name].copy_(tensor)
    for name, parameter in source.named_parameters():
        assert torch.equal(parameter, params[name]), name
