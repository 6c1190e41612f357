"""What every trl-scale trainer shares: its tag, the scoring-engine config fields, and their wiring."""

from __future__ import annotations

import functools
import inspect
import os
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.utils import logging

from ..distributed.roles import RayReference, start_reference
from ..model_paths import check_model_path
from ..scoring import PackingStats, install_packed_scoring
from .reward_checks import checked_reward_funcs

TRL_SCALE_TAG = "trl-scale"
ROLLOUT_BUFFER_NAME = "rollout_buffer_rank{rank}.pt"
logger = logging.get_logger(__name__)

# TRL 1.16 reads `model.is_gradient_checkpointing`, which transformers 5.17 deprecates: a FutureWarning on every run
# that no user setting causes or silences (stock TRL prints it too).
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def config_docstring(method: str, *sections) -> str:
    """A trl-scale config's docstring, TRL's style: the header, then each field mixin's section (one text per
    field, whichever configs carry it)."""
    header = (
        f"\n    Configuration class for [`trl_scale.{method}Trainer`]: every field of [`trl.{method}Config`], "
        "unchanged, plus trl-scale's.\n"
    )
    return header + "".join(section.FIELDS_DOC for section in sections)


@contextmanager
def overridden(config, **values):
    """Set `config` fields while TRL's constructor reads them, and restore them afterwards, even on error."""
    if config is None:
        yield
        return
    saved = {name: getattr(config, name) for name in values}
    for name, value in values.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@dataclass
