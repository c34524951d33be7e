"""Wire format of one message: the boxes of a (bucket, src, dst) group, packed back to back
in plan order. Both ends derive the same order from the plan, so no header is sent."""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import torch

from ..layout.descriptor import View, contiguous_strides
from ..plan.types import Transfer

__all__ = ["message_numel", "pack", "unpack"]


def message_numel(transfers: Sequence[Transfer]) -> int:
    return sum(t.box.numel for t in transfers)


def pack(transfers: Sequence[Transfer], tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy each transfer's source view into ``out`` (1-D, >= message size); returns the used
    part. One batched copy (``torch._foreach_copy_``: one dispatch for every box, a
    multi-tensor kernel on GPU) instead of one ``copy_`` per box."""
    dsts, srcs, pos = [], [], 0
    flats: dict[str, torch.Tensor] = {}
    base = out.storage_offset()
    for t in transfers:
        v = t.src_view
        dsts.append(out.as_strided(v.shape, _contiguous(v.shape), base + pos))
        srcs.append(_window(flats, tensors, t.src_name, v))
        pos += t.box.numel
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return out[:pos]


def unpack(transfers: Sequence[Transfer], buf: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Scatter a received message into the destination views (one batched copy); returns the
    views written, in wire order."""
    dsts, srcs, pos = [], [], 0
    flats: dict[str, torch.Tensor] = {}
    base = buf.storage_offset()
    for t in transfers:
        v = t.dst_view
        dsts.append(_window(flats, tensors, t.dst_name, v))
        srcs.append(buf.as_strided(v.shape, _contiguous(v.shape), base + pos))
        pos += t.box.numel
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return dsts


def _window(flats: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], name: str, v: View) -> torch.Tensor:
    """``local_view(tensors[name], v)``: one ``as_strided`` on the local tensor itself (local
    tensors are contiguous, as ``local_view`` requires, so ``v``'s offset and strides are
    those of its storage from the tensor's own offset on). ``flats`` caches the lookup."""
    t = flats.get(name)
    if t is None:
        t = flats[name] = tensors[name]
        if not t.is_contiguous():
            raise ValueError(f"{name}: local tensors must be contiguous to address them by flat views")
    return t.as_strided(v.shape, v.stride, t.storage_offset() + v.offset)


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return contiguous_strides(shape)
