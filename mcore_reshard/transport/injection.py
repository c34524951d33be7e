"""What acts on a fault where the bytes live (tests and soak runs only): the bit flipped in a
packed bucket and the exit after a rank's n-th source read. The faults themselves are typed
messages (``wire/faults.py``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

from ..errors import RefitError
from ..wire.faults import Fault
from .views import BIT_VIEWS

__all__ = ["corrupt", "flip_first", "ExitAfterReads", "ExitAfterBoxes"]


def corrupt(fault: Fault, k: int, messages: Mapping[Any, torch.Tensor], copy_first: Callable[[], torch.Tensor]) -> None:
    """``bitflip`` of bucket ``k``: flip the lowest bit of the first element of the first
    non-empty packed message (its checksum is already taken). When the bucket only holds
    zero-copy boxes, ``copy_first()`` gives the copy of the first box that is sent instead."""
    if fault.kind != "bitflip" or fault.tensor or fault.bucket != k or not messages:
        return
    first = next((m for m in messages.values() if m.numel()), None)
    flip_first(first if first is not None else copy_first())


def flip_first(x: torch.Tensor) -> None:
    """Flip the lowest bit of the first element of ``x`` (in place)."""
    bits = x.as_strided((1,), (1,), x.storage_offset()).view(BIT_VIEWS[x.element_size()])  # (a view, strided or not)
    bits ^= 1


class ExitAfterReads(dict):
    """A rank's local tensors, by name, whose process exits abruptly at the n-th lookup: a
    trainer dying mid-refit (``TrainerFault.die_after_reads``); with ``raises``, the lookup
    raises instead: a trainer whose refit fails mid-transfer (``raise_after_reads``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], n: int, raises: bool = False) -> None:
        super().__init__(tensors)
        self._left, self._raises = n, raises

    def __getitem__(self, key: str) -> torch.Tensor:
        self._left -= 1
        if self._left < 0:
            if self._raises:
                raise RefitError(f"injected failure reading {key!r} (TrainerFault.raise_after_reads)")
            os._exit(17)
        return super().__getitem__(key)


class ExitAfterBoxes:
    """A sink whose process exits abruptly once ``n`` boxes were in place (``commit_box``): a
    destination dying mid-transfer (``EngineFault.exit_after_writes``)."""

    def __init__(self, sink: Any, n: int) -> None:
        self.sink, self._left = sink, n
        self.params = getattr(sink, "params", None)  # the wire dtype, where the sink holds it
        base = getattr(sink, "baseline", None)
        if callable(base):
            self.baseline = base

    def resolve(self, name: str, view: Any) -> torch.Tensor:
        return self.sink.resolve(name, view)

    def commit_box(self, name: str, view: Any) -> None:
        if self._left <= 0:
            os._exit(19)
        self._left -= 1
        self.sink.commit_box(name, view)
