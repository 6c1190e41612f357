"""The features' state in a checkpoint: one file per (data-parallel) rank, keyed by feature name.

Each feature gives what resumes it exactly (`Feature.state_dict`, None for nothing) and checks its own dict when it
gets it back (`Feature.load_state_dict`: the group size, the number of processes). A checkpoint of the format before
this file (trl-scale 1581e27, one day: each feature its own file) is refused, naming it, rather than resumed without
its rollout.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING

from ..sharding.data_parallel import writes_group_files
from .feature import FeatureChain

if TYPE_CHECKING:
    from .run import Run

STATE_NAME = "trl_scale_state_rank{rank}.pt"
FORMAT = 1
# what trl-scale 1581e27 saved instead, one file per feature and rank
EARLIER_FILES = ("rollout_buffer_rank*.pt", "rollout_stream_rank*.pt", "dynamic_sampling_rank*.json")


def state_path(directory: str, rank: int | str) -> str:
    return os.path.join(directory, STATE_NAME.format(rank=rank))


def saved_ranks(checkpoint: str) -> int:
    """How many data-parallel ranks saved their features' state into `checkpoint`."""
    return len(glob.glob(state_path(checkpoint, "*")))


def save_feature_states(chain: FeatureChain, run: Run, output_dir: str) -> str | None:
    """Every feature's state, one file for this rank (under sequence parallelism, one per group: its ranks hold the
    same state). Nothing is written where no feature has state."""
    states = {}
    for feature in chain.features:
        state = feature.state_dict(run)
        if state is not None:
            states[feature.name] = state
    if not states or not writes_group_files(run.trl.accelerator):
        return None
    import torch

    # Ranks other than the main one get here while it may still be writing the model: the folder it creates may not
    # exist yet (transformers' own per-rank RNG file makes it the same way).
    os.makedirs(output_dir, exist_ok=True)
    path = state_path(output_dir, run.trl.accelerator.process_index)
    torch.save({"format": FORMAT, "features": states}, path)
    return path


def load_feature_states(chain: FeatureChain, run: Run, checkpoint: str) -> None:
    """Each feature given its saved state (from this rank's file); nothing where the checkpoint holds none (saved at
    a window's end, or by TRL)."""
    path = state_path(checkpoint, run.trl.accelerator.process_index)
    if not os.path.isfile(path):
        earlier = sorted(name for pattern in EARLIER_FILES for name in glob.glob(os.path.join(checkpoint, pattern)))
        if earlier:
            raise ValueError(
                f"{checkpoint} holds trl-scale state in the format before one state file per rank "
                f"({os.path.basename(earlier[0])}, ...: trl-scale 1581e27), which this trl-scale does not read; "
                "resumed without it, the run would drop the rollout it saved. Fix: resume with trl-scale 1581e27, "
                "or delete those files to resume from the checkpoint's step with a new rollout (as TRL resumes)"
            )
        return
    import torch

    # Our own file in our own checkpoint (tensors in lists and dicts), loaded as the Trainer loads its RNG state;
    # on the CPU first, each feature moving what it needs to its device.
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # a half-written or damaged file: torch says EOFError, RuntimeError, UnpicklingError
        why = (str(error).splitlines() or [""])[0][:200]
        raise ValueError(
            f"{path} cannot be read ({type(error).__name__}: {why}): the checkpoint's trl-scale state is "
            "damaged or was not written to its end (a run stopped while saving?). Fix: resume from an earlier "
            "checkpoint-N, or delete this checkpoint folder"
        ) from error
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a trl-scale state file of format {FORMAT} (holds {type(saved).__name__}). Fix: resume "
            "from a checkpoint written by trl-scale, or delete this file"
        )
    states = saved.get("features", {})
    for feature in chain.features:
        if feature.name in states:
            feature.load_state_dict(run, states[feature.name], path)
