"""The check that each tensor a weight sync sends lands on a weight the servers hold.

A server (vLLM, `trl-scale serve`) loads weights by the names its checkpoint holds; a loader may skip a name it does
not know without a word (vLLM's reload only logs the weights it did not load). Syncs send checkpoint names, which
every loader reads (`CheckpointNamedWalk`, over `trl_scale.checkpoint_names`: a mixture of experts' fused experts one
tensor per expert, as `save_pretrained` writes them), and every mode checks them first against
`ServerWeights`: the tensors the servers loaded (names and shapes from the safetensors headers of the checkpoint the
server was started from, or the policy's own). The first tensor without a place, or held and never sent, is named.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..checkpoint_names import checkpoint_tensors, read_checkpoint_shapes
from ..logs import get_logger

logger = get_logger(__name__)

PLACEMENT_FIX = (
    "the servers must load the policy's own checkpoint (the same model, revision and architecture), and the trainer's "
    "weights must map to its names. A mixture-of-experts model needs transformers' weight conversion for its family "
    "(transformers.conversion_mapping)"
)


class WeightPlacementError(ValueError):
    """A weight sync would send a tensor the servers have no place for, or leave one of theirs unsynced."""


@dataclass(frozen=True)
class ServerWeights:
    """The weights the servers hold, as their loader names them: a checkpoint's tensor names and shapes."""

    shapes: dict[str, tuple[int, ...]]
    source: str  # the checkpoint they were read from
    # the checkpoint's tensors that are the model's persistent buffers, not parameters (DeepSeek-V3's routing bias):
    # no optimizer moves them, a sync walks the parameters (as TRL's), so they stay as loaded, alike everywhere
    buffers: frozenset[str] = frozenset()

    def check(self, sent: Iterable[tuple[str, Sequence[int]]], what: str = "weight sync") -> None:
        """Every (name, shape) `sent` lands on a tensor of the same name and shape, and every tensor held is sent;
        raises naming the first that does not."""
        names = set()
        for name, shape in sent:
            names.add(name)
            held = self.shapes.get(name)
            if held is None:
                raise WeightPlacementError(
                    f"{what}: the trainer's tensor {name!r} has no place on the servers (the checkpoint they loaded, "
                    f"{self.source}, has no tensor of that name), so the servers would keep their own. Fix: "
                    f"{PLACEMENT_FIX}"
                )
            if tuple(held) != tuple(shape):
                raise WeightPlacementError(
                    f"{what}: the trainer's tensor {name!r} has shape {tuple(shape)}, the servers' "
                    f"{tuple(held)} (checkpoint {self.source}). Fix: {PLACEMENT_FIX}"
                )
        unsent = [name for name in self.shapes if name not in names and name not in self.buffers]
        if unsent:
            raise WeightPlacementError(
                f"{what}: the servers' weight {unsent[0]!r} ({len(unsent)} in all) gets no tensor from the trainer "
                f"(checkpoint {self.source}), so it would stay as loaded. Fix: {PLACEMENT_FIX}"
            )

    def check_adapter(self, adapter_names: Iterable[str], what: str = "weight sync (LoRA)") -> None:
        """Every LoRA tensor (PEFT's saved names) wraps a module whose weight the servers hold: an adapter on a
        module the servers do not have (a fused expert tensor) would never be applied."""
        modules = {name.rsplit(".", 1)[0] for name in self.shapes}
        for name in adapter_names:
            module = name.removeprefix("base_model.model.").split(".lora_")[0]
            if module not in modules:
                raise WeightPlacementError(
                    f"{what}: the adapter's tensor {name!r} wraps {module!r}, which the servers' model (checkpoint "
                    f"{self.source}) has no weight for, so it would never be applied. Fix: target modules the "
                    "checkpoint holds (target_modules), not fused expert parameters (target_parameters)"
                )


def server_weights(paths: Iterable[str | None], buffers: Iterable[str] = ()) -> ServerWeights | None:
    """The first of `paths` (the servers' model paths, then the policy's) that is a readable checkpoint; None where
    none is (a server on another machine, a Hub id): the sync is not checked, said once. `buffers`: the policy's
    buffers' names under checkpoint names (`buffer_names`: the persistent ones are the checkpoint's)."""
    tried = [p for p in paths if p]
    for path in tried:
        shapes = read_checkpoint_shapes(path)
        if shapes:
            return ServerWeights(shapes, path, frozenset(buffers))
    logger.warning(
        "the weights a sync sends are not checked against the servers' checkpoint: none of %s is a local directory "
        "with safetensors files",
        tried or "(no model path)",
    )
    return None


def buffer_names(model) -> set[str]:
    """The names of `model`'s buffers under checkpoint names: those a checkpoint holds (persistent ones) are exempt
    from the placement check; the others are in no checkpoint, so the check never waits for them anyway."""
    return {converted for converted, _ in checkpoint_tensors(model, model.named_buffers())}


class CheckpointNamedWalk:
    """For a subclass of TRL's `VLLMGeneration`: its parameter walk (`_iter_named_params`: ZeRO-3 gathers, FSDP,
    merged PEFT weights) under checkpoint names, so every sync path (a server's loader, colocated vLLM's
    `load_weights` and `reload_weights`) reads names it knows."""

    def _iter_named_params(self):
        model = self.accelerator.unwrap_model(self.model)
        yield from checkpoint_tensors(model, super()._iter_named_params())
