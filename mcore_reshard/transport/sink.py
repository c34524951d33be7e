"""Where a destination rank's boxes go: the ``Sink`` protocol, in the shape of DCP's
``LoadPlanner`` (``resolve_tensor`` / ``commit_tensor``).

The transport asks the sink where a box goes (``resolve``), writes it there itself -- copied from
the receive buffer, or received straight into it when it is contiguous -- hashes what the
destination now holds, and tells the sink it is done (``commit_box``). So hashing, zero-copy,
delta boxes (kept or patched), the ``verify=full`` copy and fault exits are transport parts that
work through these calls (``deliver.py``, ``delta.py``, :class:`Mirror`, ``injection.py``), and a
sink only knows where its tensors are and what to do once a box is in place (count it, process a
layer it completes). A box committed without being resolved keeps the values the destination
holds there: a delta refit found it unchanged. (The refit's own commit, of every box at once
after the vote, is its participant's: ``endpoint.Participant.commit``.) ``baseline`` (optional) is what the destination
serves now, the values a delta's changes apply to; a sink without it takes full refits only.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from ..layout.descriptor import LocalParam, View
from .views import TORCH_DTYPES, local_view

__all__ = ["Sink", "TensorSink", "Mirror", "as_sink", "baseline_of", "sink_dtypes"]


@runtime_checkable
class Sink(Protocol):
    """Receives every box a destination rank gets (e.g. ``adapters.vllm.sinks.VllmSink``)."""

    def resolve(self, name: str, view: View) -> torch.Tensor:
        """The tensor the box at ``view`` of local tensor ``name`` is written into (shape
        ``view.shape``, on the sink's device): the live tensor, a staged copy or a shadow."""
        ...

    def commit_box(self, name: str, view: View) -> None:
        """The box's values are in place (in the tensor ``resolve`` gave; a box never resolved
        in this refit keeps what the destination holds)."""
        ...


def baseline_of(sink: Any) -> Any:
    """The sink's optional ``baseline(name, view) -> Tensor`` (what the destination serves at
    ``view`` now, which a delta's changes apply to), or None: it takes full refits only."""
    fn = getattr(sink, "baseline", None)
    return fn if callable(fn) else None


class TensorSink:
    """The default sink: boxes written in place into a mapping of contiguous local tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def resolve(self, name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[name], view)

    def commit_box(self, name: str, view: View) -> None:
        """Written in place: nothing left to do."""

    def baseline(self, name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[name], view)


class Mirror:
    """``verify=full``: every box the destination commits is also copied into ``copies`` (one
    model-format tensor per local name), from where it lies before ``inner`` commits it (a
    completed layer may then be repacked); the driver compares them element for element
    with the trainers' weights."""

    def __init__(self, inner: Sink, copies: Mapping[str, torch.Tensor]) -> None:
        self.inner, self.copies = inner, copies
        self.params = getattr(inner, "params", None)  # the wire dtype, where the sink holds it
        self._resolved: dict[tuple[str, View], torch.Tensor] = {}
        base = baseline_of(inner)
        if base is not None:
            self.baseline = base

    def resolve(self, name: str, view: View) -> torch.Tensor:
        x = self._resolved[(name, view)] = self.inner.resolve(name, view)
        return x

    def commit_box(self, name: str, view: View) -> None:
        x = self._resolved.pop((name, view), None)
        local_view(self.copies[name], view).copy_(x if x is not None else self.baseline(name, view))
        self.inner.commit_box(name, view)


def as_sink(dst: Any) -> Sink:
    """A mapping of tensors or a sink, as a ``Sink``."""
    if isinstance(dst, Mapping):
        return TensorSink(dst)
    if isinstance(dst, Sink):
        return dst
    raise TypeError(f"destination must be a mapping of tensors or a sink with resolve() and commit_box(); got {type(dst)}")


def sink_dtypes(sink: Sink, names: Sequence[str]) -> set[torch.dtype]:
    """The element types the sink holds ``names`` in: a ``TensorSink``'s tensors, or a sink's
    ``params`` (e.g. ``VllmSink``: name -> ``LocalParam``)."""
    if isinstance(sink, TensorSink):
        return {sink.tensors[n].dtype for n in names}
    params: Mapping[str, LocalParam] | None = getattr(sink, "params", None)
    if params is not None:
        return {TORCH_DTYPES[params[n].dtype] for n in names}
    raise ValueError("cannot tell the wire dtype from this sink: pass wire_dtype=")
