"""One look at every rollout server before training (and `trl-scale check-servers`): what each offers, and what a
run with these settings would trip over, one line per problem naming the server, the flag and the fix.

What is read (vLLM 0.31-0.33, the same routes on `trl-scale serve`): `/v1/models` (served model, `max_model_len`),
`/server_info?config_format=json` (dev mode only: log-prob mode, LoRA limits, weight-transfer backend),
`/get_world_size`, `/weight_info`, and whether the runtime LoRA routes exist (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from ..logs import get_logger
from .urls import definite_failure

logger = get_logger(__name__)

DEV_MODE_FIX = (
    "start it with VLLM_SERVER_DEV_MODE=1 (vLLM's RL routes: /pause, /resume, /collective_rpc, /server_info, "
    "/weight_info, the weight-transfer routes; `trl vllm-serve` sets it)"
)
LORA_FIX = "start it with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
LOGPROBS_FIX = "restart it with --logprobs-mode processed_logprobs (as `trl vllm-serve` does)"

# Sampling settings under which vLLM's raw log-probs (before temperature and logit processors) differ from the
# distribution the completions were drawn from.
_NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

# vLLM 0.32 `lora/peft_helper.py` `_validate_features` / `validate_legal`: adapters it refuses to load.
_SUPPORTED_LORA_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass
class ServerReport:
    """What one server offers."""

    url: str
    reachable: bool = False
    error: str = ""
    model: str | None = None
    model_path: str | None = None  # the checkpoint it loaded (dev mode's vllm_config), as the server names it
    max_model_len: int | None = None
    dev_mode: bool | None = None  # None: unknown (unreachable)
    logprobs_mode: str | None = None
    lora_enabled: bool | None = None  # None: unknown (no dev mode)
    max_lora_rank: int | None = None
    runtime_lora: bool | None = None  # the /v1/load_lora_adapter route exists
    weight_transfer: str | None = None
    world_size: int | None = None
    weight_version: str | None = None
    device_type: str | None = None  # vLLM's device_config: "cuda", "cpu"; None: unknown (trl-scale serve)
    returns_routes: bool | None = None  # started with --enable-return-routed-experts (None: unknown, no dev mode)
    paused: bool | None = None  # paused now (a trainer ended during a weight sync leaves its servers so)

    def row(self) -> dict[str, str]:
        def show(value, unknown="?"):
            return unknown if value is None else str(value)

        lora = "?" if self.lora_enabled is None else (f"max rank {self.max_lora_rank}" if self.lora_enabled else "off")
        if self.lora_enabled and self.runtime_lora is False:
            lora += " (no runtime loading)"
        return {
            "server": self.url,
            "ready": "yes" if self.reachable else f"no ({self.error})",
            "model": show(self.model),
            "max_model_len": show(self.max_model_len),
            "dev mode": "?" if self.dev_mode is None else ("yes" if self.dev_mode else "no"),
            "logprobs mode": show(self.logprobs_mode),
            "LoRA": lora,
            "weight transfer": show(self.weight_transfer, "none" if self.dev_mode else "?"),
            "world size": show(self.world_size),
            "weight version": show(self.weight_version),
        }


@dataclass
class RunNeeds:
    """What a run will ask of the servers."""

    weight_sync: str | None = None  # "auto", "nccl", "shared_dir", "lora"; None: no run (check-servers)
    max_completion_length: int | None = None
    importance_sampling: bool = False  # the sampler's log-probs feed an importance-sampling correction
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k, min_p, repetition_penalty
    on_sampler_support: bool = False  # the trainer scores on the sampler's top-k/top-p/min-p support
    lora_config: object | None = None  # the policy's peft config (weight_sync="lora")
    vocab_size: int | None = None
    policy_path: str | None = None
    streaming: bool = False  # syncs meet running requests (async_rollout_mode="streaming")
    routes: bool = False  # every completion's expert routes (routing_replay)


def inspect_server(get: Callable[[str, str], requests.Response], post: Callable, url: str) -> ServerReport:
    """`get(url, path)` / `post(url, path, json)` do the HTTP; nothing here raises for a server's answers."""
    report = ServerReport(url)
    try:
        models = get(url, "/v1/models")
        models.raise_for_status()
        first = models.json()["data"][0]
        report.model, report.max_model_len = first.get("id"), first.get("max_model_len")
        report.reachable = True
    except Exception as error:
        report.error = _why_unreachable(url, error)
        return report
    try:
        info = get(url, "/server_info?config_format=json")
        report.dev_mode = info.status_code == 200
        if report.dev_mode:
            config = info.json().get("vllm_config") or {}
            if isinstance(config, str):
                config = json.loads(config)
            model_config = config.get("model_config") or {}
            report.logprobs_mode = model_config.get("logprobs_mode")
            report.model_path = model_config.get("model")
            device = config.get("device_config") or {}
            report.device_type = device.get("device_type") or device.get("device")
            lora = config.get("lora_config")
            report.lora_enabled = bool(lora)
            report.max_lora_rank = int(lora.get("max_lora_rank", 16)) if lora else None
            report.returns_routes = bool((config.get("aux_output_config") or {}).get("enable_return_routed_experts"))
            transfer = config.get("weight_transfer_config")
            report.weight_transfer = transfer.get("backend", "nccl") if transfer else None
            world = get(url, "/get_world_size")
            report.world_size = int(world.json()["world_size"]) if world.status_code == 200 else None
            version = get(url, "/weight_info")
            report.weight_version = version.json().get("weight_version") if version.status_code == 200 else None
            paused = get(url, "/is_paused")
            report.paused = bool(paused.json().get("is_paused")) if paused.status_code == 200 else None
        # The runtime LoRA routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: an unknown adapter then gets
        # vLLM's own error, a missing route FastAPI's {"detail": "Not Found"}.
        probe = post(url, "/v1/unload_lora_adapter", {"lora_name": "trl-scale-preflight-probe"})
        report.runtime_lora = not (probe.status_code == 404 and probe.text.strip() == '{"detail":"Not Found"}')
    except Exception as error:  # a server that answers /v1/models but breaks here: say so, keep what was read
        report.error = f"while inspecting: {error!r}"[:200]
    return report


