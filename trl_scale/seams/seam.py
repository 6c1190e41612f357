"""What one seam records (`Seam`), the ways trl-scale touches a target, and the targets' short names."""

from __future__ import annotations

from dataclasses import dataclass

# How trl-scale touches a target.
OVERRIDE = "override"  # a subclass method of the same name (calling super() or not)
CALL = "call"  # calls it, or passes keywords it must accept
ATTRIBUTE = "attribute"  # reads or writes an attribute TRL's class sets (``self.<name>`` in its source)
COPY = "copy"  # repeats or wraps its logic: any change to its source must be re-read
CONFIG = "config"  # a config field trl-scale sets around TRL's constructor
CONSTANT = "constant"  # a module-level (often private) name it reads


@dataclass(frozen=True)
class Seam:
    target: str  # "module:Qualified.name" (for ATTRIBUTE, the class; the attribute is `attribute`)
    kind: str
    used_in: str  # where in trl-scale
    assumes: str  # what trl-scale relies on, to re-read against a new TRL
    fingerprint: str = ""  # signature (OVERRIDE, CALL), "sha:<12 hex>" of the source (COPY); empty otherwise
    attribute: str = ""


G = "trl.trainer.grpo_trainer:GRPOTrainer"
T = "transformers.trainer:Trainer"
V = "trl.generation.vllm_generation:VLLMGeneration"
U = "trl.trainer.utils"
