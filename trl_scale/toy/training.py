"""The supervised passes the toy warm-ups share: AdamW over prepared batches, then evaluation mode."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def supervised_steps(model, batches: Iterable[tuple[dict, torch.Tensor]], learning_rate: float) -> float:
    """One optimizer step per `(inputs, labels)` (the model's own loss on them), the model left in evaluation mode.
    Returns the last loss (NaN without a batch)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    loss = torch.tensor(float("nan"))
    for inputs, labels in batches:
        loss = model(**inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()
