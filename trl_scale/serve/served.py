"""What one `trl-scale serve` process holds, as one typed object the routes share: the model and tokenizer, the
settings it was started with, the pause gate its generations pass, and the RL state vLLM's routes change (weight
version, LoRA adapters, the weight-transfer engine). torch and transformers only: no web framework here."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..model_paths import check_model_path

MAX_REQUEST_BYTES = 16 * 2**20  # JSON requests; weight bodies are bounded by the model's own size


class RequestError(Exception):
    """A request this server refuses: `status` and `message`, answered as FastAPI's `{"detail": message}`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class ServeSettings:
    """`trl-scale serve`'s command line."""

    model_path: str
    api_key: str | None = None
    token_delay: float = 0.0  # seconds per generated token, with the model held (benchmarks: a slower server)
    # seconds per decoding step of a request, the model not held: concurrent requests overlap, so a request lasts as
    # long as its own longest answer (continuous batching, as vLLM), and a long tail costs what it costs there
    step_delay: float = 0.0
    dtype: str = "float32"
    trust_remote_code: bool = False
    max_request_bytes: int = MAX_REQUEST_BYTES
    world_size: int = 1  # ranks this server brings to the weight-transfer group (as a TP x DP vLLM server)
    max_lora_rank: int = 16
    weight_transfer_timeout: float = 300.0
    return_routed_experts: bool = False  # vLLM's --enable-return-routed-experts: each choice carries its routes


class PauseGate:
    """vLLM's `/pause` and `/resume` over whole-request generations: a paused server admits no new generation
    (they wait for the resume, none is dropped); admitted ones always finish with the weights they started with."""

    def __init__(self):
        self._condition = threading.Condition()
        self._running = True
        self.admitted = 0  # generations past the gate, not finished: what /pause?mode=wait drains

    @contextmanager
    def generation(self):
        with self._condition:
            self._condition.wait_for(lambda: self._running)
            self.admitted += 1
        try:
            yield
        finally:
            with self._condition:
                self.admitted -= 1
                self._condition.notify_all()

    def pause(self, wait: bool) -> None:
        """Admit nothing new; with `wait`, return once the admitted generations have finished."""
        with self._condition:
            self._running = False
            if wait:
                self._condition.wait_for(lambda: self.admitted == 0)

    def resume(self) -> None:
        with self._condition:
            self._running = True
            self._condition.notify_all()

    @property
    def paused(self) -> bool:
        return not self._running


@dataclass
class ServedModel:
    """The model being served and the state the routes share."""

    model: object
    tokenizer: object
    settings: ServeSettings
    model_name: str
    max_model_len: int
    processor: object | None = None  # a vision-language model's (images: `multimodal.py`); None for text models
    lock: threading.Lock = field(default_factory=threading.Lock)  # one generation or weight update at a time
    gate: PauseGate = field(default_factory=PauseGate)
    weight_version: str | None = None
    lora: dict[str, str] = field(default_factory=dict)  # adapter name -> its path
    engine: list | None = None  # the weight-transfer engine: this server's gloo ranks
    engine_layout: dict | None = None  # the group it joined: rank_offset, world_size, packed, bucket bytes
    updating: bool = False  # between /start_weight_update and /finish_weight_update
    prefix_cache_resets: int = 0
    # checkpoint name -> (the model parameter it sits in, its positions there), built at the first sync
    _checkpoint_views: dict | None = field(default=None, init=False, repr=False)
    completions_generated: int = 0  # prompts x n, over every /v1/completions request answered

    @classmethod
    def load(cls, settings: ServeSettings) -> ServedModel:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path, remote = settings.model_path, settings.trust_remote_code
        check_model_path(path, "--model")
        # Code shipped inside a model directory runs only when asked for (--trust-remote-code).
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, settings.dtype), trust_remote_code=remote, output_loading_info=True
        )
        check_language_model_head(model, loading, path)
        model.eval()
        name = os.path.basename(os.path.normpath(path))
        processor = None
        if getattr(model.config, "vision_config", None) is not None:  # a vision-language model: its images' processor
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(path, trust_remote_code=remote)
        # a vision-language config keeps its context length in its text config
        context = model.config.get_text_config().max_position_embeddings
        return cls(model, tokenizer, settings, name, context, processor=processor)

    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy full weights in (a sync), checked by name and shape first. Names are the model's own or its
        checkpoint's (as vLLM's loader reads them: a mixture-of-experts block's experts one tensor each, where the
        model holds them fused): a checkpoint tensor is written into the elements of the parameter it came from.
        Once a LoRA adapter is loaded, the wrapped layers' weights are named `...base_layer.weight`: updates under
        the base model's names go to those base weights, as vLLM updates its base under adapters."""
        expected = self.model.state_dict()
        base_names = {k.replace(".base_layer", ""): k for k in expected if ".base_layer." in k}
        if self._checkpoint_views is None:
            from ..checkpoint_names import checkpoint_views

            self._checkpoint_views = checkpoint_views(self.model)
        places = {}  # name -> (the parameter written, the flat positions written or None for all of it)
        for name in tensors:
            if base_names.get(name, name) in expected:
                places[name] = (base_names.get(name, name), None)
            elif name in self._checkpoint_views:
                parameter, positions = self._checkpoint_views[name]
                places[name] = (base_names.get(parameter, parameter), positions)
        unknown = sorted(set(tensors) - set(places))
        if unknown:
            raise RequestError(400, f"unknown parameter names: {unknown[:5]}")
        for name, tensor in tensors.items():
            parameter, positions = places[name]
            shape = expected[parameter].shape if positions is None else positions.shape
            if tensor.shape != shape:
                raise RequestError(400, f"{name}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        with self.lock, torch.no_grad():
            for name, tensor in tensors.items():
                parameter, positions = places[name]
                if positions is None:
                    expected[parameter].copy_(tensor)
                else:
                    target = expected[parameter].view(-1)
                    target[positions.reshape(-1)] = tensor.reshape(-1).to(target.dtype)


def check_language_model_head(model, loading: dict, model_path: str) -> None:
    """Refuse a checkpoint whose language-model head was not in it (a reward or value model's classifier
    checkpoint): transformers would initialise the head at random and the server would answer with noise."""
    architectures = list(getattr(model.config, "architectures", None) or [])
    head = model.get_output_embeddings()
    head_names = [name for name, module in model.named_modules() if module is head and name]
    missing = [key for key in loading.get("missing_keys", []) if any(key.startswith(n) for n in head_names)]
    heads = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "Model")
    if missing or any(a.endswith(heads) and not a.endswith("LMHeadModel") for a in architectures):
        raise ValueError(
            f"--model {model_path} is not a causal LM checkpoint (architectures: {architectures or 'unknown'}; "
            f"missing from it: {missing or 'none'}): its language-model head would be random and every completion "
            "noise. Fix: serve the policy (a checkpoint saved from an AutoModelForCausalLM), not a reward or value "
            "model"
        )


def weights_digest_of(named_tensors) -> dict[str, str]:
    """sha256 of each tensor's fp32 bytes, by name (LoRA wrappers' `base_layer` names mapped back)."""
    import hashlib

    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    digest = {}
    for name, tensor in items:
        if "lora_" in name:
            continue
        data = tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        digest[name.replace(".base_layer", "")] = hashlib.sha256(data).hexdigest()
    return digest
