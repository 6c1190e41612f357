"""Which settings need which: one table, from which the run plan refuses a setting that nothing in the run would read.

A setting changed from its default while what reads it is off (`weight_sync` with local generation, `token_budget`
with `padding_free=False`) would be accepted and never acted on: the user believes it acts. Each row names the
setting, what it needs (in words, and as a test of the config and the trainer's arguments), the fix, and an example
of both (`example`, `meets`) from which one test tries every row. A setting's default is read from its config's own
dataclass field, never written here; a row is read only where its config has the setting, and every such config has
the fields its need reads (no read with a default). Settings a config does not have are skipped (DPO has no rollout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SettingNeed:
    setting: str
    needs: str  # what must be on for the setting to be read
    met: Callable[[object, dict], bool]  # (config, the trainer's arguments) -> is it on
    example: object  # a value other than the default (tests)
    meets: dict  # settings that turn the need on (tests)


def _server(config, arguments) -> bool:
    return config.use_vllm and config.vllm_mode == "server"  # as the plan's `uses_server_rollout`, on a rollout config


def _managed(config, arguments) -> bool:
    return (config.managed_servers or 0) > 0


def _evaluates(config, arguments) -> bool:
    """As `eval_pass_at_k`'s own check reads it (evaluation/arguments.py): scheduled, or `do_eval` for a user who
    calls the trainer's `evaluate()`; or an eval_dataset handed to the trainer's constructor."""
    strategy = config.eval_strategy
    scheduled = str(getattr(strategy, "value", strategy)) != "no"
    return scheduled or bool(config.do_eval) or arguments.get("eval_dataset") is not None


SERVER = "server rollout (use_vllm=True, vllm_mode='server')"
SERVER_ON = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_urls": ["http://127.0.0.1:1"]}
MANAGED = "managed servers (managed_servers >= 1)"
MANAGED_ON = {"use_vllm": True, "vllm_mode": "server", "managed_servers": 1}

SETTING_NEEDS: tuple[SettingNeed, ...] = (
    *(
        SettingNeed(name, SERVER, _server, value, SERVER_ON)
        for name, value in (
            ("rollout_mismatch_budget", 0.5),
            ("rollout_mismatch_action", "warn"),
            ("rollout_mismatch_prompts", 2),
        )
    ),
    SettingNeed(
        "vllm_server_base_urls", SERVER, _server, ["http://127.0.0.1:8000"], {"use_vllm": True, "vllm_mode": "server"}
    ),
    *(
        SettingNeed(name, SERVER, _server, value, SERVER_ON)
        for name, value in (
            ("weight_sync", "shared_dir"),
            ("weight_sync_dir", "/tmp/weights"),
            ("weight_sync_timeout", 30.0),
            ("weight_load_timeout", 60.0),
            ("rollout_request_timeout", 30.0),
            ("rollout_generation_timeout", 30.0),
            ("routing_replay", True),
        )
    ),
    *(
        SettingNeed(name, MANAGED, _managed, value, MANAGED_ON)
        for name, value in (
            ("managed_server_model", "org/model"),
            ("managed_server_args", ["--enforce-eager"]),
            ("managed_server_env", {"VLLM_CPU_KVCACHE_SPACE": "1"}),
            ("managed_server_python", "/usr/bin/python3"),
            ("managed_server_gpus", 0),
            ("managed_server_gpu_ids", [0]),
            ("managed_server_placement", "ray"),
            ("managed_server_max_restarts", 1),
            ("managed_server_ready_timeout", 60.0),
        )
    ),
    SettingNeed(  # (with managed servers, the config itself asks for placement "ray")
        "managed_server_resources", MANAGED, _managed, {"CPU": 2}, {**MANAGED_ON, "managed_server_placement": "ray"}
    ),
    SettingNeed(
        "dynamic_sampling_max_oversampling",
        "dynamic sampling (dynamic_sampling=True)",
        lambda config, arguments: bool(config.dynamic_sampling),
        5.0,
        {"dynamic_sampling": True},
    ),
    SettingNeed(
        "token_budget",
        "packed scoring (padding_free None or True)",
        lambda config, arguments: config.padding_free is not False,
        64,
        {"padding_free": None},
    ),
    SettingNeed(
        "gradient_checkpointing_layers",
        "gradient checkpointing (gradient_checkpointing=True)",
        lambda config, arguments: bool(config.gradient_checkpointing),
        "all",
        {"gradient_checkpointing": True},
    ),
    SettingNeed(
        "eval_success_threshold",
        "evaluation (eval_strategy other than 'no', or do_eval=True, or an eval_dataset)",
        _evaluates,
        0.5,
        {"eval_strategy": "steps", "eval_steps": 1},
    ),
)


def _default(config, name: str):
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def unread_settings(config, arguments: dict) -> list[str]:
    """One line per setting of `config` changed from its default whose need is off: the setting, its value, what
    it needs and the fix."""
    if config is None or not dataclasses.is_dataclass(config):
        return []
    names = {f.name for f in dataclasses.fields(config)}
    lines = []
    for row in SETTING_NEEDS:
        if row.setting not in names:
            continue
        value = getattr(config, row.setting)
        if value == _default(config, row.setting) or row.met(config, arguments):
            continue
        lines.append(
            f"{row.setting}={value!r} is read only with {row.needs}, which this run does not use, so it would "
            f"act on nothing. Fix: turn on {row.needs}, or leave {row.setting} unset"
        )
    return lines


def refuse_unread_settings(config, arguments: dict) -> None:
    """A ValueError naming every setting nothing in this run would read (`unread_settings`)."""
    lines = unread_settings(config, arguments)
    if lines:
        raise ValueError("settings this run would not read:\n  - " + "\n  - ".join(lines))
