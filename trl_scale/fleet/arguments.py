"""The managed fleet's config fields (GRPO, RLOO, PPO), mixed into the online trainers' configs beside server
rollout's (`rollout.arguments`): how many vLLM servers a run starts, with what, where, and how they are supervised."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..model_paths import check_model_path
from ..numbers import check_field_types, check_positive, check_whole, dict_field


@dataclass
class ManagedServerArguments:
    """Config fields of the managed fleet: trl-scale starts, supervises and stops the rollout servers."""

    FIELDS_DOC = """
    > Managed servers (trl-scale starts and supervises them)

    managed_servers (`int`, defaults to `0`): vLLM servers this run starts (with `use_vllm=True,
        vllm_mode="server"`), supervises (an exited server is restarted and re-synced) and stops on every exit path.
        Added to any `vllm_server_base_urls`.
    managed_server_model (`str` or `None`): what they load; `None`: the policy's path.
    managed_server_args (`list[str]` or `str` or `None`): extra `vllm serve` arguments, e.g.
        `["--max-model-len", "4096", "--gpu-memory-utilization", "0.8"]`.
    managed_server_env (`dict` or `None`): extra environment variables for the servers.
    managed_server_python (`str` or `None`): the Python that has vLLM (a separate environment is normal);
        `None`: this one.
    managed_server_gpus (`int` or `None`): GPUs per server (tensor parallel when > 1); `None`: 1 where CUDA is
        available, else 0 (vLLM's CPU build).
    managed_server_gpu_ids (`list[int]` or `None`): `"local"` placement: the GPUs to hand out, server i taking the
        i-th slice (by `CUDA_VISIBLE_DEVICES`); needed when the servers use GPUs.
    managed_server_placement (`str`, defaults to `"local"`): `"local"` (subprocesses of the main process) or
        `"ray"` (one Ray actor per server in a placement group, on the cluster of `ray_address`).
    managed_server_resources (`dict` or `None`): `"ray"` placement: each server's bundle beyond its GPUs, e.g.
        `{"CPU": 4, "node_a": 1}` (custom resources pin servers to nodes); default `{"CPU": 1}`.
    managed_server_max_restarts (`int`, defaults to `3`), managed_server_ready_timeout (`float`, defaults to
        `900`): restarts per server before it is given up; seconds a server may take to answer `/health`.
"""  # its section of each config's docstring (`config_docstring`)

    managed_servers: int = field(
        default=0,
        metadata={
            "help": "vLLM servers this run starts, supervises (an exited one is restarted and re-synced) and stops "
            "on every exit path; needs use_vllm=True and vllm_mode='server'. Added to vllm_server_base_urls."
        },
    )
    managed_server_model: str | None = field(
        default=None, metadata={"help": "What the managed servers load; None: the policy's path."}
    )
    managed_server_args: list[str] | None = field(
        default=None,
        metadata={
            "help": "Extra `vllm serve` arguments for the managed servers (a list, or one shell-quoted string)."
        },
    )
    managed_server_env: dict | str | None = field(
        default=None, metadata={"help": "Extra environment variables for the managed servers."}
    )
    managed_server_python: str | None = field(
        default=None,
        metadata={"help": "The Python that runs vLLM (e.g. another virtual environment's); None: this one."},
    )
    managed_server_gpus: int | None = field(
        default=None,
        metadata={"help": "GPUs per managed server (tensor parallel when > 1); None: 1 with CUDA, else 0 (CPU)."},
    )
    managed_server_gpu_ids: list[int] | None = field(
        default=None,
        metadata={"help": "Local placement: GPU ids to hand out in order, managed_server_gpus per server."},
    )
    managed_server_placement: Literal["local", "ray"] = field(
        default="local",
        metadata={"help": "'local' (subprocesses of the main process) or 'ray' (Ray actors in a placement group)."},
    )
    managed_server_resources: dict | str | None = field(
        default=None,
        metadata={
            "help": "Ray placement: each server's bundle beyond its GPUs, e.g. {'CPU': 4, 'node_a': 1}; default "
            "{'CPU': 1}."
        },
    )
    managed_server_max_restarts: int = field(
        default=3, metadata={"help": "Restarts per managed server before it is given up."}
    )
    managed_server_ready_timeout: float = field(
        default=900.0, metadata={"help": "Seconds a managed server may take to answer /health (start or restart)."}
    )

    def __post_init__(self):
        super().__post_init__()
        self._validate_managed_servers()
        check_field_types(self, ManagedServerArguments)

    def _validate_managed_servers(self) -> None:
        import shlex

        count = self.managed_servers
        check_whole("managed_servers", count, fix="use a whole number of servers (0: none)")
        if isinstance(self.managed_server_args, str):
            try:
                self.managed_server_args = shlex.split(self.managed_server_args)
            except ValueError as error:
                raise ValueError(
                    f"managed_server_args={self.managed_server_args!r} is not a shell-quoted command line ({error}). "
                    "Fix: close the quote, or give a list of arguments, e.g. ['--max-model-len', '4096']"
                ) from error
        env = dict_field(self.managed_server_env, "managed_server_env")
        if env is not None and not all(
            isinstance(key, str) and isinstance(v, (str, int, float)) for key, v in env.items()
        ):
            raise ValueError(
                f"managed_server_env={env!r}: use a dict of environment variable names to values, e.g. "
                "{'VLLM_CPU_KVCACHE_SPACE': '4'}"
            )
        self.managed_server_env = env
        check_model_path(self.managed_server_model, "managed_server_model")
        check_whole("managed_server_max_restarts", self.managed_server_max_restarts)
        check_positive("managed_server_ready_timeout", self.managed_server_ready_timeout)
        if not count:
            return
        if not (getattr(self, "use_vllm", False) and getattr(self, "vllm_mode", None) == "server"):
            raise ValueError(
                f"managed_servers={count} starts vLLM servers for server rollout. Fix: set use_vllm=True and "
                "vllm_mode='server' too (or managed_servers=0)"
            )
        if self.managed_server_placement not in ("local", "ray"):
            raise ValueError(f"managed_server_placement={self.managed_server_placement!r}: use 'local' or 'ray'")
        gpus = self.managed_server_gpus
        check_whole("managed_server_gpus", gpus, optional=True, fix="use a whole number of GPUs per server (0: CPU)")
        ids = self.managed_server_gpu_ids
        for gpu in ids or []:
            check_whole("managed_server_gpu_ids entry", gpu, fix="use GPU ids, whole numbers >= 0, e.g. [4, 5]")
        if ids is not None and self.managed_server_placement == "local":
            needed = count * (gpus if gpus is not None else 1)
            if len(ids) < needed or len(set(ids)) != len(ids):
                raise ValueError(
                    f"managed_server_gpu_ids={ids} gives {len(set(ids))} distinct GPUs; {count} server(s) x "
                    f"{gpus if gpus is not None else 1} GPU(s) need {needed}. Fix: list {needed} distinct GPU ids, "
                    "or lower managed_servers / managed_server_gpus"
                )
        self._validate_server_placement()

    def _validate_server_placement(self) -> None:
        """managed_server_placement='ray' and its resources (Ray importable, amounts per server)."""
        if self.managed_server_placement == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ImportError(
                    "managed_server_placement='ray' needs Ray. Fix: pip install 'trl-scale[ray]', or use 'local'"
                )
            if isinstance(self.managed_server_resources, str):  # the command line gives a JSON object as text
                self.managed_server_resources = dict_field(self.managed_server_resources, "managed_server_resources")
            resources = self.managed_server_resources or {}
            bad = {
                k: v for k, v in resources.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
            }
            if not isinstance(resources, dict) or bad or "GPU" in resources:
                raise ValueError(
                    f"managed_server_resources={self.managed_server_resources!r}: a dict of Ray resources per server "
                    "with amounts >= 0, e.g. {'CPU': 4, 'node_a': 1}; GPUs come from managed_server_gpus"
                )
        elif self.managed_server_resources is not None:
            raise ValueError(
                "managed_server_resources places servers on a Ray cluster: set managed_server_placement='ray' too"
            )
