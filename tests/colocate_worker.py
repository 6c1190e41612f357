"""Run in `.venv-vllm` (vLLM's CPU build beside trl-scale) by tests/test_colocate.py: GRPO, RLOO and PPO in TRL's
default vLLM mode (`use_vllm=True`, `vllm_mode="colocate"`), packing on, 3 steps each, fp32 policy. After every
weight sync the engine's prompt log-probs on a probe are compared with the policy's own; one JSON line per method.
GRPO also evaluates after steps 2 and 3 (TRL's `eval_strategy`, and the last step's): its logs and the rewards
its evaluation batches got.

    python -m tests.colocate_worker OUT_DIR MODEL_DIR METHOD [METHOD ...]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

PROBE = [5, 17, 33, 42, 8, 99, 120, 7, 64, 250, 11]


def parity_reward(completion_ids, **kwargs) -> list[float]:
    return [sum(t % 2 for t in ids) / max(1, len(ids)) for ids in completion_ids]


@torch.no_grad()
def policy_logprobs(trainer) -> list[float]:
    model = trainer.accelerator.unwrap_model(trainer.model)
    logits = model(input_ids=torch.tensor([PROBE])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(PROBE[1:])[:, None])[:, 0].tolist()


CACHED = PROBE * 4  # a prompt of whole KV blocks, generated from before each sync and again after it


@torch.no_grad()
def policy_next_logprob(trainer, prompt: list[int], token: int) -> float:
    model = trainer.accelerator.unwrap_model(trainer.model)
    logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    return logits.log_softmax(-1)[token].item()


def engine_next_token(llm, prompt: list[int]) -> tuple[int, float]:
    """vLLM's next token after `prompt` and its log-prob: what the prefix cache may serve from blocks it computed
    before (a sync that does not reset the cache leaves them: the old weights' keys and values)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, logprobs=0, temperature=1.0, seed=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0].outputs[0]
    token = out.token_ids[0]
    return token, out.logprobs[0][token].logprob


def engine_logprobs(llm) -> list[float]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    output = llm.generate([TokensPrompt(prompt_token_ids=PROBE)], params, use_tqdm=False)[0]
    return [entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], PROBE[1:], strict=True)]


def run(method: str, out: str, model: str) -> dict:
    from transformers import AutoTokenizer

    import trl_scale
    from trl_scale.toy import counting_prompts

    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
        "ppo": (trl_scale.PPOTrainer, trl_scale.PPOConfig),
    }[method]
    settings = dict(
        output_dir=os.path.join(out, method),
        per_device_train_batch_size=8,
        max_completion_length=6,
        max_steps=3,
        learning_rate=3e-3,  # the policy moves visibly between syncs
        use_vllm=True,
        vllm_mode="colocate",  # TRL's default
        vllm_max_model_length=128,
        vllm_gpu_memory_utilization=0.3,
        # blocks of 32 tokens (the CPU default, 128, would hold no whole block of a prompt in a 128-token context):
        # the cached-prefix check after each sync needs one
        vllm_llm_kwargs={"block_size": 32},
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if method == "ppo":  # one optimizer step per generation batch: one sync per step
        settings.update(num_ppo_epochs=1, num_mini_batches=1)
    else:
        settings["num_generations"] = 4
    evaluated = []  # GRPO: the rewards of each evaluation batch (TRL's eval_strategy: after steps 2 and 3)
    if method == "grpo":
        settings.update(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8, num_generations_eval=4)
        settings.update(eval_pass_at_k=[1, 4], eval_success_threshold=0.5)

    def reward(completion_ids, **kwargs) -> list[float]:
        values = parity_reward(completion_ids)
        if not trainer.model.training:
            evaluated.append(values)
        return values

    reward.__name__ = "parity_reward"
    began = time.monotonic()
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=config_cls(**settings),
        train_dataset=counting_prompts(64),
        eval_dataset=counting_prompts(2, seed=1) if method == "grpo" else None,
        processing_class=AutoTokenizer.from_pretrained(model),
    )
    generation = trainer.vllm_generation
    sync = generation.sync_weights
    syncs = []

    def checked_sync():
        if generation.llm is not None and syncs:
            engine_next_token(generation.llm, CACHED)  # its blocks cached, computed with the weights before the sync
        sync()
        policy, engine = policy_logprobs(trainer), engine_logprobs(generation.llm)
        assert len(policy) == len(engine) == len(PROBE) - 1
        token, cached = engine_next_token(generation.llm, CACHED)
        cached_diff = abs(cached - policy_next_logprob(trainer, CACHED, token))
        syncs.append(
            {"diff": max(abs(a - b) for a, b in zip(policy, engine)), "cached_diff": cached_diff, "policy": policy[:3]}
        )

    generation.sync_weights = checked_sync
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    from trl_scale.trainers.packing import PackedScoring

    packed = trainer.features.get(PackedScoring).stats is not None
    return {
        "method": method,
        "steps": trainer.state.global_step,
        "seconds": round(time.monotonic() - began, 1),
        "engine_dtype": str(generation.llm.llm_engine.model_config.dtype),
        "direct_load": generation._loads_directly,
        "packed": packed and all("padding_free/pad_fraction_removed" in e for e in logs),
        "syncs": syncs,
        "sampler_logp_difference_max": [e.get("sampling/sampling_logp_difference/max") for e in logs],
        "evaluations": [e for e in trainer.state.log_history if "eval_reward" in e],
        "evaluated_rewards": evaluated,
    }


if __name__ == "__main__":
    out_dir, model_dir, *methods = sys.argv[1:]
    for name in methods:
        print("RESULT " + json.dumps(run(name, out_dir, model_dir)), flush=True)