class ScoringArguments:
    """Config fields of the packed scoring engine, shared by GRPO, RLOO, DPO (and PPO) configs."""

    FIELDS_DOC = """
    > Packed scoring (remove-padding + chunked log-prob head)

    padding_free (`bool` or `None`, defaults to `None`):
        Score only real tokens, packed into rows with `position_ids` restarting per sequence. `None` packs where a
        one-off probe of the model finds packing exact, and otherwise runs TRL's padded path with one warning;
        `True` makes an inexact model an error; `False` runs TRL's padded path and gives TRL's numbers exactly.
    token_budget (`int` or `None`, defaults to `None`):
        Most real tokens in one packed forward; larger batches are split into balanced micro-batches, the same
        number on every data-parallel rank. `None` is automatic: sdpa/eager (dense attention) get rows no wider
        than the longest sequence, all in one forward; flash kernels one packed row.
    logprob_chunk_size (`int`, defaults to `256`):
        Tokens projected onto the vocabulary at once by trl-scale's chunked head (non-Triton devices).
"""  # its section of each config's docstring (`config_docstring`)

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Score only real tokens: pack each scoring batch's sequences into rows with position_ids "
            "restarting per sequence (no attention mask, no KV cache) and project only labelled tokens through "
            "the chunked log-prob head. None (default): pack where a one-off probe finds it exact for the model, "
            "else TRL's padded path with a warning. True: the same, but an inexact model is an error. False: TRL's "
            "padded path unchanged, with identical numbers."
        },
    )
    token_budget: int | None = field(
        default=None,
        metadata={
            "help": "Most real tokens in one packed forward (micro-batch); a batch with more is split into several, "
            "balanced, and every data-parallel rank runs the same number. A sequence longer than the budget gets a "
            "micro-batch of its own. None (automatic): with sdpa/eager the sequences are laid in rows no wider than "
            "the longest one (attention then costs no more than the padded batch's), all in one forward; with flash "
            "kernels each call is one packed row."
        },
    )
    logprob_chunk_size: int = field(
        default=256,
        metadata={
            "help": "Tokens projected onto the vocabulary at once by trl-scale's chunked log-prob head (CPU and "
            "other non-Triton devices); peak head memory is about 2 x chunk x vocab x 4 bytes plus the weight "
            "gradient. On CUDA/XPU with Triton, TRL's own kernel runs with its own tiling."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_scoring_arguments()

    def _validate_scoring_arguments(self) -> None:
        if self.token_budget is not None and (
            isinstance(self.token_budget, bool) or not isinstance(self.token_budget, int) or self.token_budget < 1
        ):
            raise ValueError(
                f"token_budget={self.token_budget!r}: use a positive number of tokens, or None for no limit"
            )
        if not isinstance(self.logprob_chunk_size, int) or self.logprob_chunk_size < 1:
            raise ValueError(
                f"logprob_chunk_size={self.logprob_chunk_size!r}: use a positive number of tokens (e.g. 256)"
            )


@dataclass
class RolloutArguments:
    """Config fields of server rollout (GRPO, RLOO, PPO): many completion servers, no vLLM in the trainer."""

    FIELDS_DOC = """
    > Server rollout (with `use_vllm=True, vllm_mode="server"`)

    vllm_server_base_urls (`list[str]` or `None`):
        Completion servers (vLLM or `trl-scale serve`), routed by least outstanding work, with failover.
    weight_sync (`str`, defaults to `"auto"`), weight_sync_dir (`str` or `None`):
        `"nccl"` (one weight-transfer group over every server, vLLM's `/update_weights` route; NCCL needs vLLM and
        CUDA in the trainer, `trl-scale serve` offers gloo), `"shared_dir"` (safetensors in a directory the servers
        read, then vLLM's `/collective_rpc reload_weights`), `"lora"` (adapter loading), or `"auto"`: `"nccl"` when
        every server offers a weight-transfer engine this trainer can drive, else `"shared_dir"`.
    weight_sync_timeout (`float`, defaults to `120`), weight_load_timeout (`float`, defaults to `900`):
        Seconds for a weight sync's control calls and each broadcast collective; seconds a server may take to
        receive or load the weights (`/update_weights`, `/collective_rpc reload_weights`, a LoRA load).
    rollout_request_timeout (`float`, defaults to `120`), rollout_generation_timeout (`float` or `None`):
        Seconds a request may wait for a server to take it (a free slot, failovers); seconds one server may take to
        generate it, `None` meaning `120 + 0.25 × max_completion_length` (1144 s for 4096 tokens).
    rollout_api_key (`str` or `None`): bearer token for the servers.
    async_rollout_staleness (`int`, defaults to `0`):
        0: generate each batch when it is needed (synchronous, TRL's behaviour). k ≥ 1: the servers generate the
        next k generation batches while the trainer trains; no completion is trained on more than k weight syncs
        after the weights it was sampled from, and TRL's vLLM importance-sampling correction (GRPO, PPO) corrects
        the off-policy gap. A sync happens once per generation batch, so with `steps_per_generation` × epochs
        optimizer steps per batch, k syncs are k × that many optimizer steps. Needs
        `vllm_importance_sampling_correction=True`; RLOO, which TRL gives no such correction, refuses it.
"""  # its section of each config's docstring (`config_docstring`)

    vllm_server_base_urls: list[str] | None = field(
        default=None,
        metadata={
            "help": "With use_vllm=True and vllm_mode='server': the completion servers (vLLM or `trl-scale serve`). "
            "Requests are routed by load and observed speed; a failing server leaves the rotation and is probed "
            "again later. TRL's single vllm_server_base_url keeps working."
        },
    )
    weight_sync: str = field(
        default="auto",
        metadata={
            "help": "How weights reach the servers: 'nccl' (a weight-transfer group over every server: vLLM's NCCL "
            "engine, which needs vLLM and CUDA here, or trl-scale serve's gloo engine), 'shared_dir' (safetensors in "
            "weight_sync_dir, reloaded with vLLM's /collective_rpc reload_weights), 'lora' (an adapter per sync), or "
            "'auto' ('nccl' where every server offers an engine this trainer can drive, else 'shared_dir')."
        },
    )
    weight_sync_dir: str | None = field(
        default=None, metadata={"help": "Directory the servers can read, for weight_sync='shared_dir' or 'lora'."}
    )
    weight_sync_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds a weight sync's control calls and each broadcast collective may take."},
    )
    weight_load_timeout: float = field(
        default=900.0,
        metadata={
            "help": "Seconds a server may take to receive or load the weights of one sync (/update_weights, "
            "/collective_rpc reload_weights, /v1/load_lora_adapter): large models need minutes."
        },
    )
    rollout_request_timeout: float = field(
        default=120.0,
        metadata={"help": "Seconds a completion request may wait for a server to take it (free slot, failovers)."},
    )
    rollout_generation_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one server may take to generate one request (a prompt's completions). None: "
            "120 + 0.25 x max_completion_length (a 4096-token completion gets 1144 s)."
        },
    )
    rollout_api_key: str | None = field(default=None, metadata={"help": "Bearer token for the servers."})
    async_rollout_staleness: int = field(
        default=0,
        metadata={
            "help": "0: synchronous rollout. k >= 1: the servers generate the next k generation batches while the "
            "trainer trains; a completion is trained on at most k weight syncs after the weights it was sampled from "
            "(one sync per generation batch: k x steps_per_generation x epochs optimizer steps), importance-sampling "
            "corrected (GRPO, PPO; RLOO refuses it)."
        },
    )
    rollout_max_inflight_per_server: int = field(
        default=8,
        metadata={
            "help": "Requests in flight per server (one request = one prompt's num_generations completions); more "
            "wait in the client for the first server to free up (load-aware routing). Raise it for vLLM servers "
            "that batch many requests."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_rollout_arguments()

    def _validate_rollout_arguments(self) -> None:
        if self.vllm_server_base_urls is not None:
            from urllib.parse import urlparse

            seen = {}
            for url in self.vllm_server_base_urls:
                parsed = urlparse(str(url))
                if parsed.scheme not in ("http", "https") or not parsed.hostname:
                    raise ValueError(
                        f"vllm_server_base_urls entry {url!r} is not a server URL. Fix: use http://HOST:PORT (e.g. "
                        "http://10.0.0.5:8000), one entry per server"
                    )
                # one loopback host however it is spelled, and the scheme's default port made explicit
                host = "loopback" if parsed.hostname in ("localhost", "127.0.0.1", "::1") else parsed.hostname
                port = parsed.port or {"http": 80, "https": 443}[parsed.scheme]
                key = (parsed.scheme, host, port, parsed.path.rstrip("/"))
                if key in seen:
                    raise ValueError(
                        f"vllm_server_base_urls lists the same server twice ({seen[key]!r} and {url!r}): it would get "
                        "double the work and every weight sync twice. Fix: list each server once"
                    )
                seen[key] = url
        if self.async_rollout_staleness < 0:
            raise ValueError(f"async_rollout_staleness={self.async_rollout_staleness}: use 0 (synchronous) or k >= 1")
        if self.async_rollout_staleness and not (
            getattr(self, "use_vllm", False) and getattr(self, "vllm_mode", None) == "server"
        ):
            raise ValueError(
                "async_rollout_staleness > 0 overlaps server generation with training: it needs use_vllm=True, "
                "vllm_mode='server' and vllm_server_base_urls. Fix: set those, or async_rollout_staleness=0"
            )
        if self.weight_sync == "http":
            raise ValueError(
                "weight_sync='http' is gone: no vLLM route takes weights in a request body (its /update_weights takes "
                "JSON metadata and a broadcast). Fix: weight_sync='auto' (default), 'nccl', 'shared_dir' or 'lora'"
            )
        if self.weight_sync not in ("auto", "nccl", "shared_dir", "lora"):
            raise ValueError(f"weight_sync={self.weight_sync!r}: use 'auto', 'nccl', 'shared_dir' or 'lora'")
        for name in (
            "weight_sync_timeout",
            "weight_load_timeout",
            "rollout_request_timeout",
            "rollout_generation_timeout",
            "vllm_server_timeout",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name}={value!r}: use a positive number of seconds")
        inflight = self.rollout_max_inflight_per_server
        if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 1:
            raise ValueError(
                f"rollout_max_inflight_per_server={inflight!r}: use a positive whole number of requests (default 8); "
                "with 0 no request could ever be sent"
            )
        if self.async_rollout_staleness:
            if not hasattr(self, "vllm_importance_sampling_correction"):  # RLOO
                raise ValueError(
                    f"async_rollout_staleness={self.async_rollout_staleness}: RLOO trains prefetched (stale) "
                    "completions with no off-policy correction (TRL's RLOO recomputes its old log-probs with the "
                    "current weights, so its ratio starts at 1). Fix: async_rollout_staleness=0, or GRPOTrainer / "
                    "PPOTrainer, whose vLLM importance-sampling correction covers it"
                )
            if not self.vllm_importance_sampling_correction:
                raise ValueError(
                    f"async_rollout_staleness={self.async_rollout_staleness} trains completions sampled from older "
                    "weights; with vllm_importance_sampling_correction=False nothing corrects for it. Fix: "
                    "vllm_importance_sampling_correction=True (default), or async_rollout_staleness=0"
                )


@dataclass
class DistributedArguments:
    """Where the reward models (and PPO's critic) live: in the trainer processes, or on Ray role groups."""

    FIELDS_DOC = """
    > Placement (`pip install trl-scale[ray]`)

    backend (`str`, defaults to `"local"`): `"ray"` puts reward models (and PPO's critic) on Ray role groups,
        started and called by the main trainer process for every rank.
    ray_address (`str` or `None`): a Ray cluster; `None` starts a local one.
    reward_placement, critic_placement, reference_placement (`dict` or `None`):
        `{"num_workers": 1, "num_gpus_per_worker": 1.0, "num_cpus_per_worker": 1}` per role. The reference goes to
        its own group only when `reference_placement` is given (and `beta != 0`, no PEFT). `critic_placement` also
        takes `"sharding"`: `"fsdp2"` (default; with several workers each holds 1/num_workers of the critic's
        parameters, gradients and AdamW state) or `"replicated"`.
    ray_call_timeout (`float`, defaults to `300`): bound on every call to a Ray worker.
"""  # its section of each config's docstring (`config_docstring`)

    backend: str = field(
        default="local",
        metadata={"help": "'local' (in the trainer processes) or 'ray' (reward models and the critic on Ray groups)."},
    )
    ray_address: str | None = field(default=None, metadata={"help": "Ray cluster address; None starts a local one."})
    reward_placement: dict | None = field(
        default=None,
        metadata={"help": "Reward group: {'num_workers': 1, 'num_gpus_per_worker': 1.0, 'num_cpus_per_worker': 1}."},
    )
    critic_placement: dict | None = field(
        default=None,
        metadata={
            "help": "Critic group (PPO), same keys as reward_placement, plus 'sharding': 'fsdp2' (default: the "
            "critic sharded across its workers) or 'replicated'."
        },
    )
    reference_placement: dict | None = field(
        default=None,
        metadata={
            "help": "Reference model group, same keys as reward_placement. None keeps the reference in the trainer "
            "processes (as TRL does); unused with a PEFT policy, whose reference is its disabled adapter."
        },
    )
    ray_call_timeout: float = field(
        default=300.0, metadata={"help": "Seconds any call to a Ray worker may take before a RoleError."}
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_distributed_arguments()

    def _validate_distributed_arguments(self) -> None:
        if self.backend not in ("local", "ray"):
            raise ValueError(f"backend={self.backend!r}: use 'local' or 'ray'")
        if self.backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ImportError(
                    "backend='ray' needs Ray, which is not installed. Fix: pip install 'trl-scale[ray]' (or set "
                    "backend='local' to keep every model in the trainer processes)"
                )
            from ..distributed.ray_backend import Placement

            Placement.from_config(self.reward_placement, "reward_placement")
            Placement.from_config(self.critic_placement, "critic_placement")
            if self.reference_placement is not None:
                Placement.from_config(self.reference_placement, "reference_placement")
        elif self.reference_placement is not None:
            raise ValueError("reference_placement places the reference on a Ray group: set backend='ray' too")
        else:
            from ..distributed.ray_backend import Placement

            for name in ("reward_placement", "critic_placement"):
                if getattr(self, name, None) is not None:  # checked anyway: a typo must not wait for backend='ray'
                    Placement.from_config(getattr(self, name), name)
                    logger.warning(f"{name} is unused with backend='local': every model stays in the trainers")
        if self.reference_placement is not None and getattr(self, "sync_ref_model", False):
            raise ValueError(
                "sync_ref_model=True is not supported with reference_placement (the reference lives on a Ray group); "
                "set sync_ref_model=False or reference_placement=None"
            )


def trl_arguments(trainer, args: tuple, kwargs: dict) -> dict:
    """A trl-scale trainer's constructor arguments by name, bound to the signature of the TRL trainer it extends
    (positional or keyword, TRL's defaults applied), so every call TRL accepts is accepted and passed on unchanged."""
    trl_class = next(c for c in type(trainer).__mro__ if c.__module__.startswith("trl."))
    bound = inspect.signature(trl_class.__init__).bind(trainer, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(arguments)))  # self
    return arguments


def check_output_dir(config) -> None:
    """Fail at construction, not at the first checkpoint an hour in, when `output_dir` cannot be written."""
    if config is None or not getattr(config, "output_dir", None):
        return
    path = config.output_dir
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".trl-scale-write-check-{os.getpid()}")
        with open(probe, "w") as handle:
            handle.write("ok")
        os.remove(probe)
    except OSError as error:
        raise ValueError(
            f"output_dir={path!r} is not writable ({type(error).__name__}: {error}). Fix: set output_dir to a "
            "directory this process can create and write (checkpoints, the model and its card go there)."
        ) from error


def check_model_arguments(arguments: dict) -> None:
    """The model, reference and reward-model paths of a trainer's arguments, each checked where it names a local
    directory that does not exist (:func:`..model_paths.check_model_path`)."""
    for name in ("model", "ref_model", "value_model"):
        check_model_path(arguments.get(name), name)
    rewards = arguments.get("reward_funcs")
    for index, reward in enumerate(rewards if isinstance(rewards, list) else [rewards]):
        check_model_path(reward, "reward_funcs" if not isinstance(rewards, list) else f"reward_funcs[{index}]")


def check_train_dataset(dataset, required: tuple[str, ...], trainer: str) -> None:
    """Fail at construction when the training data cannot work: no rows, or a column the trainer reads is missing."""
    if dataset is None:
        return
    try:
        size = len(dataset)
    except TypeError:  # an IterableDataset: no length to check
        size = None
    if size == 0:
        raise ValueError(f"train_dataset is empty: {trainer} has nothing to train on. Fix: pass a dataset with rows")
    columns = getattr(dataset, "column_names", None)
    if columns is None or isinstance(columns, dict):  # unknown (streaming) or a DatasetDict passed by mistake
        if isinstance(columns, dict):
            raise ValueError(
                f"train_dataset is a DatasetDict with splits {sorted(columns)}; pass one split, e.g. dataset['train']"
            )
        return
    missing = [name for name in required if name not in columns]
    if missing:
        raise ValueError(
            f"train_dataset has no column {missing[0]!r}, which {trainer} reads (columns: {columns}). Fix: rename "
            f"yours with dataset.rename_column(OLD, {missing[0]!r})"
        )


def image_columns(*datasets) -> list[str]:
    """The image columns TRL reads ("image", "images") found in these datasets (or dicts of eval datasets)."""
    found = set()
    for dataset in datasets:
        for part in dataset.values() if isinstance(dataset, dict) else [dataset]:
            found |= set(getattr(part, "column_names", None) or []) & {"image", "images"}
    return sorted(found)


def with_signature_of(trl_init):
    """Give a trl-scale constructor the signature of the TRL constructor it accepts (see `trl_arguments`), so
    `inspect.signature`, IDEs and `help()` show TRL's parameters."""

    def decorate(init):
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)

        __init__.__signature__ = inspect.signature(trl_init)
        return __init__

    return decorate


