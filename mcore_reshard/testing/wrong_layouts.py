"""Layouts wrong the same way on both sides: what checksums cannot see (``tests/test_canary.py``).

A refit's checksums compare what each receiver holds with what its sender packed, so a
descriptor that names the wrong rows of a tensor -- a family table with two heads swapped,
say -- moves the wrong bytes faithfully and verifies. :func:`swap_canonical_rows` makes such a
layout from a correct one: the source ranks' pieces say that rows ``[a, a+n)`` of a canonical
tensor are where rows ``[b, b+n)`` really are, and the other way round. The plan stays exact
(every element once, bytes at the minimum); only what the engine computes can tell.
"""

from __future__ import annotations

from dataclasses import replace

from ..layout.descriptor import Box, LocalParam, Piece, SideLayout

__all__ = ["swap_canonical_rows"]


def _split_rows(piece: Piece, cuts: list[int]) -> list[Piece]:
    """``piece`` cut along dimension 0 at the canonical rows ``cuts``."""
    lo, hi = piece.box.offsets[0], piece.box.offsets[0] + piece.box.sizes[0]
    edges = sorted({lo, hi, *(c for c in cuts if lo < c < hi)})
    out = []
    for a, b in zip(edges, edges[1:]):
        inner = Box((a, *piece.box.offsets[1:]), (b - a, *piece.box.sizes[1:]))
        out.append(Piece(piece.rank, piece.local_name, piece.canonical, inner, piece.view.sub(piece.box, inner)))
    return out


def swap_canonical_rows(side: SideLayout, canonical: str, a: int, b: int, n: int) -> SideLayout:
    """``side`` with rows ``[a, a+n)`` and ``[b, b+n)`` of ``canonical`` swapped in every piece
    (e.g. two attention heads of a ``q_proj``: ``n`` = head_dim)."""
    if not (a + n <= b or b + n <= a):
        raise ValueError(f"rows [{a}, {a + n}) and [{b}, {b + n}) overlap")
    cuts = [a, a + n, b, b + n]

    def moved(p: Piece) -> Piece:
        r = p.box.offsets[0]
        shift = b - a if a <= r < a + n else a - b if b <= r < b + n else 0
        if not shift:
            return p
        return replace(p, box=Box((r + shift, *p.box.offsets[1:]), p.box.sizes))

    params = []
    for lp in side.params:
        pieces = []
        for p in lp.pieces:
            pieces += [moved(q) for q in _split_rows(p, cuts)] if p.canonical == canonical else [p]
        params.append(LocalParam(lp.rank, lp.name, lp.shape, lp.dtype, tuple(pieces)))
    if all(p is q for p, q in zip(params, side.params)):
        raise ValueError(f"{canonical} is not a tensor of {side.name}")
    return replace(side, params=tuple(params))
