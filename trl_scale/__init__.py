"""trl-scale: Hugging Face TRL's trainers, made to scale. Change one import, keep the rest."""

__version__ = "0.1.0"

from .trainers import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    PPOConfig,
    PPOTrainer,
    RLOOConfig,
    RLOOTrainer,
)

__all__ = [
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
