"""The rollout–training mismatch: how far each server's sampler is from the trainer's policy, as figures per server
(`figures`), the settings that bound it (`arguments`), and what a figure past its budget most likely means."""

from .arguments import MismatchArguments, MismatchSettings
from .figures import MismatchFigures, format_figures, mismatch_figures, sequence_mismatch_figures, verdict

__all__ = [
    "MismatchArguments",
    "MismatchFigures",
    "MismatchSettings",
    "format_figures",
    "mismatch_figures",
    "sequence_mismatch_figures",
    "verdict",
]