def _why_unreachable(url: str, error: Exception) -> str:
    """What a failed `/v1/models` says: a definite cause (404, TLS, not HTTP, refused) in words, else its type."""
    if not isinstance(error, requests.RequestException):
        return repr(error)[:120]
    status = getattr(getattr(error, "response", None), "status_code", None)
    definite = definite_failure(url, status, error, refused_is_definite=True, path="/v1/models")
    return definite.removeprefix(f"{url}: ").removeprefix(url) if definite else type(error).__name__


def lora_refusals(config, max_rank: int | None) -> list[str]:
    """What vLLM 0.32/0.33 would refuse in this adapter at the first sync (`lora/peft_helper.py`)."""
    problems = []
    modules = [m for m in (getattr(config, "modules_to_save", None) or []) if m not in ("classifier", "score")]
    if modules:
        problems.append(f"peft_config.modules_to_save={modules} (vLLM loads no extra modules)")
    if getattr(config, "use_dora", False):
        problems.append("peft_config.use_dora=True (vLLM does not support DoRA)")
    if getattr(config, "lora_bias", False):
        problems.append("peft_config.lora_bias=True (vLLM does not support LoRA bias)")
    if getattr(config, "bias", "none") != "none":
        problems.append(f"peft_config.bias={config.bias!r} (vLLM supports bias='none' only)")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _SUPPORTED_LORA_INITS:
        problems.append(
            f"peft_config.init_lora_weights={init!r} (it changes the base weights, which vLLM does not; convert it to "
            "a plain LoRA adapter with PEFT's path_initial_model_for_weight_conversion)"
        )
    for name, what in (
        ("alora_invocation_tokens", "Activated LoRA"),
        ("layer_replication", "layer_replication"),
        ("use_bdlora", "block-diagonal LoRA"),
        ("use_qalora", "QALoRA"),
    ):
        if getattr(config, name, None):
            problems.append(f"peft_config.{name} is set (vLLM does not support {what})")
    rank = max([int(config.r), *[int(r) for r in (getattr(config, "rank_pattern", None) or {}).values()]])
    if max_rank is not None and rank > max_rank:
        where = "peft_config.r" if rank == config.r else "peft_config.rank_pattern"
        problems.append(f"{where} has rank {rank}, above the server's --max-lora-rank {max_rank} (raise it)")
    return problems


