"""How the PPO critic's parameters, gradients and optimizer state are held across data-parallel ranks.

The policy is prepared by the launcher's mechanism (DDP, DeepSpeed ZeRO, FSDP2); the critic gets the same one, as
its own engine or wrapper with its own optimizer and scheduler (as OpenRLHF and verl hold theirs):

- :class:`ReplicatedCritic`: every rank holds the whole critic and a whole AdamW state; gradients are averaged
  with an all-reduce. One process, DDP launchers, and each Ray critic worker.
- :class:`DeepSpeedCritic`: a DeepSpeed engine built from the launcher's DeepSpeed config the way Trainer builds
  the policy's (its "auto" values filled from the training arguments, a client AdamW and scheduler): ZeRO-2 shards
  gradients and optimizer state, ZeRO-3 parameters too.
- :class:`FSDP2Critic`: `fully_shard` on each decoder layer and on the whole, as accelerate wraps the policy.

All take the critic as one module whose forward returns values (`critic.updater.CriticModule`), so a wrapper sees every
submodule inside one root forward, and offer the same calls: `backward`, `end_micro_step`, `set_scheduler`,
`full_state_dict` / `load_full_state_dict` (collectives; the whole critic), `save` / `load` (optimizer and
scheduler into a checkpoint folder).
"""

from __future__ import annotations

import copy
import os

import torch

CRITIC_OPTIMIZER_NAME = "critic_optimizer.pt"
CRITIC_SCHEDULER_NAME = "critic_scheduler.pt"
CRITIC_DEEPSPEED_DIR = "critic_deepspeed"


def critic_sharding(accelerator) -> str:
    """The sharding the launcher gave the policy, for the critic: "deepspeed", "fsdp2" or "replicated"."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "deepspeed"
    if accelerator.distributed_type == DistributedType.FSDP:
        if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "PPOTrainer shards its critic with FSDP2 only, and this launcher config uses FSDP1. Fix: set "
                "`fsdp_version: 2` in the accelerate config (see examples/accelerate/fsdp2.yaml)."
            )
        return "fsdp2"
    return "replicated"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _make_scheduler(optimizer, scheduler_type, num_warmup_steps, num_training_steps, kwargs):
    from transformers import get_scheduler

    return get_scheduler(
        scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=num_warmup_steps,
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=kwargs or {},
    )


def write_optimizer_files(directory: str, optimizer: dict, scheduler: dict | None) -> None:
    """A whole (unsharded) critic optimizer and scheduler state, as checkpoint files."""
    torch.save(optimizer, os.path.join(directory, CRITIC_OPTIMIZER_NAME))
    if scheduler is not None:
        torch.save(scheduler, os.path.join(directory, CRITIC_SCHEDULER_NAME))


def read_optimizer_files(directory: str) -> tuple[dict | None, dict | None]:
    """What `write_optimizer_files` wrote, ``None`` for a file that is not there."""
    states = []
    for name in (CRITIC_OPTIMIZER_NAME, CRITIC_SCHEDULER_NAME):
        path = os.path.join(directory, name)
        states.append(torch.load(path, map_location="cpu", weights_only=False) if os.path.isfile(path) else None)
    return states[0], states[1]


def _strip(state: dict, prefix: str = "critic.") -> dict:
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


class ReplicatedCritic:
    """The whole critic and a whole AdamW state on every rank; gradients averaged over the process group at the
    end of each accumulation window (no DDP wrapper: the packed engine runs its forwards)."""

    def __init__(self, module: torch.nn.Module, optimizer_settings: dict, max_grad_norm: float | None):
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), **optimizer_settings)
        self.scheduler = None
        self.max_grad_norm = max_grad_norm

    def set_scheduler(self, *args) -> None:
        self.scheduler = _make_scheduler(self.optimizer, *args)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def end_micro_step(self, boundary: bool) -> float | None:
        """At the end of an accumulation window: reduce, clip, step. Returns the gradient norm before clipping
        (None inside a window)."""
        if not boundary:
            return None
        self._reduce_gradients()
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm or float("inf"))
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _reduce_gradients(self) -> None:
        import torch.distributed as dist

        world = _world_size()
        if world == 1:
            return
        for parameter in self.module.parameters():
            if not parameter.requires_grad:
                continue
            if parameter.grad is None:  # a rank that had no rows this step still takes part in the sum
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)
            parameter.grad.div_(world)

    def full_state_dict(self) -> dict:
        return {k: v.detach().cpu() for k, v in _strip(self.module.state_dict()).items()}

    def load_full_state_dict(self, state: dict) -> None:
        self.module.critic.load_state_dict(state)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def save(self, directory: str, is_main_process: bool) -> None:
        optimizer = self.optimizer_state()  # a collective where sharded: every rank takes part
        if is_main_process:
            scheduler = self.scheduler.state_dict() if self.scheduler is not None else None
            write_optimizer_files(directory, optimizer, scheduler)

    def load(self, directory: str) -> None:
        optimizer, scheduler = read_optimizer_files(directory)
        if optimizer is not None:
            self.load_optimizer_state(optimizer)
        if scheduler is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(scheduler)

    def shard_bytes(self) -> dict[str, int]:
        """Bytes of the critic's parameters and optimizer state this rank holds."""
        return {"parameters": _local_bytes(self.module.parameters()), "optimizer": _optimizer_bytes(self.optimizer)}


