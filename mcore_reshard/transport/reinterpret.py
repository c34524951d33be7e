"""Tensors a plan carries as their bits (``RankPlan.reinterpret``), seen in wire units.

The wire dtype is the destination dtype (the planner's byte budget is in it); a source of
another dtype is cast while packing. A tensor the plan carries as its bits instead (e.g. an fp32
router bias in a bf16 refit) is viewed as the wire dtype on both ends: ``WireTensors`` on the
source, ``ReinterpretSink`` on the destination. So the executor only sees wire units, the sink
only real ones.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch

from ..layout.descriptor import View
from .views import TORCH_DTYPES
from .sink import Sink, baseline_of

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
    (name -> real dtype name), addressed in wire elements, is resolved by ``inner`` at the real
    view and handed back as the same memory seen as wire elements, so the transport writes,
    patches and hashes the same bytes on both ends. Other names pass through."""

    def __init__(self, inner: Sink, real: Mapping[str, str], wire: torch.dtype) -> None:
        self.inner, self.wire = inner, wire
        w = torch.empty((), dtype=wire).element_size()
        self.real = {n: (TORCH_DTYPES[d], TORCH_DTYPES[d].itemsize // w) for n, d in real.items()}
        self.params = getattr(inner, "params", None)
        if baseline_of(inner) is not None:
            self.baseline = self._baseline

    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        return (x if x.stride(-1) == 1 else x.contiguous()).view(self.wire)

    def resolve(self, name: str, view: View) -> torch.Tensor:
        real = self.real.get(name)
        if real is None:
            return self.inner.resolve(name, view)
        x = self.inner.resolve(name, _real_view(view, real[1], name))
        if x.dtype != real[0] or x.stride(-1) != 1:
            raise ValueError(f"{name}: the sink resolves it as {x.dtype} (stride {x.stride()}), the plan carries "
                             f"its {real[0]} bits")
        return x.view(self.wire)

    def commit_box(self, name: str, view: View) -> None:
        real = self.real.get(name)
        self.inner.commit_box(name, view if real is None else _real_view(view, real[1], name))

    def _baseline(self, name: str, view: View) -> torch.Tensor:
        real = self.real.get(name)
        if real is None:
            return self.inner.baseline(name, view)
        return self._wire(self.inner.baseline(name, _real_view(view, real[1], name)))