_TRUNCATION = ("top_p", "top_k", "min_p")


def distorting_sampling(sampling: dict) -> list[str]:
    """The sampling settings under which raw log-probs are not the sampling distribution's."""
    found = []
    for name, neutral in _NEUTRAL_SAMPLING.items():
        value = sampling.get(name)
        if value is None or (name == "top_k" and value in (0, -1)):
            continue
        if float(value) != float(neutral):
            found.append(f"{name}={value}")
    return found


def _lora_problems(report: ServerReport, needs: RunNeeds, errors: list[str], warnings: list[str]) -> None:
    """weight_sync='lora': LoRA loading on, and the adapter within the server's limits."""
    url = report.url
    if report.lora_enabled is False or report.runtime_lora is False:
        why = "no --enable-lora" if report.lora_enabled is False else "/v1/load_lora_adapter is missing"
        errors.append(
            f"{url}: LoRA loading is off ({why}), so weight_sync='lora' cannot load the adapter. Fix: {LORA_FIX}"
        )
    if needs.lora_config is not None:
        if report.lora_enabled is None:
            warnings.append(
                f"{url}: its LoRA limits are unknown without dev mode (/server_info); an adapter above its "
                "--max-lora-rank fails at the first sync. To check them now: start it with VLLM_SERVER_DEV_MODE=1"
            )
        refused = lora_refusals(needs.lora_config, report.max_lora_rank if report.lora_enabled else None)
        errors += [f"{url} would refuse this adapter: {problem}" for problem in refused]


def _sampling_problems(report: ServerReport, needs: RunNeeds, errors: list[str], warnings: list[str]) -> None:
    """The importance-sampling correction: log-probs after the sampler's processing, on the support it samples."""
    url = report.url
    if needs.importance_sampling and report.dev_mode and report.logprobs_mode not in (None, "processed_logprobs"):
        distorted = distorting_sampling(needs.sampling)
        if distorted:
            errors.append(
                f"{url}: --logprobs-mode {report.logprobs_mode} returns log-probs before {', '.join(distorted)}, so "
                "the importance-sampling correction would be biased. Fix: "
                f"{LOGPROBS_FIX}, or set vllm_importance_sampling_correction=False"
            )
        else:  # TRL's rule (grpo_trainer.py:1144-1154): with neutral sampling the two modes agree
            warnings.append(
                f"{url}: runs with --logprobs-mode {report.logprobs_mode}, which biases the importance-sampling "
                f"correction once sampling is not neutral. Fix: {LOGPROBS_FIX}"
            )
    truncation = [name for name in distorting_sampling(needs.sampling) if name.split("=")[0] in _TRUNCATION]
    if needs.importance_sampling and truncation and not needs.on_sampler_support:
        warnings.append(
            f"{url}: with {', '.join(truncation)} vLLM's log-probs are renormalised over the tokens it keeps, and the "
            "trainer scores the whole vocabulary: every importance ratio carries the kept mass (an unchanged policy's "
            "is below 1). Fix: logprobs_on_sampler_support=True"
        )


