"""trl-scale: Hugging Face TRL's trainers, made to scale. Change one import, keep the rest."""

__version__ = "0.1.0"

REWARDS = ["AsyncRemoteReward", "CodeExecutionReward", "RemoteReward", "RemoteRewardSettings", "SandboxSettings"]

__all__ = [
    *REWARDS,
    "DPOConfig",
    "DPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "RLOOConfig",
    "RLOOTrainer",
    "__version__",
]


def __getattr__(name: str):
    # Imported on first use (PEP 562): `trl-scale --help`, `check-servers` and `serve` need no TRL, which takes
    # seconds to import.
    if name in REWARDS:  # no TRL: a reward server or a verifier needs none
        from . import rewards

        return getattr(rewards, name)
    if name in __all__:
        from . import trainers

        return getattr(trainers, name)
    raise AttributeError(f"module 'trl_scale' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