def remote_reward_funcs(reward_funcs, args):
    """With backend='ray', replace each reward model in `reward_funcs` (path or object) by a function served by
    the reward group; callables stay in the trainer."""
    if getattr(args, "backend", "local") != "ray" or reward_funcs is None:
        return reward_funcs
    from torch import nn

    from ..distributed.roles import start_reward_model

    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    return [start_reward_model(f, args) if isinstance(f, (str, nn.Module)) else f for f in funcs]


def _wants_remote_reference(args, model, peft_config) -> bool:
    """Whether the reference goes to its own Ray group: backend='ray', a reference_placement, a KL term that needs a
    reference, and no PEFT (a PEFT policy's reference is its disabled adapter, which costs no extra model)."""
    if getattr(args, "backend", "local") != "ray" or getattr(args, "reference_placement", None) is None:
        return False
    if args.beta == 0.0:
        return False
    from accelerate.utils import is_peft_model

    if peft_config is not None or (not isinstance(model, str) and is_peft_model(model)):
        logger.warning("reference_placement is unused: a PEFT policy's reference is the policy without its adapter")
        return False
    return True


def uses_server_rollout(args) -> bool:
    """trl-scale's client serves `use_vllm=True, vllm_mode='server'` when several servers are given, or when
    vLLM is not installed (TRL's own server mode needs vLLM importable and CUDA for its weight sync)."""
    if not (getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "server"):
        return False
    from trl.import_utils import is_vllm_available

    return bool(getattr(args, "vllm_server_base_urls", None)) or not is_vllm_available()


