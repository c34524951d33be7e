"""Fault injection for tests and soak runs (``tests/test_faults.py``, ``scripts/soak.py``).

Nothing here runs in a production refit: the executor and the endpoints take a ``Fault`` as a
typed, optional argument that only a testing path sets, and do nothing when it is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from .views import BIT_VIEWS

__all__ = ["Fault", "ExitAfterReads"]



@dataclass(frozen=True)
class Fault:
    """Fault injection (tests, ``scripts/soak.py``; only the testing path sets one).

    ``bitflip`` flips the lowest bit of the first element a sender packs for bucket
    ``bucket``, after its checksum was taken -- a corrupted wire, which the destination's
    checksums must catch. ``exit`` ends the rank's process abruptly at protocol step ``at``;
    ``sleep`` stalls it there for ``seconds``. Steps (``transport/endpoint.py``):
    ``before_vote`` (after its last byte), ``after_vote`` (before the decision is known),
    ``after_decision`` (the decision read, before this rank commits). An ``exit`` with
    ``seconds`` waits that long first (so its peers get that far too)."""

    kind: str = "bitflip"
    bucket: int = 0
    at: str = ""
    seconds: float = 0.0

    STEPS = ("before_vote", "after_vote", "after_decision")

    def __post_init__(self) -> None:
        if self.kind not in ("bitflip", "exit", "sleep"):
            raise ValueError(f"Fault.kind={self.kind!r} is not one of bitflip, exit, sleep")
        if self.kind != "bitflip" and self.at not in self.STEPS:
            raise ValueError(f"Fault.at={self.at!r} is not one of {list(self.STEPS)}")

    def hit(self, step: str) -> None:
        """Act if this fault is set for protocol step ``step``."""
        if self.kind == "bitflip" or self.at != step:
            return
        time.sleep(self.seconds)
        if self.kind == "exit":
            os._exit(23)

    def corrupt(self, k: int, messages: Mapping[Any, torch.Tensor], copy_first: Callable[[], torch.Tensor]) -> None:
        """``bitflip`` of bucket ``k``: flip the lowest bit of the first element of the first
        non-empty packed message (its checksum is already taken). When the bucket only holds
        zero-copy boxes, ``copy_first()`` gives the copy of the first box that is sent instead."""
        if self.kind != "bitflip" or self.bucket != k or not messages:
            return
        first = next((m for m in messages.values() if m.numel()), None)
        if first is None:
            first = copy_first()
        bits = first[:1].view(BIT_VIEWS[first.element_size()])
        bits ^= 1

    def to_wire(self) -> dict:
        return {"kind": self.kind, "bucket": self.bucket, "at": self.at, "seconds": self.seconds}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "Fault":
        return Fault(str(d.get("kind", "bitflip")), int(d.get("bucket", 0)), str(d.get("at", "")),
                     float(d.get("seconds", 0.0)))


class ExitAfterReads(dict):
    """A rank's local tensors, by name, whose process exits abruptly at the n-th lookup: a
    trainer dying mid-refit (``TrainerFault.die_after_reads``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], n: int) -> None:
        super().__init__(tensors)
        self._left = n

    def __getitem__(self, key: str) -> torch.Tensor:
        self._left -= 1
        if self._left < 0:
            os._exit(17)
        return super().__getitem__(key)
