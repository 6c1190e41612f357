"""The Ray backend's config fields (placements of the critic, reward and reference models), mixed into the online
trainers' configs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..logs import get_logger
from ..numbers import check_field_types, check_positive, dict_field

if TYPE_CHECKING:
    from .ray_backend import Placement

logger = get_logger(__name__)


@dataclass
class DistributedArguments:
    """Where the reward models (and PPO's critic) live: in the trainer processes, or on Ray role groups."""

    FIELDS_DOC = """
    > Placement (`pip install trl-scale[ray]`)

    backend (`str`, defaults to `"local"`): `"ray"` puts reward models (and PPO's critic) on Ray role groups,
        started and called by the main trainer process for every rank.
    ray_address (`str` or `None`): a Ray cluster (`"auto"`: the one `ray start` started on this machine); `None`
        starts a local one of this run's own, or joins the one `RAY_ADDRESS` names.
    reward_placement, critic_placement, reference_placement (`dict` or `None`):
        `{"num_workers": 1, "num_gpus_per_worker": 1.0, "num_cpus_per_worker": 1}` per role, plus optional
        `"resources"` (custom Ray resources per worker, e.g. `{"node_b": 1}`, to pin a role to nodes). The reference
        goes to its own group only when `reference_placement` is given (and `beta != 0`, no PEFT).
        `critic_placement` also takes `"sharding"`: `"fsdp2"` (default; with several workers each holds
        1/num_workers of the critic's parameters, gradients and AdamW state) or `"replicated"`.
    ray_call_timeout (`float`, defaults to `300`): bound on every call to a Ray worker.
"""  # its section of each config's docstring (`config_docstring`)

    backend: Literal["local", "ray"] = field(
        default="local",
        metadata={"help": "'local' (in the trainer processes) or 'ray' (reward models and the critic on Ray groups)."},
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "help": "Ray cluster address ('auto': the one `ray start` started here); None starts a local one of this "
            "run's own, or joins RAY_ADDRESS's."
        },
    )
    reward_placement: dict | str | None = field(
        default=None,
        metadata={"help": "Reward group: {'num_workers': 1, 'num_gpus_per_worker': 1.0, 'num_cpus_per_worker': 1}."},
    )
    critic_placement: dict | str | None = field(
        default=None,
        metadata={
            "help": "Critic group (PPO), same keys as reward_placement, plus 'sharding': 'fsdp2' (default: the "
            "critic sharded across its workers) or 'replicated'."
        },
    )
    reference_placement: dict | str | None = field(
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
        check_field_types(self, DistributedArguments)

    def placement(self, role: Literal["reward", "critic", "reference"]) -> Placement:
        """The role's `*_placement` field as a `Placement` (validated: every key and number), the one parser of the
        three fields, used at construction and where the groups start."""
        from .ray_backend import Placement

        return Placement.from_config(getattr(self, f"{role}_placement"), f"{role}_placement")

    def _validate_distributed_arguments(self) -> None:
        for role in ("reward", "critic", "reference"):  # the command line gives a JSON object as text
            name = f"{role}_placement"
            setattr(self, name, dict_field(getattr(self, name), name))
        if self.backend not in ("local", "ray"):
            raise ValueError(f"backend={self.backend!r}: use 'local' or 'ray'")
        check_positive("ray_call_timeout", self.ray_call_timeout)
        if self.backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ImportError(
                    "backend='ray' needs Ray, which is not installed. Fix: pip install 'trl-scale[ray]' (or set "
                    "backend='local' to keep every model in the trainer processes)"
                )
            for role in ("reward", "critic") + (("reference",) if self.reference_placement is not None else ()):
                self.placement(role)
        elif self.reference_placement is not None:
            raise ValueError("reference_placement places the reference on a Ray group: set backend='ray' too")
        else:
            for role in ("reward", "critic"):
                if getattr(self, f"{role}_placement", None) is not None:  # a typo must not wait for backend='ray'
                    self.placement(role)
                    logger.warning(
                        f"{role}_placement is unused with backend='local': every model stays in the trainers"
                    )
        sp_size = getattr(self, "sequence_parallel_size", 1)
        ray_roles = [role for role in ("reference", "critic") if getattr(self, f"{role}_placement", None) is not None]
        if sp_size > 1 and self.backend == "ray" and ray_roles:
            raise ValueError(
                f"sequence_parallel_size={sp_size} with {' and '.join(r + '_placement' for r in ray_roles)}: the "
                "ranks of a sequence-parallel group share one batch, and a Ray group scores (and trains) what every "
                "trainer rank sends it, so it would take each row sp_size times. Fix: keep those roles in the "
                f"trainer (drop {', '.join(r + '_placement' for r in ray_roles)}), or sequence_parallel_size=1"
            )
        if self.reference_placement is not None and getattr(self, "sync_ref_model", False):
            raise ValueError(
                "sync_ref_model=True is not supported with reference_placement (the reference lives on a Ray group); "
                "set sync_ref_model=False or reference_placement=None"
            )
