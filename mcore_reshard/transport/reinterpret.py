"""Tensors a plan carries as their bits (``RankPlan.reinterpret``), seen in wire units.

The wire dtype is the destination dtype (the planner's byte budget is in it); a source of
another dtype is cast while packing. A tensor the plan carries as its bits instead (e.g. an fp32
router bias in a bf16 refit) is viewed as the wire dtype on both ends: ``WireTensors`` on the
source, ``ReinterpretSink`` on the destination. So the executor only sees wire units, the sink
only real ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Mapping

import torch

from ..layout.descriptor import View
from .views import TORCH_DTYPES
from .sink import Sink, SinkCaps

__all__ = ["ReinterpretSink", "WireTensors"]


def _real_view(view: View, r: int, name: str) -> View:
    """A view in wire units (``r`` wire elements per real one, last stride 1) in real units."""
    if view.offset % r or view.shape[-1] % r or any(st % r for st in view.stride[:-1]) or view.stride[-1] != 1:
        raise ValueError(f"{name}: box {view} does not hold whole elements of its own dtype")
    return View(view.offset // r, (*view.shape[:-1], view.shape[-1] // r), (*(st // r for st in view.stride[:-1]), 1))


class WireTensors(Mapping):
    """``tensors`` with the reinterpreted ones (name -> real dtype name) viewed as ``wire``:
    the same memory, so packing copies their bits and a write lands in the real tensor."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], real: Mapping[str, str], wire: torch.dtype) -> None:
        self.tensors, self.real, self.wire = tensors, real, wire

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        if name not in self.real:
            return t
        if t.dtype != TORCH_DTYPES[self.real[name]]:
            raise ValueError(f"{name} is {t.dtype}, the plan carries it as {self.real[name]} bits")
        return t.view(self.wire)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class ReinterpretSink:
    """A sink in wire units over ``inner`` (real units): a box of a reinterpreted tensor
    (name -> real dtype name), addressed in wire elements, is handed to ``inner`` as the same
    bytes in its real dtype at the real view; what ``inner`` holds is hashed as wire elements,
    so both ends hash the same bytes. Other names pass through. It offers the optional methods
    ``inner`` offers, never a bulk scatter (that would skip the conversion)."""

    def __init__(self, inner: Sink, real: Mapping[str, str], wire: torch.dtype) -> None:
        self.inner, self.wire = inner, wire
        w = torch.empty((), dtype=wire).element_size()
        self.real = {n: (TORCH_DTYPES[d], TORCH_DTYPES[d].itemsize // w) for n, d in real.items()}
        # (a delta's positions are in wire units: no patch, such boxes are rebuilt whole)
        self.capabilities: SinkCaps = replace(inner.capabilities, bulk=False, patch=False)

    def _wire_hash(self, hash_fn: Callable | None) -> Callable | None:
        return None if hash_fn is None else (lambda x: hash_fn(x.view(self.wire)))

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.write(local_name, view, tensor)
        self.inner.write(local_name, _real_view(view, real[1], local_name), tensor.contiguous().view(real[0]))

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.write_hashed(local_name, view, tensor, hash_fn)
        return self.inner.write_hashed(local_name, _real_view(view, real[1], local_name),
                                       tensor.contiguous().view(real[0]), self._wire_hash(hash_fn))

    def target(self, local_name: str, view: View) -> torch.Tensor | None:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.target(local_name, view)
        x = self.inner.target(local_name, _real_view(view, real[1], local_name))
        return None if x is None or x.dtype != real[0] else x.view(self.wire)

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.landed(local_name, view, hash_fn)
        return self.inner.landed(local_name, _real_view(view, real[1], local_name), self._wire_hash(hash_fn))

    def current(self, local_name: str, view: View) -> torch.Tensor:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.current(local_name, view)
        x = self.inner.current(local_name, _real_view(view, real[1], local_name))
        return x.contiguous().view(self.wire).reshape(view.shape)

    def keep(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.keep(local_name, view, hash_fn)
        return self.inner.keep(local_name, _real_view(view, real[1], local_name), self._wire_hash(hash_fn))
