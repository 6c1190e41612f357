"""Local generation with transformers: a batch's repeated prompts prefilled once."""

from .prefill import PrefillStats, SharedRows, shared_prefill_generate, shared_rows, why_not_shared

__all__ = ["PrefillStats", "SharedRows", "shared_prefill_generate", "shared_rows", "why_not_shared"]