class ServerRolloutMixin:
    """Plugs the multi-server client in as TRL's `vllm_generation` (the trainer was built with TRL's vLLM off)."""

    def _install_server_rollout(self, logprobs: bool) -> None:
        from ..rollout import RolloutClient, ServerRolloutGeneration

        args = self.args
        urls = args.vllm_server_base_urls or [
            args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        ]
        generation_timeout = args.rollout_generation_timeout or 120.0 + 0.25 * args.max_completion_length
        client = RolloutClient(
            urls,
            request_timeout=args.rollout_request_timeout,
            api_key=args.rollout_api_key,
            max_inflight_per_server=args.rollout_max_inflight_per_server,
            generation_timeout=generation_timeout,
            load_timeout=args.weight_load_timeout,
        )
        correction = bool(getattr(self, "vllm_importance_sampling_correction", False))  # GRPO, PPO; not RLOO
        self.vllm_generation = ServerRolloutGeneration(
            self,
            client,
            weight_sync=args.weight_sync,
            weight_sync_dir=args.weight_sync_dir,
            weight_sync_timeout=args.weight_sync_timeout,
            ready_timeout=args.vllm_server_timeout,
            logprobs=logprobs and hasattr(self, "vllm_importance_sampling_correction"),  # as TRL: GRPO asks, RLOO not
            require_logprobs=correction,
        )
        self.use_vllm = True
        self.vllm_mode = "server"
        self._last_loaded_step = -1
        if args.async_rollout_staleness:
            if getattr(self, "rollout_func", None) is not None or getattr(self, "tools", None):
                raise ValueError(
                    "async_rollout_staleness > 0 prefetches plain prompt -> completion generations; this trainer has "
                    "a rollout_func or tools (multi-turn rollouts). Fix: async_rollout_staleness=0"
                )
            self.vllm_generation.enable_async(
                args.async_rollout_staleness, lambda prompts: self._tokenize_prompts(prompts)[0]
            )
            self._lookahead = None

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # no full copy of the model left in /tmp after a run, however it ended
            remove = getattr(getattr(self, "vllm_generation", None), "remove_temporary_weights", None)
            if remove is not None:
                remove()

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """With async rollout, the epoch's batch iterator is read ahead so upcoming generation batches are known
        (also after `skip_first_batches` on resume: whatever iterator the epoch uses is wrapped)."""
        prefetcher = getattr(getattr(self, "vllm_generation", None), "prefetcher", None)
        if prefetcher is not None:
            from ..rollout.async_rollout import LookaheadIterator

            if self._lookahead is None or self._lookahead.source is not epoch_iterator:
                every = self.args.steps_per_generation * self.num_iterations
                self._lookahead = LookaheadIterator(epoch_iterator, prefetcher, every)
            epoch_iterator = self._lookahead
        return super().get_batch_samples(epoch_iterator, num_batches, device)


