"""GPU-only paths (skipped without CUDA): TRL's Triton kernel behind the chunked head, packed scoring on the GPU,
and the critic group's NCCL gradient averaging. Each guards code whose logic also has a CPU test."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_scale.scoring import chunked_logprobs, install_packed_scoring
from trl_scale.scoring.logprob_head import use_trl_kernel

from .helpers import padded_scoring_batch
from .test_scoring import _full_logits_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, 4.0)])
def test_chunked_logprobs_on_cuda_use_trl_kernel_and_match_full_logits(temperature, softcap):
    device = torch.device("cuda")
    assert use_trl_kernel(device), "on CUDA with Triton the head must dispatch to TRL's kernel"
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=generator).to(device).requires_grad_()
    weight = torch.randn(1000, 64, generator=generator).div(8).to(device).requires_grad_()
    targets = torch.randint(0, 1000, (300,), generator=generator).to(device)
    logp, entropy, *_ = chunked_logprobs(hidden, weight, None, targets, temperature, 256, softcap, 1.0, ("entropy",))
    bias = torch.zeros(1000, device=device)
    reference = _full_logits_reference(hidden, weight, bias, targets, temperature, softcap, 1.0)
    assert (logp - reference[0]).abs().max().item() <= 1e-4
    assert (entropy - reference[1]).abs().max().item() <= 1e-4
    grads = torch.autograd.grad(logp.sum(), (hidden, weight))
    ref_grads = torch.autograd.grad(reference[0].sum(), (hidden, weight))
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())


def test_packed_scoring_on_cuda_matches_padded(tiny_llama):
    from trl.trainer.utils import add_fused_lm_head

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    input_ids, mask, labels = (t.cuda() for t in padded_scoring_batch(tokenizer))
    padded = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa").cuda()
    packed = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa").cuda()
    add_fused_lm_head(padded, temperature=0.9, outputs=("log_probs", "entropy"))
    add_fused_lm_head(packed, temperature=0.9, outputs=("log_probs", "entropy"))
    install_packed_scoring(packed, temperature=0.9, outputs=("entropy",), token_budget=10)
    with torch.no_grad():
        expected = padded(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        got = packed(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    valid = expected.label_mask.bool()
    assert torch.equal(valid, got.label_mask.bool())
    assert (got.log_probs - expected.log_probs)[valid].abs().max().item() <= 1e-4
    assert (got.entropy - expected.entropy)[valid].abs().max().item() <= 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: one per critic worker")
def test_critic_group_averages_gradients_over_nccl(tiny_reward_model):
    ray = pytest.importorskip("ray")
    from trl_scale.critic import CriticBatch, CriticSettings, CriticUpdater, load_critic
    from trl_scale.critic.ray import RayCritic
    from trl_scale.critic.worker import CriticWorkerSettings
    from trl_scale.distributed.ray_backend import Placement, RoleGroup, init_ray

    init_ray()
    settings = CriticSettings(learning_rate=1e-2, max_grad_norm=None)
    placement = Placement(num_workers=2, num_gpus_per_worker=1.0)
    group = RoleGroup(
        "critic", tiny_reward_model, placement, CriticWorkerSettings(updater=settings, seed=0), timeout=300
    )
    remote = RayCritic(group)
    local = CriticUpdater(load_critic(tiny_reward_model, 0), settings)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 300, (6, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[::2, :2] = 0  # left padding on some rows
    mask = torch.ones(6, 4)
    mask[1, 3:] = 0
    returns = torch.randn(6, 4, generator=generator)
    values = local.values(input_ids, attention_mask, 5, 4)
    batch = CriticBatch(input_ids, attention_mask, 5, values, returns, mask)
    remote.step(batch)
    local.step(batch)
    assert torch.allclose(
        remote.values(input_ids, attention_mask, 5, 4), local.values(input_ids, attention_mask, 5, 4), atol=1e-4
    )
    group.shutdown()
    ray.shutdown()


def test_sdpa_model_on_cuda_packs_on_torchs_varlen_kernel(tiny_llama):
    """On CUDA an sdpa model is switched to torch's flash varlen kernel (one packed row, no mask): in bf16, packed
    log-probs and gradients are no further from an fp32 score than TRL's padded bf16 path is."""
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring import packing_support
    from trl_scale.scoring.varlen import VARLEN_SDPA

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    input_ids, mask, labels = (t.cuda() for t in padded_scoring_batch(tokenizer))
    models = {}
    for name, dtype in (("fp32", torch.float32), ("padded", torch.bfloat16), ("packed", torch.bfloat16)):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa", dtype=dtype).cuda()
        add_fused_lm_head(model, outputs=("log_probs",))
        models[name] = model
    install_packed_scoring(models["packed"])
    assert models["packed"].config._attn_implementation == VARLEN_SDPA
    assert packing_support(models["packed"].base_model).varlen
    logps = {}
    for name, model in models.items():
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        out.log_probs.sum().backward()
        logps[name] = out.log_probs.detach().float()
    valid = labels[:, 1:] != -100
    error = {name: (logps[name] - logps["fp32"])[valid].abs() for name in ("padded", "packed")}
    assert error["packed"].mean() <= 1.1 * error["padded"].mean() + 1e-3
    assert error["packed"].max() <= 1.5 * error["padded"].max() + 1e-3
    assert models["packed"].model.embed_tokens.weight.grad is not None


