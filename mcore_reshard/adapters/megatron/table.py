"""megatron-core's side of a family table (``layout.family``): each placement's shard rule.

A template is ``(local name, local shape, ((canonical, box, view), ...), dtype or None)``,
rank-free; ``rules.py`` computes them once per pipeline stage and TP / expert coordinate and
stamps them with every rank that holds them. What each placement means here (megatron-core
0.19.2):

* ``Rep``: the whole tensor (norms, router, a row-parallel linear's bias);
* ``Col``: ``ColumnParallelLinear`` row chunks; rows naming one local tensor are that
  tensor's parts, each chunked on its own (SwiGLU ``linear_fc1`` = ``[gate_r; up_r]``, the
  stride-2 sharding of the global ``[gate; up]``);
* ``RowPar``: ``RowParallelLinear`` column chunks;
* ``QKV``: ``linear_qkv``'s global rows interleaved per KV group ``[q_g; k_g; v_g]``
  (``attention.get_query_key_value_tensors``), chunked over TP: a chunk may end inside a group
  or a head;
* ``Vocab``: ``VocabParallelEmbedding`` rows of the padded vocab, rows ``>= V`` padding (no
  piece);
* ``Split``: a transposed or reshaped tensor (gpt-oss's stacked experts), chunked on one HF dim.

Pure metadata: no torch or megatron import.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from ...layout import Box, LayoutError, View, contiguous_strides
from ...layout.family import (QKV, Col, Family, Placement, Rep, Row, RowPar, Split, Vocab, col_runs, split_shape,
                              split_window, unit_runs)

__all__ = ["Tmpl", "row_templates"]

#: (local name, local shape, ((canonical, box, view), ...), dtype or None: the model's).
Tmpl = tuple


def _full(name: str, canonical: str, shape: tuple[int, ...]) -> Tmpl:
    """A replicated parameter that is the whole canonical tensor."""
    return (name, shape, ((canonical, Box.full(shape), View(0, shape, contiguous_strides(shape))),))


def _rows(local_row: int, canonical: str, row0: int, nrows: int, cols: int | None) -> tuple[str, Box, View]:
    """``nrows`` canonical rows from ``row0`` stored at local row ``local_row`` (dense, row-major)."""
    if cols is None:
        return (canonical, Box((row0,), (nrows,)), View(local_row, (nrows,), (1,)))
    return (canonical, Box((row0, 0), (nrows, cols)), View(local_row * cols, (nrows, cols), (cols, 1)))


def _rows_nd(local_row: int, canonical: str, row0: int, nrows: int, rest: tuple[int, ...]) -> tuple[str, Box, View]:
    """``_rows`` of a tensor of any rank: ``rest`` the trailing dims (a conv weight's ``(1, k)``)."""
    if len(rest) <= 1:
        return _rows(local_row, canonical, row0, nrows, rest[0] if rest else None)
    shape = (nrows, *rest)
    return (canonical, Box((row0,) + (0,) * len(rest), shape),
            View(local_row * math.prod(rest), shape, contiguous_strides(shape)))


def _qkv_pieces(spec: Any, tp: int, tp_r: int, attn: str, cols: int | None, suffix: str):
    """Pieces of the local ``linear_qkv`` chunk: intersect the rank's row range with each
    group's ``[q_g; k_g; v_g]`` runs of the interleaved global tensor."""
    hn, ng = spec.head_dim, spec.num_kv_heads
    P = spec.num_heads // ng
    members = [(f"{attn}{p}_proj.{suffix}", n * hn) for p, n in (("q", P), ("k", 1), ("v", 1))]
    return _interleaved(members, ng, tp, tp_r, cols)


def _interleaved(members: Sequence[tuple], groups: int, tp: int, tp_r: int, cols: int | None):
    """TP chunk ``tp_r`` of ``[m_0 group g; m_1 group g; ...]`` for g over ``groups``: the
    members' per-group rows interleaved, each member ``(canonical, n)``'s group g being its
    rows ``[g * n, (g + 1) * n)``, or ``(canonical, n, runs)``'s the HF row runs ``runs(g)``
    (``n`` rows in all). Returns (pieces, local rows)."""
    block = sum(m[1] for m in members)
    rows = groups * block // tp
    lo, hi = tp_r * rows, (tp_r + 1) * rows
    out = []
    for g in range(lo // block, -(-hi // block)):
        start = g * block
        for m in members:
            canonical, n = m[0], m[1]
            for row0, k in (m[2](g) if len(m) > 2 else ((g * n, n),)):
                a, b = max(lo, start), min(hi, start + k)
                if a < b:
                    out.append(_rows(a - lo, canonical, row0 + a - start, b - a, cols))
                start += k
    return tuple(out), rows


def _swiglu_fc1(name: str, gate: str, up: str, F: int, H: int, n: int, r: int) -> Tmpl:
    """Local ``[gate_r; up_r]``: the global ``[gate; up]`` sharded with stride 2."""
    f = F // n
    return (name, (2 * f, H), (_rows(0, gate, r * f, f, H), _rows(f, up, r * f, f, H)))


def _row_parallel(name: str, canonical: str, rows: int, K: int, n: int, r: int) -> Tmpl:
    """RowParallel weight ``[rows, K/n]``: column slice ``r`` of the canonical ``[rows, K]``."""
    k = K // n
    return (name, (rows, k), ((canonical, Box((0, r * k), (rows, k)), View(0, (rows, k), (k, 1))),))


def _col_parallel(name: str, canonical: str, rows: int, K: int, n: int, r: int) -> Tmpl:
    """ColumnParallel weight ``[rows/n, K]``: row chunk ``r`` of the canonical ``[rows, K]``."""
    k = rows // n
    return (name, (k, K), (_rows(0, canonical, r * k, k, K),))


def _vocab_rows(name: str, canonical: str, V: int, Vp: int, H: int, tp: int, r: int) -> Tmpl:
    """Vocab-parallel rows ``[r*Vp/tp, (r+1)*Vp/tp)``; rows >= V are padding (no piece)."""
    n = Vp // tp
    lo, hi = r * n, min((r + 1) * n, V)
    pieces = (_rows(0, canonical, lo, hi - lo, H),) if hi > lo else ()
    return (name, (n, H), pieces)


# --------------------------------------------------------------------------- the interpreter


class _Member:
    """One present row as a local tensor's part: its placement, canonical name and shape."""

    __slots__ = ("row", "pl", "canonical", "shape")

    def __init__(self, row: Row, pl: Placement, canonical: str, shape: tuple[int, ...]) -> None:
        self.row, self.pl, self.canonical, self.shape = row, pl, canonical, shape


def row_templates(fam: Family, rows: Sequence[Row], *, hf: str, local: Callable[[str], str], tp: int, tp_r: int,
                  te: bool, dims: Mapping[str, int], flags: frozenset[str], padded_vocab: int = 0,
                  expert: int | None = None, stacked: bool = False) -> list[Tmpl]:
    """Templates of ``rows`` (those present under ``flags``) on TP rank ``tp_r`` of ``tp``;
    rows naming one local tensor concatenate in table order. ``hf``: the canonical names'
    prefix (``model.layers.{i}.``), ``local(name)``: a placement's full local name;
    ``expert``: the routed expert these rows are (``{e}``, or index 0 of a stacked tensor)."""
    groups: dict[str, list[_Member]] = {}
    for row in rows:
        if not fam.present(row, flags):
            continue
        pl = row.megatron
        if pl is None:
            raise LayoutError(f"{fam.title}: megatron-core holds no {hf}{row.hf} (no such parameter in its "
                              f"modules); this layout cannot be trained there")
        if te and pl.te is not None:
            pl = pl.te
        canonical = hf + (row.hf.format(e=expert) if expert is not None and not stacked else row.hf)
        groups.setdefault(local(pl.name), []).append(_Member(row, pl, canonical, fam.resolve(row.shape, dims)))
    return [_group(fam, name, members, tp, tp_r, dims, padded_vocab, expert if stacked else None)
            for name, members in groups.items()]


def _group(fam: Family, name: str, members: list[_Member], tp: int, tp_r: int, dims: Mapping[str, int],
           padded_vocab: int, stacked_expert: int | None) -> Tmpl:
    kinds = {type(m.pl) for m in members}
    first = members[0]
    dtype = first.row.dtype
    if kinds == {QKV}:
        groups = int(dims["kv_heads"])
        cols = first.shape[1] if len(first.shape) == 2 else None
        pieces, rows = _interleaved([_qkv_member(fam, m, groups, dims) for m in members], groups, tp, tp_r, cols)
        return (name, (rows, cols) if cols else (rows,), pieces, dtype)
    if len(members) > 1 and not kinds <= {Rep, Col}:
        raise LayoutError(f"{fam.title}: {name} fuses {[m.canonical for m in members]} with {sorted(k.__name__ for k in kinds)}: "
                          f"only Rep and Col placements concatenate")
    if kinds == {Vocab}:
        V, H = first.shape
        return _vocab_rows(name, first.canonical, V, padded_vocab, H, tp, tp_r) + (dtype,)
    if kinds == {RowPar}:
        rows, K = first.shape
        if K % tp:
            raise LayoutError(f"{first.canonical}: {K} columns (a row-parallel linear) not divisible by tp={tp}")
        return _row_parallel(name, first.canonical, rows, K, tp, tp_r) + (dtype,)
    if kinds == {Split}:
        return _split(name, first, tp, tp_r, stacked_expert) + (dtype,)
    if len(members) == 1 and kinds == {Rep} and first.row.part is None:
        full = _full(name, first.canonical, first.shape)
        if first.pl.shape is not None:  # the same storage in megatron's own shape (CLIP's class_token)
            full = (name, fam.resolve(first.pl.shape, dims), full[2])
        return full + (dtype,)
    return _concat(fam, name, members, tp, tp_r, dims) + (dtype,)


def _qkv_member(fam: Family, m: _Member, groups: int, dims: Mapping[str, int]) -> tuple:
    """One row of a ``QKV`` group as ``_interleaved`` takes it: its rows per KV group, and
    (with ``parts``) the HF runs of group g: its units' first parts, then their second ..."""
    pl: QKV = m.pl  # type: ignore[assignment]
    if m.row.part is not None:  # one part of a fused HF tensor (Qwen3-VL's [q; k; v]): its rows per group
        off, rows = fam.resolve(m.row.part, dims)
        if rows % groups or pl.parts:
            raise LayoutError(f"{fam.title}: {m.canonical}: part of {rows} rows does not split in {groups} groups")
        n = rows // groups
        return (m.canonical, n, lambda g: ((off + g * n, n),))
    n = m.shape[0] // groups
    if not pl.parts:
        return (m.canonical, n)
    units = fam.resolve((pl.units,), dims)[0] if pl.units is not None else 0
    if not units or units % groups or m.shape[0] % units:
        raise LayoutError(f"{fam.title}: {m.canonical}: {units} units do not split {m.shape[0]} rows in {groups} groups")
    per, unit = units // groups, m.shape[0] // units
    parts = [fam.resolve(p, dims) for p in pl.parts]
    return (m.canonical, n, lambda g: unit_runs(0, unit, range(g * per, (g + 1) * per), parts))


def _concat(fam: Family, name: str, members: list[_Member], tp: int, tp_r: int, dims: Mapping[str, int]) -> Tmpl:
    """Rep / Col parts of one local tensor, each rank's part of each after the previous one's
    (a Col with ``parts``: its runs of each of the rank's units, part by part)."""
    rest = members[0].shape[1:]
    pieces, at = [], 0
    for m in members:
        if m.shape[1:] != rest:
            raise LayoutError(f"{fam.title}: {name} concatenates {m.canonical} {m.shape}: parts must share the "
                              f"trailing dims {rest}")
        off, n = (0, m.shape[0]) if m.row.part is None else fam.resolve(m.row.part, dims)
        runs = [(off, n)]
        if isinstance(m.pl, Col) and not m.pl.parts:
            if n % tp:
                raise LayoutError(f"{m.canonical}: {n} rows (a column-parallel part of {name}) not divisible by tp={tp}")
            runs = [(off + tp_r * (n // tp), n // tp)]
        elif isinstance(m.pl, Col):
            runs = col_runs(f"{m.canonical} (a column-parallel part of {name})", m.pl, off, n, tp, tp_r,
                            lambda d: fam.resolve(d, dims), replicate=False)
        for row0, k in runs:
            pieces.append(_rows_nd(at, m.canonical, row0, k, rest))
            at += k
    return (name, (at, *rest), tuple(pieces))


def _split(name: str, m: _Member, tp: int, tp_r: int, expert: int | None) -> Tmpl:
    """A ``Split`` placement: the local tensor is ``[prod(rows dims), prod(cols dims)]``, each
    group of HF dims row-major (so a transpose, or gate and up de-interleaved)."""
    pl: Split = m.pl  # type: ignore[assignment]
    geo = split_window(m.canonical, m.shape, pl, tp, tp_r, expert, 0)
    if geo is None:
        return (name, split_shape(m.shape, pl, tp, expert), ())
    return (name, split_shape(m.shape, pl, tp, expert), ((m.canonical, geo.box, geo.view),))