class PackedScoringMixin:
    """Installs the packed scoring engine on the policy and reference forwards TRL patched, and logs its figures."""

    _packing_stats: PackingStats | None = None  # set while packing is installed and on
    _packing_installed: bool = False

    def _install_packed_scoring(
        self, temperature: float, policy_outputs: tuple[str, ...], padding_free: bool | None = None
    ) -> None:
        """Pack the policy's and the reference's scoring forwards (once; TRL's forwards where packing is off or
        not exact for the model)."""
        if self._packing_installed or padding_free is False:
            return
        self._packing_installed = True
        from peft import PeftModel

        stats = PackingStats()
        settings = dict(
            token_budget=self.args.token_budget,
            logprob_chunk_size=self.args.logprob_chunk_size,
            padding_free=padding_free,
            cast_lm_head_to_fp32=getattr(self.args, "cast_lm_head_to_fp32", False),  # GRPO/RLOO/PPO's head option
            temperature=temperature,
            stats=stats,
        )
        policy = self.accelerator.unwrap_model(self.model)
        if isinstance(policy, PeftModel):
            policy = policy.get_base_model()
        packed = install_packed_scoring(policy, outputs=policy_outputs, **settings)
        if getattr(self, "ref_model", None) is not None and not isinstance(self.ref_model, RayReference):
            install_packed_scoring(self.accelerator.unwrap_model(self.ref_model), outputs=(), **settings)
        self._packing_stats = stats if packed is not None else None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # training logs (not the final summary)
            if self._packing_stats is not None:
                logs.update(self._packing_stats.pop())
            # trl-scale callbacks add their figures here, before the Trainer hands `logs` to report_to integrations
            # (a callback's own on_log runs after those and could not reach them).
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "trl_scale_metrics"):
                    logs.update(callback.trl_scale_metrics(trainer=self, logs=logs))
        super().log(logs, start_time)


