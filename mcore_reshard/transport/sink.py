"""Where a destination rank's boxes go: the ``Sink`` protocol and its declared capabilities.

A sink has five methods; ``write`` is the one every sink must really do. The other four let the
executor check the parameter itself rather than the received bytes, and receive large boxes
straight into the destination (zero-copy). A sink says which of them it offers in
``capabilities``, so the executor decides how to deliver once, from the declaration, not by
probing methods in the hot loop or testing the sink's class.

Sinks written before ``capabilities`` existed (only some of the methods, no declaration: e.g.
``VllmApplier``, a test double) and plain callables are wrapped by ``as_sink``, which finds
their methods once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..layout.descriptor import LocalParam, View
from .views import TORCH_DTYPES, local_view, scatter_flat

__all__ = ["Sink", "SinkCaps", "TensorSink", "as_sink", "sink_dtypes"]

#: The methods a sink may leave out (``write`` it may not).
OPTIONAL = ("write_hashed", "target", "landed", "current", "keep", "patch")


@dataclass(frozen=True)
class SinkCaps:
    """Which of ``Sink``'s optional methods a sink really implements (the others raise).

    ``bulk``: the sink's ``tensors`` is a mapping of contiguous tensors that ``write`` copies
    into and nothing else, so the executor may scatter a whole message into it at once
    (``packing.unpack``) instead of one ``write`` per box."""

    write_hashed: bool = False
    target: bool = False
    landed: bool = False
    bulk: bool = False
    current: bool = False
    keep: bool = False
    patch: bool = False


class Sink(Protocol):
    """Receives every box a destination rank gets (e.g. ``VllmApplier``). ``write`` must copy
    ``tensor`` before returning: it is a slice of the receive buffer, reused next bucket.

    ``write_hashed(local_name, view, tensor, hash_fn)`` writes, then returns ``hash_fn`` of
    what the destination now holds at ``view`` (before anything repacks it), so verification
    checks the parameter itself, not only the received bytes (a sink without it is checked
    on the bytes it was given).

    ``target(local_name, view)`` and ``landed(local_name, view, hash_fn)``: the tensor a large
    contiguous box is received into directly (zero-copy; None: use a temporary), and the call
    once its bytes are there (returns ``hash_fn`` of them, like ``write_hashed``). Without them
    such a box is received into a temporary and written.

    ``current(local_name, view)``: what the destination holds at ``view`` now (the live
    weights, not a staged copy): the baseline a delta refit's changes apply to (``delta.py``).
    A sink without it takes full refits only. ``keep(local_name, view, hash_fn)``: a delta
    left the box unchanged -- make sure the destination holds its current values there (where
    it writes into a staged copy, copy them in) and return ``hash_fn`` of them, like
    ``landed``; without it such a box is rebuilt and written like any other.
    ``patch(local_name, view, positions, values, hash_fn)``: the same for a box of which only
    ``values`` at box-flat ``positions`` changed (written over the current values).

    ``capabilities`` says which of these four the sink implements."""

    capabilities: SinkCaps

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None: ...

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any: ...

    def target(self, local_name: str, view: View) -> torch.Tensor | None: ...

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any: ...

    def current(self, local_name: str, view: View) -> torch.Tensor: ...

    def keep(self, local_name: str, view: View, hash_fn: Callable | None) -> Any: ...

    def patch(self, local_name: str, view: View, positions: torch.Tensor, values: torch.Tensor,
              hash_fn: Callable | None) -> Any: ...


class TensorSink:
    """The default sink: writes into a mapping of contiguous local tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @property
    def capabilities(self) -> SinkCaps:
        # A subclass may change any method (tests corrupt in ``write`` or ``landed``), which a
        # bulk scatter would skip: only this class itself is bulk.
        return SinkCaps(write_hashed=True, target=True, landed=True, bulk=type(self) is TensorSink, current=True,
                        keep=True, patch=True)

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        local_view(self.tensors[local_name], view).copy_(tensor)

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any:
        self.write(local_name, view, tensor)  # a subclass's write (tests corrupt there)
        return hash_fn(local_view(self.tensors[local_name], view)) if hash_fn is not None else None

    def target(self, local_name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[local_name], view)

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        return hash_fn(local_view(self.tensors[local_name], view)) if hash_fn is not None else None

    def current(self, local_name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[local_name], view)

    def keep(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        return self.landed(local_name, view, hash_fn)  # written in place: it is there already

    def patch(self, local_name: str, view: View, positions: torch.Tensor, values: torch.Tensor,
              hash_fn: Callable | None) -> Any:
        scatter_flat(local_view(self.tensors[local_name], view), positions, values)
        return self.landed(local_name, view, hash_fn)


class _Undeclared:
    """A sink without ``capabilities``: its methods are looked up once, here, and bound as
    attributes (no extra call per box); one it lacks raises the ``AttributeError`` it would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.write = inner.write
        found = {m: getattr(inner, m, None) for m in OPTIONAL}
        for m, fn in found.items():
            if fn is not None:
                setattr(self, m, fn)
        self.capabilities = SinkCaps(**{m: fn is not None for m, fn in found.items()})

    def _missing(self, name: str) -> AttributeError:
        return AttributeError(f"{type(self.inner).__name__!r} object has no attribute {name!r}")

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any:
        raise self._missing("write_hashed")

    def target(self, local_name: str, view: View) -> torch.Tensor | None:
        raise self._missing("target")

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        raise self._missing("landed")

    def current(self, local_name: str, view: View) -> torch.Tensor:
        raise self._missing("current")

    def keep(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        raise self._missing("keep")

    def patch(self, local_name: str, view: View, positions: torch.Tensor, values: torch.Tensor,
              hash_fn: Callable | None) -> Any:
        raise self._missing("patch")


class _CallableSink(_Undeclared):
    """``fn(local_name, view, tensor)`` as a sink that only writes."""

    def __init__(self, fn: Callable[[str, View, torch.Tensor], None]) -> None:
        self.inner, self.write, self.capabilities = fn, fn, SinkCaps()


def as_sink(dst: Any) -> Sink:
    """A mapping of tensors, a sink (declared or not) or a callable, as a ``Sink``."""
    if isinstance(dst, Mapping):
        return TensorSink(dst)
    if hasattr(dst, "write"):
        return dst if isinstance(getattr(dst, "capabilities", None), SinkCaps) else _Undeclared(dst)
    if callable(dst):
        return _CallableSink(dst)
    raise TypeError(f"destination must be a mapping of tensors, a sink with write(), or a callable; got {type(dst)}")


def sink_dtypes(sink: Sink, dst: Any, names: Sequence[str]) -> set[torch.dtype]:
    """The element types the sink holds ``names`` in: a ``TensorSink``'s tensors, or a sink's
    ``params`` (e.g. ``VllmApplier``: name -> ``LocalParam``) on ``dst``, the object it wraps."""
    if isinstance(sink, TensorSink):
        return {sink.tensors[n].dtype for n in names}
    params: Mapping[str, LocalParam] | None = getattr(dst, "params", None)
    if params is not None:
        return {TORCH_DTYPES[params[n].dtype] for n in names}
    raise ValueError("cannot tell the wire dtype from this sink: pass wire_dtype=")