class FSDP2Critic(ReplicatedCritic):
    """The critic under FSDP2: each decoder layer (the model's `_no_split_modules`) and the whole critic are
    `fully_shard`-ed, so each rank holds 1/world of the parameters, gradients and AdamW state; FSDP2 averages the
    gradients (reduce-scatter) in backward. Checkpoints hold the whole optimizer state, gathered."""

    def __init__(self, module, optimizer_settings, max_grad_norm, fsdp_plugin=None):
        from torch.distributed.fsdp import fully_shard

        options = {"reshard_after_forward": getattr(fsdp_plugin, "reshard_after_forward", True)}
        policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
        if policy is not None and type(policy).__name__ == "MixedPrecisionPolicy":
            options["mp_policy"] = policy
        layer_classes = set(getattr(module.critic, "_no_split_modules", None) or [])
        for submodule in module.critic.modules():
            if type(submodule).__name__ in layer_classes:
                fully_shard(submodule, **options)
        fully_shard(module, **options)
        super().__init__(module, optimizer_settings, max_grad_norm)

    def _reduce_gradients(self) -> None:
        """FSDP2 reduced them in backward."""

    def full_state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _strip(get_model_state_dict(self.module, options=options))

    def load_full_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = {f"critic.{k}": v for k, v in state.items()}
        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state(self) -> dict:
        """The whole AdamW state, gathered, in `torch.optim`'s own layout (parameters by index), so the file is the
        one a replicated critic writes and a checkpoint resumes under either."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        by_name = get_optimizer_state_dict(self.module, self.optimizer, options=options)
        if not by_name:  # gathered on rank 0 only
            return {}
        index = {name: i for i, (name, _) in enumerate(self.module.named_parameters())}
        return {
            "state": {index[name]: value for name, value in by_name["state"].items()},
            "param_groups": [
                {**group, "params": [index[name] for name in group["params"]]} for group in by_name["param_groups"]
            ],
        }

    def load_optimizer_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in self.module.named_parameters()]
        by_name = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [
                {**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]
            ],
        }
        # Not strict: a parameter no forward uses (a vision tower's unused pooling head) never got a gradient, so
        # AdamW saved no state for it, and it has none to restore either.
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_optimizer_state_dict(self.module, self.optimizer, optim_state_dict=by_name, options=options)


class DeepSpeedCritic:
    """The critic's own DeepSpeed engine, with the launcher's ZeRO stage. DeepSpeed reduces, clips (the config's
    `gradient_clipping`, filled from `max_grad_norm`), steps the optimizer and scheduler at the end of each
    accumulation window, and saves and loads its sharded optimizer state as Trainer does for the policy."""

    def __init__(self, module, optimizer_settings: dict, ds_config: dict, scheduler_args: tuple):
        import deepspeed

        self.optimizer = torch.optim.AdamW(module.parameters(), **optimizer_settings)
        self.scheduler = _make_scheduler(self.optimizer, *scheduler_args)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=self.optimizer, lr_scheduler=self.scheduler, config=ds_config
        )
        self.module = self.engine

    def set_scheduler(self, *args) -> None:
        raise RuntimeError("a DeepSpeed critic is built with its scheduler")

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the updater already divided by the accumulation steps

    def end_micro_step(self, boundary: bool) -> float | None:
        # DeepSpeed counts micro-steps itself and steps at the same boundary (its config has the same GA).
        self.engine.step()
        if not boundary:
            return None
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list(self.engine.module.parameters())

    def full_state_dict(self) -> dict:
        from ..sharding.zero import gathered

        with gathered(self.engine.module):
            return {k: v.detach().cpu().clone() for k, v in _strip(self.engine.module.state_dict()).items()}

    def load_full_state_dict(self, state: dict) -> None:
        import deepspeed

        parameters = [p for p in self._parameters() if hasattr(p, "ds_id")]
        if not parameters:
            self.engine.module.critic.load_state_dict(state)
            return
        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                self.engine.module.critic.load_state_dict(state)

    def save(self, directory: str, is_main_process: bool) -> None:
        self.engine.save_checkpoint(os.path.join(directory, CRITIC_DEEPSPEED_DIR))

    def load(self, directory: str) -> None:
        path = os.path.join(directory, CRITIC_DEEPSPEED_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"checkpoint {directory} has no {CRITIC_DEEPSPEED_DIR}/: it was not saved by a PPO run under "
                "DeepSpeed. Resume with the launcher config the checkpoint was saved with."
            )
        self.engine.load_checkpoint(path, load_optimizer_states=True, load_lr_scheduler_states=True)

    def shard_bytes(self) -> dict[str, int]:
        parameters = sum(
            (p.ds_tensor.numel() * p.ds_tensor.element_size()) if hasattr(p, "ds_tensor") else _local_bytes([p])
            for p in self._parameters()
        )
        return {"parameters": parameters, "optimizer": _optimizer_bytes(self.optimizer)}


def deepspeed_critic_config(accelerator, args, critic: torch.nn.Module, num_training_steps: int) -> dict:
    """The critic engine's DeepSpeed config: the launcher's (ZeRO stage, offload, precision), its "auto" values
    filled from the training arguments and the critic as transformers fills the policy's, without an optimizer or
    scheduler section (the critic brings its own AdamW and scheduler)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    base = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    base.pop("optimizer", None)
    base.pop("scheduler", None)
    config = HfTrainerDeepSpeedConfig(base)
    config.trainer_config_process(args)
    config.trainer_config_finalize(args, critic, num_training_steps)
    result = config.config
    result["zero_allow_untested_optimizer"] = True
    return result


def _local_bytes(parameters) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in parameters:
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def _optimizer_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (AdamW's moments) this rank holds. A DeepSpeed ZeRO optimizer wraps
    a torch optimizer over this rank's flat partitions: its state is the one counted."""
    from torch.distributed.tensor import DTensor

    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total