# transformers' `Trainer.create_model_card` kwargs that TRL 1.16's override rejects with TypeError.
_CARD_KWARGS = ("language", "license", "finetuned_from", "tasks", "dataset_tags", "dataset", "dataset_args")


class ModelCardMixin:
    """TRL's model card with trl-scale's tags (the method, the features used) and transformers' card kwargs
    (`language`, `license`, `finetuned_from`, ...), so `push_to_hub(license=...)` works as with any Trainer."""

    def _hub_error(self, action: str, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"{action} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Nothing "
            f"is lost: the model and checkpoints stay in output_dir={self.args.output_dir!r}. Fix: log in "
            "(`hf auth login`) or set HF_TOKEN with write access, check hub_model_id, then call "
            "trainer.push_to_hub() again"
        )

    def init_hf_repo(self, token: str | None = None, private: bool | None = None):
        # transformers' signature: `push_to_hub(private=...)` on a run configured with push_to_hub=False calls it so
        try:
            return super().init_hf_repo(token=token, private=private)
        except Exception as error:  # before any training: say why, and how to fix it
            raise self._hub_error("creating the Hub repo for push_to_hub=True", error) from error

    def push_to_hub(self, *args, **kwargs):
        try:
            return super().push_to_hub(*args, **kwargs)
        except Exception as error:
            # The push can fail before its own save (creating the repo): save here, so the message below holds.
            self.save_model(self.args.output_dir, _internal_call=True)
            raise self._hub_error("push_to_hub", error) from error

    def trl_scale_features(self) -> list[str]:
        features = []
        if getattr(self, "_packing_stats", None) is not None:
            features.append("padding-free")
        if getattr(self, "critic", None) is not None:
            features.append("value-model")
        if getattr(self.args, "backend", "local") == "ray":
            features.append("ray")
        return features

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs,
    ) -> None:
        unknown = set(kwargs) - set(_CARD_KWARGS)
        if unknown:
            raise TypeError(f"create_model_card got unexpected arguments {sorted(unknown)}; known: {_CARD_KWARGS}")
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags += [TRL_SCALE_TAG, *self.trl_scale_features()]
        dataset_name = dataset_name or kwargs.get("dataset")
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return

        from huggingface_hub import ModelCard

        path = os.path.join(self.args.output_dir, "README.md")
        if not os.path.exists(path):
            return
        card = ModelCard.load(path)
        if kwargs.get("language"):
            card.data.language = kwargs["language"]
        if kwargs.get("license"):
            card.data.license = kwargs["license"]
        if kwargs.get("finetuned_from"):
            card.data.base_model = kwargs["finetuned_from"]
        if kwargs.get("tasks"):
            card.data.pipeline_tag = kwargs["tasks"] if isinstance(kwargs["tasks"], str) else kwargs["tasks"][0]
        if kwargs.get("dataset_tags"):
            card.data.datasets = kwargs["dataset_tags"]
        features = ", ".join(self.trl_scale_features()) or "none"
        card.text += (
            "\n## trl-scale\n\nTrained with [trl-scale](https://github.com/trl-scale/trl-scale), TRL's trainers made "
            f"to scale. Features used: {features}.\n"
        )
        card.save(path)


