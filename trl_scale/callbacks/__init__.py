"""Callbacks whose figures reach every `report_to` integration through the Trainer's `log`."""

from .memory import MemoryCallback
from .samples import CompletionSamplesCallback
from .throughput import ThroughputCallback
from .timing import StepTimeCallback

__all__ = ["CompletionSamplesCallback", "MemoryCallback", "StepTimeCallback", "ThroughputCallback"]
