"""How the decoder layers run by default: activation checkpointing chosen by memory
(`gradient_checkpointing_layers="auto"`) and compiled layers where the compile pays (`compile_decoder_layers=None`).

The device's figures are benchmarks/gpu.py's (`--parts train`: the default step's MFU against TRL's padded step) and
tests/test_gpu.py's (the plan against real CUDA memory). Here: the plan's arithmetic, that planned flags change no
number (log-probs and gradients equal to every layer checkpointed and to none), how a forward's measurement is
read, that every way of setting the fields reaches the trainer, and the compile rule's reasons."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.trainer.utils import add_fused_lm_head

import trl_scale
from trl_scale.scoring import checkpointing, compiled
from trl_scale.scoring.checkpointing import SelectiveCheckpointing, layers_to_checkpoint
from trl_scale.scoring.compiled import decoder_layers, why_not_compile
from trl_scale.toy import build_tiny_model, counting_prompts

from .helpers import cpu_args, padded_scoring_batch, paired, step_logs, token_parity_reward


class ScriptedMemory:
    """A device's memory as the planner reads it, scripted: `available` bytes, and an allocated count that grows by
    `kept` over each backbone forward (read before and after it)."""

    def __init__(self, available: float, kept: float = 0.0, total: float = 1e9):
        self.available_bytes, self.kept, self.total_bytes = available, kept, total
        self.reads = 0

    def allocated(self) -> int:
        self.reads += 1
        return int(self.kept if self.reads % 2 == 0 else 0)

    def available(self) -> int:
        return int(self.available_bytes)

    def total(self) -> int:
        return int(self.total_bytes)


def test_the_plan_checkpoints_the_fewest_layers_that_fit():
    # 4 layers, 100 tokens, 10 bytes a token unchecked, 1 byte a token of hidden state per layer input
    need_none = 100 * (4 * 10 + 5 * 1)
    assert layers_to_checkpoint(4, 100, 10, 1, available=need_none, reserve=0) == 0
    # one layer checkpointed saves nothing: the backward recomputes it into one layer's room
    assert layers_to_checkpoint(4, 100, 10, 1, available=need_none - 1, reserve=0) == 2
    assert layers_to_checkpoint(4, 100, 10, 1, available=100 * (2 * 10 + 5), reserve=0) == 3
    assert layers_to_checkpoint(4, 100, 10, 1, available=100 * (2 * 10 + 5) + 7, reserve=8) == 4  # the reserve
    assert layers_to_checkpoint(4, 100, 10, 1, available=0, reserve=0) == 4  # nothing fits: every layer


def _model(path, attention="sdpa"):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention)
    model.train()
    add_fused_lm_head(model, outputs=("log_probs",))
    return model


def _step(model, batch):
    input_ids, mask, labels = batch
    out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    out.log_probs.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.log_probs.detach(), grads


def test_planned_layers_give_the_numbers_of_every_layer_checkpointed_and_of_none(tiny_qwen2):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    batch = padded_scoring_batch(tokenizer)
    tokens = batch[0].numel()
    everything, nothing, planned = (_model(tiny_qwen2) for _ in range(3))
    everything.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    planned.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(planned)
    memory = ScriptedMemory(available=1e12, kept=(len(layers) + 1) * tokens * 64 * 4 + tokens * 1000)
    planner = SelectiveCheckpointing(planned, memory, margin_fraction=0.0)
    expected, expected_grads = _step(everything, batch)
    plain, plain_grads = _step(nothing, batch)
    seen, measured = [], []
    for _ in range(2):
        got, grads = _step(planned, batch)
        seen.append(planner.last_checkpointed)
        measured.append(planner.activation_bytes)
        assert torch.equal(got, expected) and torch.equal(got, plain)
        for name, grad in grads.items():
            assert torch.allclose(grad, expected_grads[name], rtol=0, atol=1e-6), name
            assert torch.allclose(grad, plain_grads[name], rtol=0, atol=1e-6), name
    # the first forward, on the prior, leaves one layer unchecked; measured, the second checkpoints none
    assert seen == [len(layers) - 1, 0]
    assert measured == pytest.approx([1000, 1000 / len(layers)])  # what the script kept, over the unchecked layers
    assert [layer.gradient_checkpointing for layer in layers] == [False] * len(layers)
    assert planned.model.gradient_checkpointing  # the backbone's flag (use_cache forced off) is HF's, untouched


def test_a_tight_device_checkpoints_layers_and_scoring_forwards_plan_nothing(tiny_qwen2):
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2)
    batch = padded_scoring_batch(tokenizer)
    model = _model(tiny_qwen2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    planner = SelectiveCheckpointing(model, ScriptedMemory(available=0), margin_fraction=0.0)
    with torch.no_grad():  # a scoring forward (old log-probs, the reference) keeps nothing: no plan
        model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2], fused_lm_head=True)
    assert planner.last_checkpointed is None
    _step(model, batch)
    assert planner.last_checkpointed == len(layers)
    assert all(layer.gradient_checkpointing for layer in layers)
    model.gradient_checkpointing_disable()  # checkpointing off: the planner leaves the flags as HF set them
    _step(model, batch)
    assert not any(layer.gradient_checkpointing for layer in layers)


def test_a_forward_measures_what_its_unchecked_layers_kept(tiny_qwen2):
    model = _model(tiny_qwen2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = len(decoder_layers(model))
    tokens, hidden_bytes, per_layer = 6, 64 * 4, 5000
    memory = ScriptedMemory(available=1e12, kept=(layers + 1) * tokens * hidden_bytes + tokens * per_layer)
    planner = SelectiveCheckpointing(model, memory, margin_fraction=0.0)
    assert planner.hidden_bytes == hidden_bytes
    ids = torch.arange(tokens).unsqueeze(0) + 10
    model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.sum().backward()
    assert planner.activation_bytes == pytest.approx(per_layer)  # one layer unchecked: all of it is that layer's
    memory.kept = (layers + 1) * tokens * hidden_bytes + layers * tokens * 3000
    model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.sum().backward()
    assert planner.activation_bytes == pytest.approx(3000)  # more layers unchecked measure closer: it stands


def _grpo(path, tmp_path, name, **fields):
    fields = {
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "gradient_checkpointing": True,
        **fields,
    }
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path / name, **fields))
    return trl_scale.GRPOTrainer(
        model=path, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(16, seed=0)
    )


def test_the_trainer_plans_its_layers_and_trains_as_with_every_layer_checkpointed(tiny_qwen2, tmp_path, monkeypatch):
    """`gradient_checkpointing_layers="auto"` (the default) on a device whose memory the planner reads (scripted
    here: CPU has none), against `"all"`: the same losses and gradient norms, fewer layers recomputed."""
    everything = _grpo(tiny_qwen2, tmp_path, "all", gradient_checkpointing_layers="all")
    everything.train()
    assert "gradient_checkpointing/layers" not in everything.state.log_history[0]
    memory = ScriptedMemory(available=1e12, kept=1e9)
    monkeypatch.setattr(checkpointing, "device_memory", lambda device: memory)
    planned = _grpo(tiny_qwen2, tmp_path, "auto")
    planned.train()
    layers = [e["gradient_checkpointing/layers"] for e in planned.state.log_history if "loss" in e]
    assert layers == [len(decoder_layers(planned.model)) - 1, 0]
    for expected, got in paired(step_logs(everything), step_logs(planned)):
        assert got == pytest.approx(expected, abs=1e-6)


def test_auto_checkpointing_steps_aside_off_cuda(tiny_qwen2, tmp_path):
    trainer = _grpo(tiny_qwen2, tmp_path, "cpu")
    trainer.train()
    assert all(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))
    assert not any("gradient_checkpointing/layers" in entry for entry in trainer.state.log_history)


@pytest.mark.parametrize("value", ["some", "every", True])
def test_gradient_checkpointing_layers_refuses_other_values(value, tmp_path):
    with pytest.raises(ValueError, match=rf"^gradient_checkpointing_layers={value!r}: use 'auto'"):
        trl_scale.GRPOConfig(**cpu_args(tmp_path), gradient_checkpointing_layers=value)


@pytest.mark.parametrize("config_cls", [trl_scale.GRPOConfig, trl_scale.RLOOConfig, trl_scale.DPOConfig])
def test_the_fields_are_read_from_yaml_and_the_command_line(config_cls, tmp_path):
    from trl import TrlParser

    yaml = tmp_path / "config.yaml"
    yaml.write_text(
        f"output_dir: {tmp_path}\nbf16: false\nuse_cpu: true\ngradient_checkpointing_layers: all\n"
        "compile_decoder_layers: false\n"
    )

    def parse(argv):  # a parser each: TrlParser keeps a YAML's values as its defaults
        return TrlParser((config_cls,)).parse_args_and_config(argv)

    (args,) = parse(["--config", str(yaml)])
    assert args.gradient_checkpointing_layers == "all" and args.compile_decoder_layers is False
    cpu = ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"]
    (args,) = parse([*cpu, "--gradient_checkpointing_layers", "auto", "--compile_decoder_layers", "true"])
    assert args.gradient_checkpointing_layers == "auto" and args.compile_decoder_layers is True
    (args,) = parse(cpu)
    assert args.gradient_checkpointing_layers == "auto" and args.compile_decoder_layers is None  # the defaults
    with pytest.raises(SystemExit):
        parse([*cpu, "--gradient_checkpointing_layers", "some"])


def test_the_compile_rule_names_why_it_leaves_layers_uncompiled(tiny_qwen2, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert "not on a CUDA device" in why_not_compile(model, 1000)
    cuda = torch.device("cuda")
    assert "below 100M" in why_not_compile(model, 1000, device=cuda)
    monkeypatch.setattr(compiled, "COMPILE_MIN_PARAMETERS", 1)
    least = compiled.COMPILE_MIN_STEPS
    assert f"{least - 1} steps planned" in why_not_compile(model, least - 1, device=cuda)
    assert why_not_compile(model, least, device=cuda) is None


def test_compile_decoder_layers_none_compiles_when_training_begins_where_it_pays(tiny_llama, tmp_path, monkeypatch):
    """None decides at `on_train_begin` (the Trainer's planned steps): left plain where the rule says no (CPU here),
    compiled where it says yes, and the step then runs through the compiled layers. aot_eager: dynamo and
    AOTAutograd without inductor's code generation (tests/test_compiled_layers.py has inductor's numbers)."""
    from torch._dynamo.utils import counters

    from trl_scale.trainers.decoder_layers import DecoderLayers

    plain = _grpo(tiny_llama, tmp_path, "plain", max_steps=1)
    plain.train()
    assert not any(getattr(layer, "_trl_scale_compiled", False) for layer in decoder_layers(plain.model))
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, backend="aot_eager", **kwargs))
    planned_steps = []
    monkeypatch.setattr(
        DecoderLayers, "why_not_compile", lambda self, trainer, steps: planned_steps.append(steps)
    )  # returns None: it pays
    trainer = _grpo(tiny_llama, tmp_path, "compiled", max_steps=1)
    assert not any(getattr(layer, "_trl_scale_compiled", False) for layer in decoder_layers(trainer.model))
    torch._dynamo.reset()
    counters.clear()
    trainer.train()
    assert planned_steps == [1]
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            assert all(getattr(layer, "_trl_scale_compiled", False) for layer in decoder_layers(model))
    assert counters["stats"]["unique_graphs"] >= 1


def test_compile_decoder_layers_true_on_a_model_without_decoder_layers_names_the_field(tmp_path):
    gpt2 = build_tiny_model(tmp_path / "gpt2", family="gpt2")
    config = trl_scale.GRPOConfig(**cpu_args(tmp_path / "out", num_generations=4), compile_decoder_layers=True)
    with pytest.raises(ValueError, match=r"compile_decoder_layers=True compiles each decoder layer, but .*Fix: "):
        trl_scale.GRPOTrainer(
            model=gpt2, reward_funcs=token_parity_reward, args=config, train_dataset=counting_prompts(16, seed=0)
        )


def test_the_numbers_the_docs_give_are_the_codes():
    from trl_scale.scoring.arguments import ScoringArguments

    from .helpers import ROOT

    pages = " ".join((ROOT / "docs" / name).read_text() for name in ("packed-scoring.md", "gpu.md"))
    pages = " ".join(pages.split())
    assert f"{compiled.COMPILE_MIN_STEPS} steps or more planned" in pages
    assert f"from {compiled.COMPILE_MIN_STEPS} planned steps" in pages
    assert f"{compiled.COMPILE_MIN_PARAMETERS // 10**6}M parameters or more" in pages
    assert f"{checkpointing.MARGIN_FRACTION * 100:.0f} % of the device is kept free" in pages
    field_doc = " ".join(ScoringArguments.FIELDS_DOC.split())
    assert f"{compiled.COMPILE_MIN_STEPS} optimizer steps or more planned" in field_doc