def check_rollout_buffers(checkpoint: str, num_processes: int) -> None:
    """A checkpoint saved inside a rollout window holds one rollout buffer per process. Resumed on another number of
    processes, some ranks would have a buffer and others would generate, and TRL's cross-rank gathers would not
    match (a hang or wrong numbers): refuse it on every rank (each reads the same folder), naming the fixes."""
    import glob

    saved = len(glob.glob(os.path.join(checkpoint, ROLLOUT_BUFFER_NAME.format(rank="*"))))
    if saved and saved != num_processes:
        raise ValueError(
            f"{checkpoint} was saved inside a rollout window by {saved} process(es), with each one's rollout "
            f"({ROLLOUT_BUFFER_NAME.format(rank='N')}); this run has {num_processes}. Nothing was trained, and the "
            f"checkpoint is intact. Fix: resume with {saved} process(es) for an exact continuation, or delete the "
            f"{ROLLOUT_BUFFER_NAME.format(rank='*')} files in it to start a new rollout there (as TRL resumes; not "
            "exact), or resume from a checkpoint saved at a window boundary"
        )


class SafeCheckpointMixin:
    """A checkpoint save that fails (disk full, quota, a dropped network mount) removes its partial folder, so that
    `resume_from_checkpoint=True` picks the last complete checkpoint instead of a broken one, and says so."""

    def _save_checkpoint(self, model, trial):
        import shutil

        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        existed = os.path.isdir(folder)
        try:
            super()._save_checkpoint(model, trial)
        except OSError as error:
            if not existed and self.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
            raise OSError(
                error.errno,
                f"saving {folder} failed ({error.strerror or error}); the partial checkpoint was removed, and the "
                f"last complete one is {last or 'none'}. Fix: free space under {run_dir}, then train again with "
                "resume_from_checkpoint=True",
            ) from error


