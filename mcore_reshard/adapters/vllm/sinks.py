"""Sinks (and a participant) a worker wraps around its ``VllmApplier`` for one refit, when
the request asks.

``FullCopy`` (``verify=full``): every box also lands in a model-format copy of the worker's
parameters, taken before vLLM repacks a layer, which the driver compares element for element
with the trainers' weights. ``ExitAfter`` (fault injection, set only by a request's typed
``faults``): the worker process exits abruptly after ``n`` writes, as a crash mid-transfer would.
Both pass every sink method through, ``keep`` and ``patch`` included, so a delta refit takes the
same path with them as without. ``AlteredBaseline`` (fault injection) is the applier as the
refit's participant, altering a delta's baseline as the refit opens.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...transport.endpoint import Prepared
from ...transport.views import TORCH_DTYPES, local_view, scatter_flat
from ...wire.protocol import RefitRequest
from .apply import VllmApplier

__all__ = ["AlteredBaseline", "ExitAfter", "FullCopy"]


class FullCopy:
    """Sink that applies every write and keeps a model-format copy of it (``verify=full``)."""

    def __init__(self, applier: VllmApplier) -> None:
        self.applier = applier
        self.params = applier.params  # the executor reads the wire dtype from here
        self.copies = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in applier.params.values()}

    def write(self, local_name: str, view: Any, tensor: torch.Tensor) -> None:
        self.write_hashed(local_name, view, tensor, None)

    def write_hashed(self, local_name: str, view: Any, tensor: torch.Tensor, hash_fn: Any) -> Any:
        out = self.applier.write_hashed(local_name, view, tensor, hash_fn)
        local_view(self.copies[local_name], view).copy_(tensor)
        return out

    def target(self, local_name: str, view: Any) -> torch.Tensor:
        return self.applier.target(local_name, view)

    def current(self, local_name: str, view: Any) -> torch.Tensor:
        return self.applier.current(local_name, view)

    def keep(self, local_name: str, view: Any, hash_fn: Any) -> Any:
        local_view(self.copies[local_name], view).copy_(self.applier.current(local_name, view))
        return self.applier.keep(local_name, view, hash_fn)

    def patch(self, local_name: str, view: Any, positions: Any, values: Any, hash_fn: Any) -> Any:
        copy = local_view(self.copies[local_name], view)
        copy.copy_(self.applier.current(local_name, view))  # before a layer this completes is processed
        if positions is not None:
            scatter_flat(copy, positions, values)
        return self.applier.patch(local_name, view, positions, values, hash_fn)

    def landed(self, local_name: str, view: Any, hash_fn: Any) -> Any:
        # Copy before the applier may process (repack) a layer this box completes.
        local_view(self.copies[local_name], view).copy_(self.applier.target(local_name, view))
        return self.applier.landed(local_name, view, hash_fn)


class ExitAfter:
    """Fault injection: a sink whose worker process exits abruptly after ``n`` writes."""

    def __init__(self, sink: Any, n: int) -> None:
        self.sink, self.params, self._left = sink, sink.params, n

    def _count(self) -> None:
        if self._left <= 0:
            os._exit(19)
        self._left -= 1

    def write(self, local_name: str, view: Any, tensor: torch.Tensor) -> None:
        self.write_hashed(local_name, view, tensor, None)

    def write_hashed(self, local_name: str, view: Any, tensor: torch.Tensor, hash_fn: Any) -> Any:
        self._count()
        return self.sink.write_hashed(local_name, view, tensor, hash_fn)

    def target(self, local_name: str, view: Any) -> torch.Tensor:
        return self.sink.target(local_name, view)

    def current(self, local_name: str, view: Any) -> torch.Tensor:
        return self.sink.current(local_name, view)

    def keep(self, local_name: str, view: Any, hash_fn: Any) -> Any:
        self._count()
        return self.sink.keep(local_name, view, hash_fn)

    def patch(self, local_name: str, view: Any, positions: Any, values: Any, hash_fn: Any) -> Any:
        self._count()
        return self.sink.patch(local_name, view, positions, values, hash_fn)

    def landed(self, local_name: str, view: Any, hash_fn: Any) -> Any:
        self._count()
        return self.sink.landed(local_name, view, hash_fn)


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
