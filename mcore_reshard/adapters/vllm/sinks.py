"""What a worker wraps around its ``VllmApplier`` for one refit, when the request asks: the
sink (``verify=full``'s copy is the transport's ``Mirror``, a fault's exit after n boxes its
``ExitAfterCommits``, both through the sink's calls) and ``AlteredBaseline``, the applier as
the refit's participant, altering a delta's baseline as the refit opens (fault injection).
"""

from __future__ import annotations

from typing import Any

import torch

from ...transport.endpoint import Prepared
from ...transport.faults import ExitAfterCommits
from ...transport.sink import Mirror
from ...transport.views import TORCH_DTYPES
from ...wire.faults import EngineFault
from ...wire.protocol import RefitRequest
from .apply import VllmApplier

__all__ = ["AlteredBaseline", "refit_sink"]


def refit_sink(applier: VllmApplier, full_copy: bool, fault: EngineFault | None) -> tuple[Any, dict | None]:
    """(the sink a refit's boxes go to, the ``verify=full`` copies or None)."""
    sink: Any = applier.sink
    copies = None
    if full_copy:
        copies = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in applier.params.values()}
        sink = Mirror(sink, copies)
    if fault is not None and fault.exit_after_writes is not None:
        sink = ExitAfterCommits(sink, fault.exit_after_writes)
    return sink, copies


class AlteredBaseline:
    """Fault injection: the applier as a refit's participant, which adds 1 to the first element
    a delta of ``name`` would start from as the refit opens (``VllmApplier.alter_baseline``;
    a name the worker does not hold is its "no" vote)."""

    def __init__(self, applier: VllmApplier, name: str) -> None:
        self.applier, self.name = applier, name

    def open(self, request: RefitRequest) -> bool:
        ready = self.applier.open(request)
        self.applier.alter_baseline(self.name)
        return ready

    def prepare(self) -> Prepared:
        return self.applier.prepare()

    def commit(self) -> None:
        self.applier.commit()

    def abort(self, reason: str) -> None:
        self.applier.abort(reason)