class PhaseTimingMixin:
    """Wall time per phase of an online step (generation, reward scoring, log-prob scoring), accumulated between
    logs and read by `trl_scale.callbacks.StepTimeCallback`."""

    @property
    def phase_seconds(self) -> dict[str, float]:
        if not hasattr(self, "_phase_seconds"):
            self._phase_seconds = defaultdict(float)
        return self._phase_seconds

    @contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] += time.perf_counter() - start

    def _generate(self, *args, **kwargs):
        with self._timed("generate"):
            return super()._generate(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        with self._timed("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        with self._timed("score"):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)


class OnlineTrainerMixin(
    SafeCheckpointMixin, ServerRolloutMixin, PhaseTimingMixin, ModelCardMixin, PackedScoringMixin
):
    """Everything trl-scale adds to TRL's online trainers (GRPO, RLOO, and PPO through GRPO), wired around TRL's
    constructor: remote reward models, server rollout, packed scoring, timing and model cards."""

    def _calculate_rewards(self, *args, **kwargs):
        rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        if not getattr(self, "_warned_no_rewards", False) and torch.isnan(rewards_per_func).all():
            # TRL trains on it with zero advantages and logs the reward as nan: a run that learns nothing, silently.
            self._warned_no_rewards = True
            if self.accelerator.is_main_process:
                logger.warning(
                    f"trl-scale: every reward function ({', '.join(self.reward_func_names)}) returned None or NaN for "
                    f"all {rewards_per_func.size(0)} completions of this batch: there is nothing to learn from (zero "
                    "advantages, no gradient), and the step trains on nothing. Fix: make at least one reward function "
                    "return a float for these completions (None means 'does not apply to this one'). Said once."
                )
        return rewards_per_func

    def __init__(self, *args, **kwargs):
        arguments = trl_arguments(self, args, kwargs)
        model, config = arguments["model"], arguments.get("args")
        check_output_dir(config)
        check_model_arguments(arguments)
        # TRL reads `prompt` unless an environment owns the data (its `reset()` then supplies the prompt).
        prompt_column = () if arguments.get("environment_factory") is not None else ("prompt",)
        check_train_dataset(arguments.get("train_dataset"), prompt_column, type(self).__name__)
        if config is not None and getattr(config, "weight_sync", None) == "lora" and uses_server_rollout(config):
            from accelerate.utils import is_peft_model

            if arguments.get("peft_config") is None and not (not isinstance(model, str) and is_peft_model(model)):
                raise ValueError(
                    "weight_sync='lora' sends only a LoRA adapter to the servers, but this policy has none. Fix: pass "
                    "peft_config=LoraConfig(...) (or a PeftModel), or use weight_sync='nccl' / 'shared_dir' (full "
                    "weights)"
                )
        reward_funcs = remote_reward_funcs(arguments.get("reward_funcs"), config)
        arguments["reward_funcs"] = checked_reward_funcs(reward_funcs)
        server = config is not None and uses_server_rollout(config)
        remote_reference = _wants_remote_reference(config, model, arguments.get("peft_config"))
        images = image_columns(arguments.get("train_dataset"), arguments.get("eval_dataset"))
        if remote_reference and images:
            raise ValueError(
                f"this dataset has image columns {images}, and reference_placement puts the reference model on a Ray "
                "group that scores token rows only: its KL would ignore the images. Fix: reference_placement=None "
                "(the reference stays in the trainer and gets the images, as in TRL)"
            )
        # With server rollout, TRL's vLLM path stays off while it builds: no vLLM import, no CUDA-only communicator.
        # With a remote reference, TRL builds none (beta=0 while it builds) and the reference group stands in.
        with (
            overridden(config if server else None, use_vllm=False),
            overridden(config if remote_reference else None, beta=0.0),
        ):
            super().__init__(**arguments)
        self._check_completion_length()
        if server:
            self._install_server_rollout(logprobs=True)
        self._install_packed_scoring(self.temperature, ("entropy",), self.args.padding_free)
        if remote_reference:
            self.beta = config.beta
            self.ref_model = self._start_remote_reference()

    # ---- lengths the model can take -----------------------------------------------------------------------

    def _context_length(self) -> int | None:
        config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        return getattr(config, "max_position_embeddings", None)

    def _check_completion_length(self) -> None:
        context = self._context_length()
        if context is not None and self.args.max_completion_length >= context:
            raise ValueError(
                f"max_completion_length={self.args.max_completion_length} leaves no room for a prompt in this model's "
                f"context of {context} tokens (max_position_embeddings). Fix: lower max_completion_length"
            )

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenization, then a check that every prompt plus `max_completion_length` fits the model's context:
        past it, positions the model never learned (or an index error, with learned positions) would train
        silently on garbage."""
        prompt_ids, *rest = super()._tokenize_prompts(prompts)
        limits = [(self._context_length(), "the model's context", "max_position_embeddings")]
        served = getattr(getattr(self, "vllm_generation", None), "server_max_model_len", None)
        if served is not None:  # vLLM would answer 400 for the whole batch
            limits.append((served, "the rollout servers' context", "their --max-model-len"))
        limits = [limit for limit in limits if limit[0] is not None]
        if limits:
            context, what, source = min(limits)
            for index, ids in enumerate(prompt_ids):
                if len(ids) + self.args.max_completion_length > context:
                    raise ValueError(
                        f"prompt {index} of this batch has {len(ids)} tokens; with max_completion_length="
                        f"{self.args.max_completion_length} that exceeds {what} of {context} tokens ({source}). "
                        "Nothing was trained on it, and earlier checkpoints are intact. Fix: drop or shorten long "
                        "prompts (dataset.filter on their token count, at most "
                        f"{context - self.args.max_completion_length}), or lower max_completion_length"
                    )
        return (prompt_ids, *rest)

    # ---- exact resume inside a rollout ------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Also save the rollout being trained on (every rank its own): a checkpoint inside a generation window
        (`steps_per_generation` x `num_iterations` > 1, or PPO's epochs x mini-batches) then resumes on the same
        rollout, where TRL would sample a new one and diverge from the uninterrupted run."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self._buffered_inputs is not None:
            import torch

            # Ranks other than the main one get here while it may still be writing the model: the folder it creates
            # may not exist yet (transformers' own per-rank RNG file makes it the same way).
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, ROLLOUT_BUFFER_NAME.format(rank=self.accelerator.process_index))
            torch.save({"step": self._step, "inputs": self._buffered_inputs}, path)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        check_rollout_buffers(checkpoint, self.accelerator.num_processes)
        path = os.path.join(checkpoint, ROLLOUT_BUFFER_NAME.format(rank=self.accelerator.process_index))
        if os.path.isfile(path):
            import torch

            # Our own file in our own checkpoint (tensors in lists and dicts), loaded as the Trainer loads RNG state.
            # Plain "cpu" for CPU runs: under DeepSpeed the device is "cpu:0", a location torch.load cannot restore.
            device = self.accelerator.device
            saved = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=False)
            self._step, self._buffered_inputs = saved["step"], saved["inputs"]

    def _start_remote_reference(self) -> RayReference:
        """The reference on its group, loaded as TRL would load it: from the policy's path, in the policy's dtype
        and attention implementation, scored with the same head (temperature, fp32 cast, packing)."""
        from trl.trainer.utils import get_config_model_id

        args = self.args
        init_kwargs = args.model_init_kwargs or {}
        dtype = init_kwargs.get("dtype", self.model.dtype)
        mixed = {"bf16": "bfloat16", "fp16": "float16"}.get(str(self.accelerator.mixed_precision))
        settings = dict(
            dtype=str(dtype).removeprefix("torch."),  # "auto" passes through, as TRL passes it
            attn_implementation=init_kwargs.get("attn_implementation", self.model.config._attn_implementation),
            temperature=self.temperature,
            cast_lm_head_to_fp32=getattr(args, "cast_lm_head_to_fp32", False),
            padding_free=args.padding_free,
            token_budget=args.token_budget,
            logprob_chunk_size=args.logprob_chunk_size,
            autocast_dtype=mixed,
        )
        model_path = get_config_model_id(self.accelerator.unwrap_model(self.model).config)
        return start_reference(model_path, settings, args)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if isinstance(model, RayReference):  # the reference on its Ray group (log-probs only, as TRL asks of it)
            return model.logps(input_ids, attention_mask, logits_to_keep), None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
