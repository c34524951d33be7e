"""Descriptors: which piece of which canonical (HF-named) tensor a rank holds, and where.

The vocabulary follows torch.distributed.checkpoint: a chunk is ``offsets`` + ``sizes``
(:class:`Box`). What DCP leaves implicit -- where the chunk sits inside the local tensor --
is an explicit strided view (:class:`View`), because fused parameters (QKV, ``[gate; up]``,
stacked experts) place several canonical chunks in one local tensor at non-trivial strides.

One type, :class:`Piece`, describes every local shard on both sides, like megatron's
``ShardedTensor``: the planner never needs to know which library produced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

__all__ = [
    "DTYPE_BYTES",
    "Box",
    "View",
    "Piece",
    "LocalParam",
    "SideLayout",
    "contiguous_strides",
    "unravel",
    "LayoutError",
]

#: Element size of the dtypes a refit can carry (names as in ``torch.<name>``).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
    "int32": 4,
    "int64": 8,
}


class LayoutError(ValueError):
    """A layout is impossible or inconsistent; the message names the parameter and the rule."""


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of ``shape`` (in elements)."""
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return tuple(reversed(strides))


def unravel(offset: int, shape: Sequence[int]) -> list[int]:
    """Coordinates of flat element ``offset`` of a contiguous tensor of ``shape``."""
    coords = []
    for stride in contiguous_strides(shape):
        coords.append(offset // stride)
        offset %= stride
    return coords


@dataclass(frozen=True, slots=True)
class Box:
    """A hyper-rectangle of a canonical tensor: per-dim start and length."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    #: Cached element count (plans touch it millions of times).
    numel: int = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.sizes))

    def intersect(self, other: "Box") -> "Box | None":
        """The common sub-box, or None when the boxes do not overlap."""
        offs, sizes = [], []
        for a0, an, b0, bn in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo = a0 if a0 > b0 else b0
            hi = min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def contains(self, other: "Box") -> bool:
        # a loop, not ``all(<generator>)``: the relays ask once per transfer (~300k)
        for a0, an, b0, bn in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            if b0 < a0 or b0 + bn > a0 + an:
                return False
        return True

    @staticmethod
    def full(shape: Sequence[int]) -> "Box":
        return Box((0,) * len(shape), tuple(shape))


@dataclass(frozen=True, slots=True)
class View:
    """Where a box lives in a local tensor: ``local.flatten().as_strided(shape, stride, offset)``.

    ``shape`` always equals the box's ``sizes``; element ``i`` of the box (box-relative
    index) is local flat element ``offset + sum(i[d] * stride[d])``.
    """

    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def sub(self, outer: Box, inner: Box) -> "View":
        """The view of ``inner`` (a sub-box of ``outer``, which this view describes)."""
        off = self.offset
        for o, i, s in zip(outer.offsets, inner.offsets, self.stride):
            off += (i - o) * s
        return View(off, inner.sizes, self.stride)

    def extent(self) -> tuple[int, int]:
        """``[first, last + 1)`` flat local indices the view can touch."""
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return self.offset, last + 1

    def is_contiguous(self) -> bool:
        """True when the view is one dense run of memory (size-1 dims ignored)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size == 1:
                continue
            if stride != expected:
                return False
            expected *= size
        return True

    def elements(self) -> Iterable[int]:
        """Flat local indices covered (slow; for checks on small layouts)."""
        idx = [self.offset]
        for size, stride in zip(self.shape, self.stride):
            idx = [base + k * stride for base in idx for k in range(size)]
        return idx


@dataclass(frozen=True, slots=True)
class Piece:
    """Rank ``rank`` holds ``box`` of canonical tensor ``canonical`` in its local
    parameter ``local_name`` at ``view``. The unit both sides are described in."""

    rank: int
    local_name: str
    canonical: str
    box: Box
    view: View

    @property
    def numel(self) -> int:
        return self.box.numel


@dataclass(frozen=True, slots=True)
class LocalParam:
    """One local tensor of one rank and the pieces it is made of.

    Elements of the local tensor covered by no piece are padding (e.g. vLLM's pad64 vocab
    rows): the receiving side zero-fills them locally, they are never sent.
    """

    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def padding(self) -> int:
        return self.numel - sum(p.numel for p in self.pieces)


@dataclass(frozen=True)
class SideLayout:
    """Every local parameter of every rank of one side (training or inference).

    ``tensors`` maps canonical name -> (global shape, dtype) so the planner can check both
    sides describe the same model before anything moves.
    """

    name: str
    world_size: int
    params: tuple[LocalParam, ...]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    notes: tuple[str, ...] = ()
    #: (canonical tensor, dtype held) of the tensors this side quantizes before sending
    #: (``layout.quant``): described in ``tensors``' dtype (FP8), held in the other one.
    quantize: tuple[tuple[str, str], ...] = ()
    #: (canonical tensor, factor) of the tensors this side holds multiplied by ``factor``
    #: (a destination: vLLM folds a LoRA adapter's ``alpha / r`` into its B, ``layout.lora``);
    #: the senders multiply while packing (the plan's ``lora`` pass).
    scale: tuple[tuple[str, float], ...] = ()

    def pieces(self) -> Iterable[Piece]:
        for p in self.params:
            yield from p.pieces

    def for_rank(self, rank: int) -> tuple[LocalParam, ...]:
        return tuple(p for p in self.params if p.rank == rank)