def problems_of(report: ServerReport, needs: RunNeeds) -> tuple[list[str], list[str]]:
    """(errors, warnings) for one server and one run: each a line naming the server and the fix."""
    url, errors, warnings = report.url, [], []
    if not report.reachable:
        if "Fix:" in report.error:  # a definite cause, with its own fix
            return [f"{url}: not usable: {report.error}"], []
        return [f"{url}: not reachable ({report.error}). Fix: start it, or check the URL"], []
    if report.paused:
        errors.append(
            f"{url}: paused (a trainer that ended during a weight sync leaves its servers paused): every request "
            f"waits for /resume. Fix: POST {url}/resume (a trainer started against it resumes it)"
        )
    if needs.routes and report.returns_routes is False:
        errors.append(
            f"{url}: returns no expert routes (routing_replay=True). Fix: start it with "
            "--enable-return-routed-experts (vLLM needs its V2 model runner for it: VLLM_USE_V2_MODEL_RUNNER=1; "
            "trl-scale serve takes the same flag), or routing_replay=False"
        )
    mode = needs.weight_sync
    seed = needs.sampling.get("seed")
    if needs.streaming and seed is not None and str(report.device_type).lower() == "cpu":
        errors.append(
            f"{url}: vLLM on CPU, streaming rollout and seeded requests (generation_kwargs seed={seed}): vLLM 0.32's "
            "CPU worker dies resuming seeded requests that a sync's prefix-cache reset preempted ('CPU Generator does "
            "not use offset'). Fix: drop the seed from generation_kwargs (the trainer's seed still fixes its data "
            "order and initialisation), or async_rollout_mode='ordered'"
        )
    if mode in ("auto", "nccl", "shared_dir") and not report.dev_mode:
        errors.append(
            f"{url}: vLLM's RL routes are off, so weight_sync={mode!r} cannot update its weights. Fix: {DEV_MODE_FIX}"
        )
    if mode == "nccl" and report.dev_mode and report.weight_transfer is None:
        errors.append(
            f"{url}: no weight-transfer engine (weight_sync='nccl'). Fix: start it with --weight-transfer-config "
            '\'{"backend":"nccl"}\' (CUDA trainer), or \'{"backend":"trl_scale_gloo"}\' with trl-scale\'s vLLM '
            "plugin (CPU trainer), or use weight_sync='shared_dir'"
        )
    if mode == "lora":
        _lora_problems(report, needs, errors, warnings)
    if needs.max_completion_length is not None and report.max_model_len is not None:
        if report.max_model_len <= needs.max_completion_length:
            errors.append(
                f"{url}: --max-model-len {report.max_model_len} leaves no room for a prompt with "
                f"max_completion_length={needs.max_completion_length}. Fix: raise its --max-model-len, or lower "
                "max_completion_length"
            )
    _sampling_problems(report, needs, errors, warnings)
    return errors, warnings


def all_problems(reports: list[ServerReport], needs: RunNeeds) -> tuple[list[str], list[str]]:
    """(errors, warnings) over every server, in server order."""
    errors, warnings = [], []
    for report in reports:
        found, cautions = problems_of(report, needs)
        errors += found
        warnings += cautions
    return errors, warnings


def inspect_all(get, post, urls: list[str]) -> list[ServerReport]:
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        return list(pool.map(lambda url: inspect_server(get, post, url), urls))


def check_vocabulary(client_complete: Callable, report: ServerReport, vocab_size: int) -> str | None:
    """A prompt of the policy's last token id: a server whose model has a smaller vocabulary refuses it (400), so
    it serves some other model. Returns the problem, or None."""
    try:
        client_complete(report.url, report.model, [vocab_size - 1])
    except requests.HTTPError as error:
        if error.response is not None and error.response.status_code == 400:
            return (
                f"{report.url}: serves {report.model!r}, whose vocabulary is smaller than the policy's ({vocab_size} "
                "tokens): it is not the policy's model. Fix: start it with --model <the policy's path>"
            )
    except requests.RequestException:
        return None  # a failing request is the router's business, not the model's
    return None


def check_tokenizer(prompt_ids: Callable, report: ServerReport, tokenizer) -> str | None:
    """The server encodes a probe text of this tokenizer's own words as this tokenizer does, or it serves a model
    with another tokenizer: its completions would decode to other words (a reward of 0, silently). Returns the
    problem, or None (also where the server does not report prompt ids)."""
    pieces = [tokenizer.decode([i]) for i in range(min(len(tokenizer), 50_000))]
    words = [p.strip() for p in pieces if len(p.strip()) >= 3 and p.strip().isascii() and p.strip().isalpha()]
    text = " ".join(words[:: max(1, len(words) // 12)][:12]) or "the quick brown fox"
    ours = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        theirs = prompt_ids(report.url, report.model, text)
    except requests.RequestException:
        return None  # a failing request is the router's business, not the tokenizer's
    if theirs is None or list(theirs) == list(ours):
        return None
    return (
        f"{report.url}: serves {report.model!r}, whose tokenizer encodes {text!r} as {list(theirs)[:8]}, this "
        f"tokenizer as {ours[:8]}: the completions would decode to other words. Fix: pass the tokenizer of the "
        "model the servers run (--tokenizer), or start them with that model"
    )


def format_table(reports: list[ServerReport]) -> str:
    rows = [r.row() for r in reports]
    columns = list(rows[0]) if rows else []
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)
