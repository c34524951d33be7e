"""Wire format of one message: the boxes of a (bucket, src, dst) group, packed back to back
in plan order. Both ends derive the same order from the plan, so no header is sent."""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Mapping, Sequence

import torch

from ..layout.descriptor import View, contiguous_strides
from ..plan.types import Transfer

__all__ = ["message_numel", "pack", "unpack", "unpack_into"]


def message_numel(transfers: Sequence[Transfer]) -> int:
    return sum(t.box.numel for t in transfers)


#: Boxes of at most this many bytes that are one dense run in a contiguous CPU tensor of the
#: wire dtype move by one bounds-checked ``memmove`` each (about 2 us, against about 9 us for
#: two strided views and their share of a batched copy): a full-size plan's per-transfer cost is
#: mostly small boxes. Larger ones, strided ones and device tensors take the batched copy.
RAW_MAX_BYTES = 64 << 10

_memmove = ctypes.memmove


def pack(transfers: Sequence[Transfer], tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy each transfer's source view into ``out`` (1-D, >= message size); returns the used
    part. Small dense boxes on CPU by ``memmove``; the rest in one batched copy
    (``torch._foreach_copy_``: one dispatch for every box, a multi-tensor kernel on GPU)."""
    dsts, srcs, pos = [], [], 0
    seen: dict[str, torch.Tensor] = {}
    base = out.storage_offset()
    raw = _Raw(out)
    for t in transfers:
        v = t.src_view
        n = t.box.numel
        if raw.ok and raw.copy(tensors, t.src_name, v, n, pos, to_buffer=True):
            pos += n
            continue
        dsts.append(out.as_strided(v.shape, _contiguous(v.shape), base + pos))
        srcs.append(_window(seen, tensors, t.src_name, v))
        pos += n
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return out[:pos]


def unpack(transfers: Sequence[Transfer], buf: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> list[Any]:
    """Scatter a received message into the destination views (small dense boxes on CPU by
    ``memmove``, the rest in one batched copy); returns what was written, in wire order: a
    view, or ``(address, nbytes)`` of a box moved by ``memmove`` (see ``checksum.digest_at``)."""
    dsts, srcs, written, pos = [], [], [], 0
    seen: dict[str, torch.Tensor] = {}
    base = buf.storage_offset()
    raw = _Raw(buf)
    for t in transfers:
        v = t.dst_view
        n = t.box.numel
        if raw.ok:
            at = raw.copy(tensors, t.dst_name, v, n, pos, to_buffer=False)
            if at:
                written.append(at)
                pos += n
                continue
        d = _window(seen, tensors, t.dst_name, v)
        dsts.append(d)
        srcs.append(buf.as_strided(v.shape, _contiguous(v.shape), base + pos))
        written.append(d)
        pos += n
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return written


def unpack_into(targets: Sequence[torch.Tensor], buf: torch.Tensor) -> list[Any]:
    """Copy a message's boxes, back to back in ``buf``, into ``targets`` (each box's resolved
    tensor, in wire order): small dense ones on CPU by ``memmove``, the rest in one batched
    copy. Returns what was written, in wire order, as ``unpack`` does."""
    dsts, srcs, written, pos = [], [], [], 0
    base = buf.storage_offset()
    raw = _Raw(buf)
    for x in targets:
        n = x.numel()
        if raw.ok and n <= raw.max_n and pos + n <= raw.room and x.dtype == raw.dtype and \
                x.device.type == "cpu" and x.is_contiguous():
            nbytes = n * raw.isz
            _memmove(x.data_ptr(), raw.addr + pos * raw.isz, nbytes)
            written.append((x.data_ptr(), nbytes))
        else:
            dsts.append(x)
            srcs.append(buf.as_strided(x.shape, _contiguous(tuple(x.shape)), base + pos))
            written.append(x)
        pos += n
    if pos > buf.numel():
        raise ValueError(f"message of {buf.numel()} elements holds fewer than its {pos}")
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    return written


class _Raw:
    """``memmove`` between a CPU message buffer and its tensors' dense runs, every copy
    bounds-checked against both tensors (Python ints: cheap next to any torch call)."""

    __slots__ = ("ok", "dtype", "isz", "addr", "room", "max_n", "bases")

    def __init__(self, buf: torch.Tensor) -> None:
        self.ok = buf.device.type == "cpu" and buf.is_contiguous()
        if self.ok:
            self.dtype, self.isz, self.addr, self.room = buf.dtype, buf.element_size(), buf.data_ptr(), buf.numel()
            self.max_n = RAW_MAX_BYTES // self.isz
            self.bases: dict[str, tuple[int, int] | None] = {}

    def copy(self, tensors: Mapping[str, torch.Tensor], name: str, v: View, n: int, pos: int,
             to_buffer: bool) -> tuple[int, int] | None:
        """Move box ``v`` (``n`` elements) of ``tensors[name]`` to or from the buffer at
        ``pos``; returns (address, nbytes) in the tensor, or None where it does not qualify."""
        if n > self.max_n or pos + n > self.room or not _dense(v.shape, v.stride):
            return None
        at = self.bases.get(name, False)
        if at is False:
            x = tensors[name]
            at = self.bases[name] = ((x.data_ptr(), x.numel()) if x.device.type == "cpu" and x.dtype == self.dtype
                                     and x.is_contiguous() else None)
        if at is None or v.offset < 0 or v.offset + n > at[1]:
            return None
        nbytes = n * self.isz
        there = at[0] + v.offset * self.isz
        here = self.addr + pos * self.isz
        if to_buffer:
            _memmove(here, there, nbytes)
        else:
            _memmove(there, here, nbytes)
        return there, nbytes


@functools.lru_cache(maxsize=4096)
def _dense(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return View(0, shape, stride).is_contiguous()


def _window(seen: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], name: str, v: View) -> torch.Tensor:
    """``local_view(tensors[name], v)``: one ``as_strided`` on the local tensor itself (local
    tensors are contiguous, as ``local_view`` requires, so ``v``'s offset and strides are
    those of its storage from the tensor's own offset on). ``seen``: tensors already looked
    up and checked in this message."""
    t = seen.get(name)
    if t is None:
        t = seen[name] = tensors[name]
        if not t.is_contiguous():
            raise ValueError(f"{name}: local tensors must be contiguous to address them by flat views")
    return t.as_strided(v.shape, v.stride, t.storage_offset() + v.offset)


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    return contiguous_strides(shape)
