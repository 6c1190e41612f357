"""`compile_decoder_layers`: each decoder layer torch.compile'd for the scoring forwards (regional compilation).

Measured on a GPU by ``benchmarks/gpu.py --parts train`` (a 1.33x faster step on an H200); here, on CPU, that the
compiled layers are what runs (dynamo's graph counter), that they give the same log-probs and gradients as the
plain ones under activation checkpointing, that a cached forward (generation) runs them uncompiled, and that
every way of switching it on reaches the trainer."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

import trl_scale
from trl_scale.scoring import install_packed_scoring
from trl_scale.scoring.compiled import compile_decoder_layers, decoder_layers
from trl_scale.toy import counting_prompts

from .helpers import cpu_args, padded_scoring_batch, token_parity_reward

pytestmark = pytest.mark.slow  # one compile of a tiny layer on CPU: about 40 s


def test_compiled_layers_score_as_the_plain_ones(tiny_qwen2):
    from torch._dynamo.utils import counters

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    input_ids, mask, labels = padded_scoring_batch(tokenizer)
    plain, compiled = (AutoModelForCausalLM.from_pretrained(tiny_qwen2, attn_implementation="sdpa") for _ in "ab")
    for model in (plain, compiled):
        model.train()
        add_fused_lm_head(model, outputs=("log_probs",))
        install_packed_scoring(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert compile_decoder_layers(compiled) == compiled.config.num_hidden_layers
    torch._dynamo.reset()
    counters.clear()
    outputs = []
    for model in (plain, compiled):
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
        outputs.append(out.log_probs.detach())
    assert counters["stats"]["unique_graphs"] >= 1  # the compiled layers ran (0 when the plain ones do)
    valid = labels[:, 1:] != -100
    assert (outputs[0] - outputs[1])[valid].abs().max().item() <= 1e-5
    for (name, a), b in zip(plain.named_parameters(), compiled.parameters()):
        assert (a.grad - b.grad).abs().max().item() <= 1e-4 * max(1.0, a.grad.abs().max().item()), name
    # generation (a KV cache) runs the layers uncompiled: no new graph, the same tokens
    graphs = counters["stats"]["unique_graphs"]
    for model in (plain, compiled):
        model.eval()
    with torch.no_grad():
        generated = [
            m.generate(input_ids[:1, :4], max_new_tokens=4, do_sample=False, use_cache=True) for m in (plain, compiled)
        ]
    assert torch.equal(*generated)
    assert counters["stats"]["unique_graphs"] == graphs


def test_config_field_compiles_the_policy_and_reference(tiny_llama, tmp_path, monkeypatch):
    """The field reaches both models and a GRPO step runs through their compiled layers. Compiled with dynamo and
    AOTAutograd but without inductor's code generation (aot_eager): inductor's numbers are the test above's, and
    its C++ compile of a second model costs CI about 40 s on a machine whose compile cache is cold."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend="aot_eager", **kwargs))
    config = trl_scale.GRPOConfig(
        **cpu_args(tmp_path, num_generations=4, max_completion_length=8, beta=0.05, max_steps=1),
        compile_decoder_layers=True,
    )
    trainer = trl_scale.GRPOTrainer(
        model=tiny_llama, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(16, seed=0)
    )
    for model in (trainer.model, trainer.ref_model):
        layers = decoder_layers(trainer.accelerator.unwrap_model(model))
        assert all(getattr(layer, "_trl_scale_compiled", False) for layer in layers)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer.train()  # a GRPO step through the compiled layers (generation with its cache runs them plain)
    assert counters["stats"]["unique_graphs"] >= 1
    assert trainer.state.log_history[0]["grad_norm"] > 0
    plain = trl_scale.GRPOTrainer(
        model=tiny_llama,
        reward_funcs=token_parity_reward,
        args=trl_scale.GRPOConfig(**cpu_args(tmp_path / "plain", num_generations=4, max_completion_length=8)),
        train_dataset=counting_prompts(16, seed=0),
    )
    assert not any(getattr(layer, "_trl_scale_compiled", False) for layer in decoder_layers(plain.model))


def test_yaml_and_command_line_reach_the_field(tmp_path):
    from trl import ModelConfig, TrlParser

    from trl_scale.cli import _import_trl_script_types

    script_type, _ = _import_trl_script_types()
    parser = TrlParser((script_type, trl_scale.GRPOConfig, ModelConfig))
    yaml = tmp_path / "c.yaml"
    yaml.write_text("compile_decoder_layers: true\nuse_cpu: true\nbf16: false\n")
    _, args, _ = parser.parse_args_and_config(["--config", str(yaml), "--output_dir", str(tmp_path)])
    assert args.compile_decoder_layers is True
    _, args, _ = parser.parse_args_and_config(
        ["--compile_decoder_layers", "true", "--use_cpu", "true", "--bf16", "false", "--output_dir", str(tmp_path)]
    )
    assert args.compile_decoder_layers is True


@pytest.mark.parametrize("value", ["false", 1])
def test_a_value_that_is_not_a_bool_is_refused(value, tmp_path):
    with pytest.raises(ValueError, match=r"compile_decoder_layers=.*: use True or False"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), compile_decoder_layers=value)
