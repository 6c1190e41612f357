"""`trl-scale serve`: a transformers-backed server speaking vLLM's contract (the OpenAI-compatible routes and the
dev-mode RL routes of vLLM 0.22-0.33), for CPU machines and tests.

Routes, with vLLM's request and response models and status codes (vLLM 0.31 source, cited where each is built):
`GET /health`, `GET /v1/models`, `POST /v1/completions` (token-id or text prompts, `n`, sampling parameters,
`logprobs`, `return_token_ids`; choices prompt-major; `logprobs.tokens` decoded unless
`return_tokens_as_token_ids`), and the RL routes: `/pause` `/resume` `/is_paused`, `/reset_prefix_cache`,
`/get_world_size`, `/server_info`, `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` (JSON
`update_info`; a non-JSON body is a 400), `/finish_weight_update`, `/update_weight_version`, `/weight_info`,
`/collective_rpc` (`reload_weights` from a directory), `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's
LoRA rules). Its weight-transfer engine is `trl_scale_gloo` (`--world-size` ranks, one thread each), the very code
real vLLM runs with trl-scale's plugin (`trl_scale_vllm_plugin.gloo`). JSON and safetensors only, never pickle.

The package imports no web framework until a server is built (`create_app` and the routes load FastAPI on first
use), and nothing of the rollout client or the fleet (`tests/test_layers.py`).
"""

from .command import check_bind, serve
from .served import ServedModel, ServeSettings, check_language_model_head, weights_digest_of

__all__ = [
    "ServeSettings",
    "ServedModel",
    "check_bind",
    "check_language_model_head",
    "create_app",
    "serve",
    "weights_digest_of",
]


def __getattr__(name: str):
    if name == "create_app":  # FastAPI, on first use
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'trl_scale.serve' has no attribute {name!r}")
