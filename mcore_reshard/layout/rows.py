"""A rank that holds only some rows of a local tensor: its pieces, cut to those rows.

Megatron-FSDP (``use_megatron_fsdp``, NeMo RL's ``use_custom_fsdp``) shards each parameter's
TP-local tensor over the data-parallel ranks as a flat slice of its bucket, padded so that
every slice is whole rows (``make_fsdp_dtensor`` views it as ``(-1, *shape[1:])``). A rank
then holds rows ``[start, start + rows)`` of the tensor that megatron's rules describe. The
pieces of that tensor (fused QKV's per-group blocks, ``[gate; up]``'s halves, a vocab shard)
are cut to those rows: each stays one box of its canonical tensor, because megatron's fused
layouts walk the local rows along one box dimension. A piece the rows would cut within a row
of the box (not a box any more) is refused in one line.

The same cut describes any source whose ranks hold row ranges of the tensors another layout
describes whole; nothing here knows Megatron.
"""

from __future__ import annotations

import math

from .descriptor import Box, LayoutError, LocalParam, Piece, View

__all__ = ["rows_of"]


def _cut(piece: Piece, row_len: int, start: int, stop: int) -> Piece | None:
    """``piece`` restricted to local rows ``[start, stop)`` and re-based on them; None where
    it holds none of them."""
    v = piece.view
    lo, hi = v.extent()
    a, b = start * row_len, stop * row_len
    if hi <= a or lo >= b:
        return None
    if a <= lo and hi <= b:  # wholly inside: only the base moves
        return Piece(piece.rank, piece.local_name, piece.canonical, piece.box, View(v.offset - a, v.shape, v.stride))
    # One box dimension walks the local rows (its stride a multiple of a row); every other
    # dimension stays inside one row from the view's first element.
    walking = [d for d, (n, s) in enumerate(zip(v.shape, v.stride)) if n > 1 and s % row_len == 0]
    within = (v.offset % row_len) + sum((n - 1) * s for d, (n, s) in enumerate(zip(v.shape, v.stride))
                                        if d not in walking)
    if len(walking) != 1 or within >= row_len:
        raise LayoutError(f"{piece.local_name}: rows [{start}, {stop}) of the local tensor cut its piece of "
                          f"{piece.canonical} at {piece.box.offsets} within a row of the box: not one box "
                          f"(a shard boundary the planner cannot cut)")
    d = walking[0]
    step = v.stride[d] // row_len  # local rows per index of dimension d
    first = v.offset // row_len
    i0 = max(0, -(-(start - first) // step))
    i1 = min(v.shape[d], -(-(stop - first) // step))
    if i0 >= i1:
        return None
    offsets = list(piece.box.offsets)
    sizes = list(piece.box.sizes)
    offsets[d] += i0
    sizes[d] = i1 - i0
    box = Box(tuple(offsets), tuple(sizes))
    return Piece(piece.rank, piece.local_name, piece.canonical, box,
                 View(v.offset + i0 * v.stride[d] - a, box.sizes, v.stride))


def rows_of(param: LocalParam, start: int, rows: int) -> LocalParam:
    """``param`` as a rank holding only its rows ``[start, start + rows)`` (dimension 0) holds
    it: the local tensor is those rows, each piece cut to them (pieces with none dropped)."""
    if not param.shape:
        raise LayoutError(f"{param.name}: a scalar has no rows to shard")
    total = param.shape[0]
    if start < 0 or rows < 0 or start + rows > total:
        raise LayoutError(f"{param.name}: rows [{start}, {start + rows}) are not within its {total} rows")
    row_len = math.prod(param.shape[1:])
    pieces = tuple(p for p in (_cut(q, row_len, start, start + rows) for q in param.pieces) if p is not None)
    return LocalParam(param.rank, param.name, (rows, *param.shape[1:]), param.dtype, pieces)
