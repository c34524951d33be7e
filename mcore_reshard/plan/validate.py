"""Phase 1 of the planner: check both sides before anything is intersected, and choose the
element type on the wire.

``check_sides``     both sides describe the same canonical tensors (name, shape, dtype); a
                    dtype that differs is an error unless casts are allowed, then it is
                    recorded (the sender casts while packing).
``wire_dtype``      one element type per refit; a wider tensor both sides hold alike is
                    carried as its bits (``reinterpreted``: both sides in wire units).
``index_sources``   unique source boxes per tensor, each with its replicas; the boxes must
                    tile every tensor exactly (no gap, no overlap).
``check_dest``      every destination piece lies inside its tensor and no two pieces of one
                    local tensor overlap (so every destination element is written once).

Every refusal is a ``PlanError`` naming the parameter. Local tensors repeated across ranks
(``param_kinds``) and across layers (``_check_like``) are checked once.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from typing import NamedTuple, Sequence

from ..layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View
from ..layout.memo import IdentityCache
from .types import PlanError, Transfer, TransferPlan

__all__ = ["Replica", "check_sides", "index_sources", "check_dest", "param_kinds", "wire_dtype", "reinterpreted",
           "check_whole_elements", "first_uncovered"]


class Replica(NamedTuple):
    """A source rank holding one unique box, and where it holds it."""

    rank: int
    name: str
    view: View


#: ``Replica`` from one tuple, without the Python-level ``__new__`` of a named tuple.
_new_replica = functools.partial(tuple.__new__, Replica)
#: Attributes ``param_kinds`` and ``_check_like`` key on (C-level getters: once per local tensor).
_CANONICAL, _BOX, _VIEW = (operator.attrgetter(a) for a in ("canonical", "box", "view"))

def check_sides(src: SideLayout, dst: SideLayout, *, allow_cast: bool = False) -> tuple[tuple[str, str, str], ...]:
    """Both sides must describe the same canonical tensors, or the refit would be wrong.

    Element types may differ per tensor only with ``allow_cast`` (the sender casts while
    packing). Returns the casts, (tensor, source dtype, destination dtype), in the
    destination's tensor order.
    """
    casts: list[tuple[str, str, str]] = []
    missing = sorted(set(dst.tensors) - set(src.tensors))
    if missing:
        raise PlanError(
            f"destination needs {len(missing)} tensor(s) the source does not describe, e.g. {missing[0]!r}"
        )
    for name, (shape, dtype) in dst.tensors.items():
        s_shape, s_dtype = src.tensors[name]
        if tuple(s_shape) != tuple(shape):
            raise PlanError(f"{name}: source shape {tuple(s_shape)} != destination shape {tuple(shape)}")
        if s_dtype != dtype:
            if not allow_cast:
                raise PlanError(
                    f"{name}: source dtype {s_dtype} != destination dtype {dtype} "
                    f"(no explicit cast; set refit.allow_cast=true to cast while packing)"
                )
            casts.append((name, s_dtype, dtype))
    unneeded = sorted(set(src.tensors) - set(dst.tensors))
    if unneeded:
        raise PlanError(
            f"source tensor {unneeded[0]!r} (and {len(unneeded) - 1} more) has no place on the destination"
        )
    return tuple(casts)


#: ``index_sources`` of the last source layout, by identity: a placement's candidates (direct
#: and relayed) are planned from one source side. Read only by the planner.
_INDEXED = IdentityCache(1)


def index_sources(src: SideLayout) -> dict[str, dict[Box, list[Replica]]]:
    """Unique boxes per canonical tensor with the replicas holding each, checked to tile it
    (the same object for the same layout object: callers only read it)."""
    return _INDEXED.get((src,), None, lambda: _index_sources(src))


def _index_sources(src: SideLayout) -> dict[str, dict[Box, list[Replica]]]:
    index: dict[str, dict[Box, list[Replica]]] = defaultdict(dict)
    found: dict[tuple, list[Replica]] = {}  # the same lists, keyed by plain tuples: cheaper to hash than Box
    tensors = src.tensors
    for param in src.params:
        for piece in param.pieces:
            spec = tensors.get(piece.canonical)
            if spec is not None and spec[1] != param.dtype:
                check_param_dtype(param, src, "source")  # raises, naming the first such tensor
            box = piece.box
            key = (piece.canonical, box.offsets, box.sizes)
            reps = found.get(key)
            if reps is None:
                reps = found[key] = index[piece.canonical][box] = []
            reps.append(_new_replica((piece.rank, piece.local_name, piece.view)))
    for name, (shape, _dtype) in src.tensors.items():
        boxes = index.get(name)
        if not boxes:
            raise PlanError(f"{name}: no source rank holds any part of it")
        _check_tiling(name, shape, list(boxes), "source")
    return index


def _check_tiling(name: str, shape: Sequence[int], boxes: list[Box], side: str) -> None:
    if len(boxes) == 1 and boxes[0].sizes == tuple(shape) and not any(boxes[0].offsets):
        return  # one box, the whole tensor: most tensors (replicated, or one expert on one rank)
    total = math.prod(shape)
    full = Box.full(shape)
    covered = 0
    for b in boxes:
        if not full.contains(b):
            raise PlanError(f"{name}: {side} box {b} lies outside the tensor shape {tuple(shape)}")
        covered += b.numel
    if covered != total or _has_overlap(boxes):
        gap = total - covered
        what = "overlapping boxes" if gap <= 0 else f"{gap} elements held by no rank"
        raise PlanError(f"{name}: {side} boxes do not tile the tensor exactly ({what})")


def _has_overlap(boxes: list[Box]) -> bool:
    if len(boxes) < 2:
        return False
    # Sweep along the first dimension; boxes are few per tensor.
    boxes = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):
        end0 = a.offsets[0] + a.sizes[0] if a.offsets else 0
        for b in boxes[i + 1 :]:
            if b.offsets and b.offsets[0] >= end0:
                break
            if a.intersect(b) is not None:
                return True
    return False


_Lengths = dict[tuple[tuple[int, ...], tuple[int, ...]], int]  # (view shape, stride) -> extent length


def check_dest(dst: SideLayout, kinds: list[int] | None = None) -> list[tuple[int, str, int]]:
    """Validate destination pieces; return the padding each local tensor zero-fills itself.

    ``kinds`` (see ``param_kinds``) lets a local tensor repeated on other ranks be checked
    once, and one repeated on other layers too (``_check_like``).
    """
    if kinds is None:
        kinds = param_kinds(dst)
    padding = []
    inside: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()  # (tensor, offsets, sizes) checked
    lengths: _Lengths = {}
    checked: dict[int, int] = {}  # kind -> elements its pieces cover
    alike: dict[tuple, int] = {}  # the same, by ``_check_like``
    for param, kind in zip(dst.params, kinds):
        covered = checked.get(kind)
        if covered is None:
            like = _check_like(param, dst.tensors)
            covered = alike.get(like)
            if covered is None:
                covered = alike[like] = _check_dest_param(param, dst, inside, lengths)
            checked[kind] = covered
        numel = param.numel
        if numel != covered:
            padding.append((param.rank, param.name, numel - covered))
    return padding


def _check_like(param: LocalParam, tensors: dict[str, tuple[tuple[int, ...], str]]) -> tuple:
    """What checking a destination local tensor depends on: its shape and dtype, and per piece
    its tensor's shape and dtype (not its name), box and view (by identity). Every layer of a
    model repeats the same local tensors over other tensor names: checked once for all."""
    pieces = param.pieces
    if len(pieces) == 1:  # cheap either way: not worth a key
        return (id(param),)
    specs = []
    for name in map(_CANONICAL, pieces):
        spec = tensors.get(name)
        specs.append(spec if spec is None else (tuple(spec[0]), spec[1]))
    return (param.shape, param.dtype, tuple(specs), tuple(map(id, map(_BOX, pieces))),
            tuple(map(id, map(_VIEW, pieces))))


def param_kinds(side: SideLayout) -> list[int]:
    """Number each local tensor by what it is apart from its rank: name, shape, dtype and its
    pieces' tensors, boxes and views (by identity: layouts share them across ranks, and equal
    objects under different identities only cost a repeated check). Replicated engines and
    data-parallel ranks repeat every local tensor, so per-tensor work is done once per kind."""
    found: dict[tuple, int] = {}
    kinds = []
    for p in side.params:
        pieces = p.pieces
        if len(pieces) == 1:  # most local tensors: a flat key (a str where others hold tuples)
            q = pieces[0]
            key = (p.name, p.shape, p.dtype, q.canonical, id(q.box), id(q.view))
        else:
            key = (p.name, p.shape, p.dtype, tuple(map(_CANONICAL, pieces)), tuple(map(id, map(_BOX, pieces))),
                   tuple(map(id, map(_VIEW, pieces))))
        kinds.append(found.setdefault(key, len(found)))
    return kinds


def _check_dest_param(
    param: LocalParam, dst: SideLayout, inside: set[tuple[str, tuple[int, ...], tuple[int, ...]]], lengths: _Lengths
) -> int:
    """Check one destination local tensor; return the elements its pieces cover."""
    check_param_dtype(param, dst, "destination")
    covered = 0
    for piece in param.pieces:
        box = piece.box
        key = (piece.canonical, box.offsets, box.sizes)
        if key not in inside:
            shape, _ = dst.tensors.get(piece.canonical, (None, None))
            if shape is None:
                raise PlanError(f"{param.name} (rank {param.rank}): unknown canonical tensor {piece.canonical!r}")
            if not _inside(shape, box):
                raise PlanError(f"{param.name} (rank {param.rank}): box {box} outside {piece.canonical} {shape}")
            inside.add(key)
        if piece.view.shape != box.sizes:
            raise PlanError(f"{param.name} (rank {param.rank}): view shape {piece.view.shape} != box {box.sizes}")
        covered += box.numel
    _check_disjoint_views(param, param.numel, lengths)
    return covered


def _inside(shape: Sequence[int], box: Box) -> bool:
    """``Box.full(shape).contains(box)``, without building the full box (once per piece)."""
    return all(0 <= o and o + n <= size for size, o, n in zip(shape, box.offsets, box.sizes))


def check_param_dtype(param: LocalParam, side: SideLayout, what: str) -> None:
    """A local tensor holds its side's element type of every canonical tensor it carries
    (checked against that side's own table: a source may mix dtypes, e.g. an fp32 router)."""
    tensors, prev = side.tensors, None
    for piece in param.pieces:
        canonical = piece.canonical
        if canonical == prev:
            continue
        prev = canonical
        _, dtype = tensors.get(canonical, (None, param.dtype))
        if dtype != param.dtype:
            raise PlanError(f"{param.name} ({what} rank {param.rank}) holds {param.dtype} but {canonical} is {dtype}")


def _check_disjoint_views(param: LocalParam, numel: int, lengths: _Lengths) -> None:
    """No local element is written twice; exact element sets only when extents interleave.

    ``lengths`` caches extent lengths by (shape, stride): views repeat across pieces and ranks.
    """
    spans = []  # (first, last + 1, piece index): sorted, the pieces in extent order
    for i, p in enumerate(param.pieces):
        view = p.view
        n = lengths.get((view.shape, view.stride))
        if n is None:
            lo, hi = view.extent()
            n = lengths[(view.shape, view.stride)] = hi - lo
        spans.append((view.offset, view.offset + n, i))
    if len(spans) > 1:
        spans.sort()
    interleaved = False
    for lo, hi, i in spans:
        if lo < 0 or hi > numel:
            raise PlanError(
                f"{param.name} (rank {param.rank}): piece of {param.pieces[i].canonical} reaches outside the local tensor"
            )
    for (_, hi_a, _), (lo_b, _, _) in zip(spans, spans[1:]):
        if lo_b < hi_a:
            interleaved = True
            break
    if not interleaved:
        return
    if numel > 1 << 22:
        raise PlanError(f"{param.name} (rank {param.rank}): interleaved pieces too large to prove disjoint")
    seen: set[int] = set()
    for p in param.pieces:
        els = p.view.elements()
        before = len(seen)
        seen.update(els)
        if len(seen) - before != p.numel:
            raise PlanError(f"{param.name} (rank {param.rank}): piece of {p.canonical} overlaps another piece")


def wire_dtype(dst: SideLayout, casts: Sequence[tuple[str, str, str]] = ()) -> tuple[str, tuple[tuple[str, str], ...]]:
    """One element type per refit: the wire carries the destination's -- of its narrowest dtypes
    the one holding most of its elements (the first in its table on a tie). A tensor in a wider dtype that is a whole
    number of wire elements (fp32 = 2 x bf16), held so on both sides (not a cast), is carried
    as its bits reinterpreted: returned as (tensor, real dtype), in the destination's order.
    Anything else in another dtype is an error."""
    first: dict[str, str] = {}
    numel: dict[str, int] = defaultdict(int)
    for name, (shape, d) in dst.tensors.items():
        first.setdefault(d, name)
        numel[d] += math.prod(shape)
    if len(first) == 1:
        return next(iter(first)), ()
    order = list(first)
    narrowest = min(DTYPE_BYTES[d] for d in order)  # FP8 engines: 1-byte codes beside bf16 and fp32 tensors
    wire = max((d for d in order if DTYPE_BYTES[d] == narrowest), key=lambda d: (numel[d], -order.index(d)))
    w = DTYPE_BYTES[wire]
    cast = {c[0] for c in casts}
    reinterpret, bad = [], {}
    for name, (shape, d) in dst.tensors.items():
        if d == wire:
            continue
        if name in cast or not shape or DTYPE_BYTES[d] <= w or DTYPE_BYTES[d] % w:
            bad.setdefault(d, name)
        else:
            reinterpret.append((name, d))
    if bad:
        raise PlanError("mixed element types on the destination: "
                        + ", ".join(f"{n} is {d}" for d, n in {wire: first[wire], **bad}.items())
                        + f" (the wire carries {wire}; only a tensor both sides hold in a dtype a whole number of "
                        f"{wire} elements wide is carried, as its bits)")
    return wire, tuple(reinterpret)


#: ``reinterpreted`` by (side identity, real, wire, what), the last two used: a placed
#: plan asks for the same training side twice (the direct plan, then the relayed one) between
#: two destination sides.
_REINTERPRETED = IdentityCache(2)


def reinterpreted(side: SideLayout, real: dict[str, str], wire: str, what: str) -> SideLayout:
    """``side`` with the tensors of ``real`` (name -> real dtype) described in ``wire`` units:
    one real element is ``r`` wire elements along the last dim (shape[-1], box offsets/sizes[-1]
    and view offset and outer strides x r, last stride 1). Other local tensors are kept as they
    are (same objects). Cached (the last two)."""
    return _REINTERPRETED.get((side,), (tuple(real.items()), wire, what),
                              lambda: _reinterpreted(side, real, wire, what))


def clear_reinterpreted_cache() -> None:
    """Forget the cached reinterpreted layouts and the last source index."""
    _REINTERPRETED.clear()
    _INDEXED.clear()


def _reinterpreted(side: SideLayout, real: dict[str, str], wire: str, what: str) -> SideLayout:
    w = DTYPE_BYTES[wire]
    tensors = {}
    for name, (shape, d) in side.tensors.items():
        if name in real:
            if d != real[name]:  # a cast into a reinterpreted tensor: refused by ``wire_dtype`` already
                raise PlanError(f"{name}: {what} dtype {d} != {real[name]}")
            r = DTYPE_BYTES[d] // w
            shape = (*tuple(shape)[:-1], shape[-1] * r)
            d = wire
        tensors[name] = (shape, d)
    params = []
    # new boxes and views by the old ones' identity: the rules share them between ranks (a
    # full-size side: ~300k pieces, ~1k boxes), so the copy shares them likewise
    boxes: dict[tuple[int, int], Box] = {}
    views: dict[tuple[int, int], View] = {}
    for p in side.params:
        pieces = p.pieces
        if (pieces[0].canonical not in real) if len(pieces) == 1 else not any(q.canonical in real for q in pieces):
            params.append(p)
            continue
        check_param_dtype(p, side, what)  # every piece's tensor is in p's dtype (not the wire's)
        inside = [q.canonical in real for q in p.pieces]
        if not all(inside):
            q = p.pieces[inside.index(False)]
            raise PlanError(f"{p.name} ({what} rank {p.rank}) holds {q.canonical}, which is not carried as {p.dtype} bits")
        r = DTYPE_BYTES[p.dtype] // w
        pieces = []
        for q in p.pieces:
            v, b = q.view, q.box
            if v.stride[-1] != 1 and v.shape[-1] != 1:
                raise PlanError(f"{p.name} ({what} rank {p.rank}): {q.canonical} is strided along its last dim "
                                f"(stride {v.stride[-1]}): its {p.dtype} elements cannot be carried as {wire} bits")
            box = boxes.get((id(b), r))
            if box is None:
                box = boxes[(id(b), r)] = Box((*b.offsets[:-1], b.offsets[-1] * r), (*b.sizes[:-1], b.sizes[-1] * r))
            view = views.get((id(v), id(box)))
            if view is None:
                view = views[(id(v), id(box))] = View(v.offset * r, box.sizes, (*(s * r for s in v.stride[:-1]), 1))
            pieces.append(Piece(q.rank, q.local_name, q.canonical, box, view))
        params.append(LocalParam(p.rank, p.name, (*p.shape[:-1], p.shape[-1] * r), wire, tuple(pieces)))
    return SideLayout(side.name, side.world_size, tuple(params), tensors, side.notes, side.quantize)


def check_whole_elements(transfers: Sequence[Transfer], real: dict[str, str], wire: str, budget: int) -> None:
    """A reinterpreted tensor's boxes hold whole real elements (a bucket split could cut one)."""
    w = DTYPE_BYTES[wire]
    for t in transfers:
        d = real.get(t.canonical)
        if d is not None:
            r = DTYPE_BYTES[d] // w
            if t.box.offsets[-1] % r or t.box.sizes[-1] % r:
                raise PlanError(f"{t.canonical}: the bucket budget ({budget} bytes) cuts its {d} elements in half; "
                                f"raise it or make it a multiple of {DTYPE_BYTES[d]}")


def first_uncovered(dst: SideLayout, plan: TransferPlan) -> str:
    """Name the first destination parameter whose planned elements differ from its size."""
    got: dict[tuple[int, str], int] = defaultdict(int)
    for t in plan.transfers:
        got[(t.dst, t.dst_name)] += t.box.numel
    for p in dst.params:
        want = p.numel - p.padding
        if got[(p.rank, p.name)] != want:
            return f"{p.name} on destination rank {p.rank}: {got[(p.rank, p.name)]} of {want} elements planned"
    return "per-parameter counts agree"

