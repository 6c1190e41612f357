"""`ServerRolloutGeneration`: the multi-server rollout client behind TRL's `vllm_generation` interface, so GRPO,
RLOO and PPO generate through it unchanged (`generate(...)` and `sync_weights()`).

It is TRL's `VLLMGeneration` with the single-server `VLLMClient` replaced: the parameter walk that gathers
ZeRO-3 shards, FSDP DTensors and merged PEFT weights under vLLM's names (`_iter_named_params`) is TRL's own.
Weight sync modes (`weight_sync`):

- `"nccl"`: one weight-transfer group over every server (vLLM's NCCL engine, which needs vLLM and CUDA in the
  trainer as TRL's does; `trl-scale serve` offers the same calls over gloo, so CPU trainers can use it there);
- `"shared_dir"`: safetensors under vLLM's names in a directory the servers read, reloaded with vLLM's
  `/collective_rpc reload_weights` (works from a CPU trainer against real vLLM);
- `"lora"`: the adapter only, a new name per sync, the superseded one unloaded;
- `"auto"`: `"nccl"` where every server offers an engine this trainer can drive, else `"shared_dir"`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid

from accelerate.utils import broadcast_object_list
from trl.generation.vllm_generation import VLLMGeneration

from .client import LORA_PREFIX, RolloutClient, RolloutError

logger = logging.getLogger(__name__)


class ServerRolloutGeneration(VLLMGeneration):
    def __init__(
        self,
        trainer,
        client: RolloutClient,
        weight_sync: str = "auto",
        weight_sync_dir: str | None = None,
        weight_sync_timeout: float = 120.0,
        ready_timeout: float = 240.0,
        logprobs: bool = True,
    ):
        self.trainer = trainer
        self.client = client
        self.requested_weight_sync = weight_sync
        self.weight_sync_dir = weight_sync_dir
        self.weight_sync_timeout = weight_sync_timeout
        self.ready_timeout = ready_timeout
        self.lora_name: str | None = None
        self.sync_count = 0
        self.version: str | None = None  # the weights the servers serve, as the last sync named them
        self._run_id = uuid.uuid4().hex[:8]  # versions and adapter names never collide across runs or resumes
        args = trainer.args
        super().__init__(
            model=trainer.model,
            accelerator=trainer.accelerator,
            processing_class=trainer.processing_class,
            mode="server",
            server_base_url=client.servers[0].url,
            server_timeout=ready_timeout,
            max_completion_length=args.max_completion_length,
            logprobs=0 if logprobs else None,
        )

    # TRL's `_init_vllm` imports vLLM and builds its one-server client; ours waits for every server instead.
    def _init_vllm(self) -> None:
        self.client.wait_until_ready(self.ready_timeout)
        accelerator = self.accelerator
        decision = [None]
        if accelerator.is_main_process:
            try:
                decision = [("ok", self._choose_weight_sync())]
            except Exception as error:  # every rank raises it, none waits forever
                decision = [("error", f"{type(error).__name__}: {error}")]
        decision = broadcast_object_list(decision, from_process=0) if accelerator.num_processes > 1 else decision
        status, value = decision[0]
        if status == "error":
            raise ValueError(value)
        self.weight_sync, self.weight_backend = value
        if self.weight_sync == "lora":
            self.client.version_reader = self.client.lora_version

    def _choose_weight_sync(self) -> tuple[str, str | None]:
        """The mode and, for "nccl", the servers' engine backend; LoRA adapters checked against vLLM's rules."""
        from .weight_transfer import check_nccl_sender

        mode = self.requested_weight_sync
        if mode == "lora":
            check_lora_adapter(self.model, self.client)
            return "lora", None
        if mode == "shared_dir":
            return "shared_dir", None
        backend = self.client.weight_transfer_backend()
        if mode == "nccl":
            if backend is None:
                raise RolloutError(
                    "weight_sync='nccl': the servers offer no weight-transfer engine (/server_info has no "
                    "weight_transfer_config). Fix: start vLLM with VLLM_SERVER_DEV_MODE=1 and "
                    '--weight-transfer-config \'{"backend":"nccl"}\' (as `trl vllm-serve` does), or use '
                    "weight_sync='shared_dir'"
                )
            if backend == "nccl":
                check_nccl_sender()
            return "nccl", backend
        # auto
        from .weight_transfer import GLOO_BACKEND

        if backend == GLOO_BACKEND:
            return "nccl", backend
        if backend == "nccl":
            try:
                check_nccl_sender()
                return "nccl", backend
            except RuntimeError as error:
                logger.warning("weight_sync='auto' uses 'shared_dir': %s", error)
        return "shared_dir", None

    # ---- generation -------------------------------------------------------------------------------------

    def _sampling(self) -> dict:
        args = self.trainer.args
        sampling = {
            "max_tokens": args.max_completion_length,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else -1,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            "logprobs": self.logprobs,
            "return_tokens_as_token_ids": True,  # as TRL sends it
        }
        sampling.update(args.generation_kwargs or {})
        return sampling

    def _request(self, prompts) -> list[list[dict]]:
        """One batch's completions from the servers: consecutive copies of a prompt (TRL's sampler puts a prompt's
        generations next to each other) go as one request with `n`, so the server batches them. Choices in order."""
        groups: list[list] = []
        for prompt in prompts:
            prompt = list(prompt)
            if groups and groups[-1][0] == prompt:
                groups[-1][1] += 1
            else:
                groups.append([prompt, 1])
        results = self.client.generate(
            [p for p, _ in groups], n=[n for _, n in groups], model=self.lora_name, **self._sampling()
        )
        return [choice for choices in results for choice in choices]

    def enable_async(self, staleness: int, tokenize) -> None:
        """Prefetch up to `staleness` generation batches ahead (see `async_rollout`)."""
        from concurrent.futures import ThreadPoolExecutor

        from .async_rollout import RolloutPrefetcher

        # Its own threads: a prefetch waits on the client's request pool, which must never wait on itself.
        self._prefetch_pool = ThreadPoolExecutor(max_workers=max(1, staleness), thread_name_prefix="prefetch")
        self.prefetcher = RolloutPrefetcher(
            staleness, tokenize, lambda ids: self._prefetch_pool.submit(self._request, [list(p) for p in ids])
        )

    prefetcher = None
    last_versions: list[int] = []  # per completion of the last batch: the sync count its weights came from

    def generate(self, prompts, images=None, num_generations=1, profiler=None):
        """Each rank sends its own prompts. With async rollout, a batch prefetched at most `staleness` syncs ago
        is served from its request, then the next batches are requested with the weights just synced."""
        if images is not None and any(image is not None for image in images):
            raise NotImplementedError("server rollout with images is not supported yet; use vLLM's own server mode")
        taken = self.prefetcher.take(prompts, self.sync_count) if self.prefetcher is not None else None
        if taken is not None:
            choices, version = taken
        else:
            choices, version = self._request(prompts), self.sync_count
        if self.prefetcher is not None:
            self.prefetcher.submit_upcoming(self.sync_count)
        self.last_versions = [version] * len(choices)
        completion_ids, logprobs, logprob_ids = [], [], []
        for choice in choices:
            completion_ids.append(choice["token_ids"])
            if self.logprobs is not None and choice.get("logprobs"):
                values = [float("nan") if v is None else v for v in choice["logprobs"]["token_logprobs"]]
                logprobs.append([[v] for v in values])
            else:
                logprobs.append([[float("nan")] for _ in choice["token_ids"]])
            logprob_ids.append([[t] for t in choice["token_ids"]])
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_ids

    # ---- weight sync ------------------------------------------------------------------------------------

    def sync_weights(self) -> None:
        """Push the policy's current weights to every server. Every rank walks the parameters (gathering shards
        is a collective); the main process sends. Its outcome reaches every rank, so a failed sync raises on all
        of them instead of leaving the others waiting."""
        accelerator = self.accelerator
        version = f"{LORA_PREFIX}{self._run_id}-{self.sync_count + 1}"
        outcome = [("ok", version)]
        try:
            if self.weight_sync == "lora":
                if accelerator.is_main_process:
                    self._sync_lora(version)
            elif self.weight_sync == "nccl":
                self._sync_collective(version)
            else:
                self._sync_shared_dir(version)
        except Exception as error:
            outcome = [("error", f"{type(error).__name__}: {error}")]
        if accelerator.num_processes > 1:
            outcome = broadcast_object_list(outcome, from_process=0)
        status, value = outcome[0]
        if status == "error":
            raise RolloutError(f"weight sync failed: {value}")
        self.sync_count += 1
        self.version = value
        if self.weight_sync == "lora":
            self.lora_name = value
        self.client.version = value  # every rank routes only to servers on this version

    def _metadata(self) -> list[tuple[str, str, list[int]]]:
        # The servers must know every tensor before the first is broadcast: walked once, then cached (as TRL does).
        if self._weight_metadata is None:
            self._weight_metadata = [
                (name, str(param.dtype).removeprefix("torch."), list(param.shape))
                for name, param in self._iter_named_params()
            ]
        return self._weight_metadata

    def _sync_collective(self, version: str) -> None:
        from .weight_transfer import make_sender

        metadata = self._metadata()
        if self.accelerator.is_main_process:
            self.client.update_weights(
                metadata,
                self._iter_named_params(),
                version,
                lambda: make_sender(self.weight_backend, self.weight_sync_timeout),
                timeout=self.weight_sync_timeout,
            )
        else:
            for _ in self._iter_named_params():  # take part in the gathers
                pass

    def _sync_shared_dir(self, version: str) -> None:
        from safetensors.torch import save_file

        main = self.accelerator.is_main_process
        state = {}
        for name, tensor in self._iter_named_params():
            if main:  # a copy: a gathered ZeRO-3 parameter is released when the walk moves on
                state[name] = tensor.detach().to("cpu", copy=True).contiguous()
        if not main:
            return
        if self.weight_sync_dir is None:
            self.weight_sync_dir = tempfile.mkdtemp(prefix="trl-scale-weights-")
        # A fresh directory per sync, written completely before any server reads it; the previous one is removed.
        directory = os.path.join(self.weight_sync_dir, f"weights-{version}")
        os.makedirs(directory, exist_ok=True)
        save_file(state, os.path.join(directory, "model.safetensors"))
        self.client.reload_weights(directory, version, timeout=self.weight_sync_timeout)
        for entry in os.listdir(self.weight_sync_dir):
            if entry.startswith("weights-") and entry != f"weights-{version}":
                shutil.rmtree(os.path.join(self.weight_sync_dir, entry), ignore_errors=True)

    def _sync_lora(self, version: str) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if self.weight_sync_dir is None:
            self.weight_sync_dir = tempfile.mkdtemp(prefix="trl-scale-lora-")
        path = os.path.join(self.weight_sync_dir, version)
        model.save_pretrained(path)
        self.client.load_lora_adapter(version, path, version, timeout=self.weight_sync_timeout)
        if self.lora_name and self.lora_name != version:
            shutil.rmtree(os.path.join(self.weight_sync_dir, self.lora_name), ignore_errors=True)


def check_lora_adapter(model, client: RolloutClient | None = None) -> None:
    """Refuse, before training, a LoRA adapter vLLM would refuse at the first sync (vLLM 0.31
    `lora/peft_helper.py:41-56,128-134`): `modules_to_save`, DoRA, a bias, a rank above the server's
    `--max-lora-rank`, or servers without LoRA enabled."""
    config = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    if config is None:
        return  # no adapter: the trainer's own check names the fix
    problems = []
    if getattr(config, "modules_to_save", None):
        problems.append(f"peft_config.modules_to_save={list(config.modules_to_save)} (vLLM loads no extra modules)")
    if getattr(config, "use_dora", False):
        problems.append("peft_config.use_dora=True (vLLM does not support DoRA)")
    if getattr(config, "bias", "none") != "none":
        problems.append(f"peft_config.bias={config.bias!r} (vLLM supports bias='none' only)")
    if client is not None:
        for server in client.servers:
            limit = _server_max_lora_rank(client, server)
            if limit is None:
                problems.append(
                    f"{server.url} has LoRA off: start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
                )
            elif config.r > limit:
                problems.append(
                    f"peft_config.r={config.r} is above {server.url}'s --max-lora-rank {limit} (raise it, or r)"
                )
    if problems:
        raise ValueError(
            "weight_sync='lora' sends this adapter to vLLM, which would refuse it: "
            + "; ".join(dict.fromkeys(problems))
            + ". Fix the adapter (or the servers' flags), or use weight_sync='nccl' / 'shared_dir' (full weights)"
        )


def _server_max_lora_rank(client: RolloutClient, server) -> int | None:
    try:
        response = client._get(server, "/server_info?config_format=json", timeout=30)
        response.raise_for_status()
        info = response.json().get("vllm_config") or {}
        if isinstance(info, str):
            info = json.loads(info)
    except Exception:
        return 16  # no dev-mode info: assume vLLM's default rank limit, the load call will tell otherwise
    lora_config = info.get("lora_config")
    if not lora_config:
        return None
    return int(lora_config.get("max_lora_rank", 16))
