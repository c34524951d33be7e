"""One optimizer step at another learning rate (both training backends' ``train_step(lr=)``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["learning_rate"]


@contextmanager
def learning_rate(optimizer: Any, lr: float | None) -> Iterator[None]:
    """Every parameter group of ``optimizer`` (torch's or megatron's: ``param_groups``) at ``lr``
    inside the block, its own rates back after it, whatever the block raised. ``None``: as is."""
    groups = optimizer.param_groups
    before = [g["lr"] for g in groups]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    try:
        yield
    finally:
        for g, v in zip(groups, before):
            g["lr"] = v