class _CappedMemory:
    """The device's memory with `available` capped at `cap` bytes above what is allocated when the cap is set."""

    def __init__(self, memory, cap: float | None = None):
        self.memory, self.cap, self.floor = memory, cap, memory.allocated()

    def allocated(self) -> int:
        return self.memory.allocated()

    def available(self) -> int:
        free = self.memory.available()
        return free if self.cap is None else int(min(free, self.floor + self.cap - self.memory.allocated()))

    def total(self) -> int:
        return self.memory.total()


def test_checkpointed_layers_planned_by_real_cuda_memory_fit_what_they_planned():
    """The plan against the CUDA allocator: the first forward measures what an unchecked layer keeps, a roomy device
    then checkpoints no layer, a capped one some; each step's peak stays within what its plan counted, and the
    gradients are those of every layer checkpointed."""
    from transformers import Qwen2Config
    from trl.trainer.utils import add_fused_lm_head

    from trl_scale.scoring.checkpointing import DeviceMemory, SelectiveCheckpointing

    config = Qwen2Config(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=8192, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    models = [AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        model.train()
        add_fused_lm_head(model, outputs=("log_probs",))
        install_packed_scoring(model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    everything, planned = models
    memory = _CappedMemory(DeviceMemory(torch.device("cuda")))
    planner = SelectiveCheckpointing(planned, memory, margin_fraction=0.0)
    ids = torch.randint(0, 1000, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()

    def step(model):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float().sum().backward()
        return torch.cuda.max_memory_allocated() - before

    def grads(model):
        return [p.grad.float().clone() for p in model.parameters()]

    step(everything)
    floor_grads = grads(everything)  # two runs of one model: the kernels' own run-to-run spread in bf16
    everything.zero_grad(set_to_none=False)
    step(everything)
    step(planned)
    layers = len(planner.layers)
    assert planner.last_checkpointed == layers - 1 and planner.activation_bytes > 0
    for cap_layers in (None, layers // 2):
        planned.zero_grad(set_to_none=False)  # the gradients exist: the plan counts none to come
        if cap_layers is not None:
            kept = (layers - cap_layers + 1) * planner.activation_bytes + (layers + 1) * planner.hidden_bytes
            memory.cap, memory.floor = 4096 * kept, memory.allocated()
        per_token = planner.activation_bytes
        peak = step(planned)
        checkpointed = planner.last_checkpointed
        assert (checkpointed == 0) if cap_layers is None else (0 < checkpointed <= cap_layers + 1), checkpointed
        counted = 4096 * ((layers - checkpointed + (1 if checkpointed else 0)) * per_token
                          + (layers + 1) * planner.hidden_bytes)  # fmt: skip
        print(f"cap {cap_layers}: {checkpointed} of {layers} checkpointed, peak {peak / 2**20:.0f} MiB, counted "
              f"{counted / 2**20:.0f} MiB, {per_token / 1024:.1f} KiB a token and layer")  # fmt: skip
        # the backward's transient tensors come on top of what is kept (a trainer's plan leaves 10 % of the device)
        assert 0.5 * counted <= peak <= 1.1 * counted + 256 * 2**20, (peak, counted)
    # one step's gradients, the same weights: planned as far from every layer checkpointed as two runs of that are
    for (name, a), b, floor in zip(everything.named_parameters(), grads(planned), floor_grads):
        spread = (a.grad.float() - floor).norm().item()
        assert (a.grad.float() - b).norm().item() <= 2 * spread + 1e-3 * a.grad.float().norm().item(), name
