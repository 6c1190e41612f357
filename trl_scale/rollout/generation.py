"""`ServerRolloutGeneration`: the rollout client behind TRL's `vllm_generation` interface, so GRPO, RLOO and
PPO generate through it unchanged (`generate(...)` and `sync_weights()`), without vLLM in the trainer."""

from __future__ import annotations

import os
import tempfile

import torch

from .client import RolloutClient


class ServerRolloutGeneration:
    def __init__(
        self,
        trainer,
        client: RolloutClient,
        weight_sync: str = "http",
        weight_sync_dir: str | None = None,
        weight_sync_timeout: float = 120.0,
        logprobs: bool = True,
    ):
        self.trainer = trainer
        self.client = client
        self.weight_sync = weight_sync
        self.weight_sync_dir = weight_sync_dir
        self.weight_sync_timeout = weight_sync_timeout
        self.logprobs = logprobs
        self.lora_name: str | None = None
        self.sync_count = 0

    def _sampling(self) -> dict:
        args = self.trainer.args
        sampling = {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else -1,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            "logprobs": 0 if self.logprobs else None,
        }
        sampling.update(args.generation_kwargs or {})
        return sampling

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        """Each rank sends its own prompts (one completion each): no cross-rank gather is needed."""
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("server rollout with images is not supported yet; use vLLM's own server mode")
        results = self.client.generate([list(p) for p in prompts], n=1, model=self.lora_name, **self._sampling())
        completion_ids, logprobs, logprob_ids = [], [], []
        for choices in results:
            choice = choices[0]
            completion_ids.append(choice["token_ids"])
            if self.logprobs and choice.get("logprobs"):
                values = [float("nan") if v is None else v for v in choice["logprobs"]["token_logprobs"]]
                logprobs.append([[v] for v in values])
                logprob_ids.append([[t] for t in choice["token_ids"]])
            else:
                logprobs.append([[float("nan")] for _ in choice["token_ids"]])
                logprob_ids.append([[t] for t in choice["token_ids"]])
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_ids

    def sync_weights(self) -> None:
        """Push the policy's current weights to every server (main process; the others wait)."""
        accelerator = self.trainer.accelerator
        model = accelerator.unwrap_model(self.trainer.model)
        if accelerator.is_main_process:
            if self.weight_sync == "lora":
                self._sync_lora(model)
            else:
                state = _merged_state_dict(model)
                if self.weight_sync == "shared_dir":
                    self._sync_shared_dir(state)
                else:
                    self.client.update_weights(state, timeout=self.weight_sync_timeout)
            self.sync_count += 1
        accelerator.wait_for_everyone()

    def _sync_shared_dir(self, state: dict) -> None:
        from safetensors.torch import save_file

        directory = self.weight_sync_dir or tempfile.mkdtemp(prefix="trl-scale-weights-")
        os.makedirs(directory, exist_ok=True)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in state.items()}, os.path.join(directory, "model.safetensors")
        )
        self.client.update_weights_from_path(directory, timeout=self.weight_sync_timeout)

    def _sync_lora(self, model) -> None:
        directory = self.weight_sync_dir or tempfile.mkdtemp(prefix="trl-scale-lora-")
        name = f"policy-step-{self.trainer.state.global_step}"
        path = os.path.join(directory, name)
        model.save_pretrained(path)
        self.client.load_lora_adapter(name, path, timeout=self.weight_sync_timeout)
        self.lora_name = name


def _merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The weights a plain (non-PEFT) copy of the model has: LoRA merged in, PEFT prefixes stripped."""
    if hasattr(model, "merge_adapter") and hasattr(model, "peft_config"):
        model.merge_adapter()
        try:
            state = {}
            for name, tensor in model.state_dict().items():
                # LoRA factors are merged in already; modules_to_save keep a frozen original beside the trained copy.
                if "lora_" in name or ".original_module." in name:
                    continue
                name = name.removeprefix("base_model.model.").replace(".base_layer", "")
                name = name.replace(".modules_to_save.default", "")
                state[name] = tensor.detach().clone()
            return state
        finally:
            model.unmerge_adapter()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}
