"""The planner: intersect source and destination pieces into a minimal-bytes transfer plan.

Pure and deterministic: it imports neither megatron nor vllm and works on descriptors alone,
so full-size plans can be computed and checked anywhere. Phases, in the spirit of DCP's
planner (local plan -> global plan -> finish):

1. ``check_sides``     both sides describe the same canonical tensors (name, shape, dtype);
                       a dtype that differs is an error unless casts are allowed, then it is
                       recorded in ``TransferPlan.casts`` (the sender casts while packing, the
                       wire carries the destination's dtype, bytes stay at its minimum).
2. ``index_sources``   unique source boxes per tensor, each with its replicas; the boxes must
                       tile every tensor exactly (no gap, no overlap).
3. ``check_dest``      every destination piece lies inside its tensor and no two pieces of one
                       local tensor overlap (so every destination element is written once).
4. ``fragment``        destination box x source box intersections, one sender per fragment
                       chosen among the replicas by bytes already assigned (largest first);
                       with a ``link_cost`` the cheapest link to the destination first (a
                       holder on the same device, then the same node, then any).
5. ``merge``           adjacent fragments between the same pair of local tensors become one.
6. ``bucket``          fragments split to the byte budget and packed into rounds so no rank
                       sends or receives more than ``bucket_bytes`` in one round.

Cost: a full-size MoE plan has ~300k transfers, so a fragment that is a whole destination
piece (the bulk) gets no Python object of its own before its transfer. Local tensors
repeated across ranks (``param_kinds``) are checked and intersected once, and checked once
across layers too; intersections are computed once per distinct destination box and shared
by its sites; fragments travel in blocks (one sender tuple, a run of destination sites) and
are keyed, sorted and gathered column-wise (numpy's sort where installed, the same order
without); transfers are built column by column (``transfers_from_columns``). Sender choice
walks fragments one by one only where there is a choice, merge only sees local tensors that
get several fragments of one canonical tensor, and the cycle collector is paused while
planning (the plan then goes to its oldest generation unscanned). The plan is the same as
the straightforward one-sort-per-phase version: ``tests/test_plan_speed.py`` pins digests.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import gc
import itertools
import math
import operator
import time
from collections import defaultdict
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence

from ..layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from .types import PlanError, Transfer, TransferPlan, transfers_from_columns

try:  # optional: only speeds up placement keys and sorts, plans are the same without it
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torch
    _np = None

__all__ = ["build_plan", "check_sides", "index_sources", "check_dest", "param_kinds"]


class _Replica(NamedTuple):
    """A source rank holding one unique box, and where it holds it."""

    rank: int
    name: str
    view: View


#: ``_Replica`` from one tuple, without the Python-level ``__new__`` of a named tuple.
_new_replica = functools.partial(tuple.__new__, _Replica)


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


def index_sources(src: SideLayout) -> dict[str, dict[Box, list[_Replica]]]:
    """Unique boxes per canonical tensor with the replicas holding each, checked to tile it."""
    index: dict[str, dict[Box, list[_Replica]]] = defaultdict(dict)
    found: dict[tuple, list[_Replica]] = {}  # the same lists, keyed by plain tuples: cheaper to hash than Box
    tensors = src.tensors
    for param in src.params:
        for piece in param.pieces:
            spec = tensors.get(piece.canonical)
            if spec is not None and spec[1] != param.dtype:
                _check_param_dtype(param, src, "source")  # raises, naming the first such tensor
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
    for name in map(_CANONICAL_ATTR, pieces):
        spec = tensors.get(name)
        specs.append(spec if spec is None else (tuple(spec[0]), spec[1]))
    return (param.shape, param.dtype, tuple(specs), tuple(map(id, map(_BOX_ATTR, pieces))),
            tuple(map(id, map(_VIEW, pieces))))


def param_kinds(side: SideLayout) -> list[int]:
    """Number each local tensor by what it is apart from its rank: name, shape, dtype and its
    pieces' tensors, boxes and views (by identity: layouts share them across ranks, and equal
    objects under different identities only cost a repeated check). Replicated engines and
    data-parallel ranks repeat every local tensor, so per-tensor work is done once per kind."""
    found: dict[tuple, int] = {}
    canonical, box, view = operator.attrgetter("canonical"), operator.attrgetter("box"), operator.attrgetter("view")
    kinds = []
    for p in side.params:
        pieces = p.pieces
        if len(pieces) == 1:  # most local tensors: a flat key (a str where others hold tuples)
            q = pieces[0]
            key = (p.name, p.shape, p.dtype, q.canonical, id(q.box), id(q.view))
        else:
            key = (p.name, p.shape, p.dtype, tuple(map(canonical, pieces)), tuple(map(id, map(box, pieces))),
                   tuple(map(id, map(view, pieces))))
        kinds.append(found.setdefault(key, len(found)))
    return kinds


def _check_dest_param(
    param: LocalParam, dst: SideLayout, inside: set[tuple[str, tuple[int, ...], tuple[int, ...]]], lengths: _Lengths
) -> int:
    """Check one destination local tensor; return the elements its pieces cover."""
    _check_param_dtype(param, dst, "destination")
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


def _check_param_dtype(param: LocalParam, side: SideLayout, what: str) -> None:
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


def build_plan(
    src: SideLayout,
    dst: SideLayout,
    *,
    bucket_bytes: int = 1 << 28,
    allow_cast: bool = False,
    not_direct: Iterable[tuple[str, str]] = (),
    link_cost: Callable[[int, int], int] | None = None,
    charges: Iterable[tuple[int, str, tuple[int, ...]]] = (),
) -> TransferPlan:
    """Plan a refit from ``src`` (training) to ``dst`` (inference). See module docstring.

    ``link_cost(src rank, dst rank)``: a small integer per link class (e.g. 0 same device,
    1 same node, 2 other node); among a fragment's replicas the cheapest link wins, then the
    least loaded. None: load only (plans bit-identical to those made before it existed).
    ``charges``: (destination rank, local tensor, other destination ranks) -- what that
    tensor receives also counts against those ranks' bucket budgets (fan-out relays: their
    members receive it too, forwarded)."""
    t0 = time.perf_counter()
    with _gc_paused():
        plan = _build_plan(src, dst, bucket_bytes, allow_cast, not_direct, link_cost,
                           {(r, n): tuple(o) for r, n, o in charges})
    object.__setattr__(plan, "plan_seconds", time.perf_counter() - t0)
    return plan


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates a few objects per transfer and frees none of them: the cycle
    collector would rescan them all again and again (about 40% of a full-size plan).

    On the way out the survivors -- the plan, one object per transfer, kept for every refit --
    go straight to the oldest generation (``freeze`` + ``unfreeze``, no scan): the next young
    collection would otherwise walk all of them once more for nothing (~10% of a full-size
    plan). Skipped when someone froze objects, whose ``unfreeze`` this would be.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _build_plan(
    src: SideLayout, dst: SideLayout, bucket_bytes: int, allow_cast: bool, not_direct: Iterable[tuple[str, str]],
    link_cost: Callable[[int, int], int] | None = None, charges: dict[tuple[int, str], tuple[int, ...]] | None = None,
) -> TransferPlan:
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    casts = check_sides(src, dst, allow_cast=allow_cast)
    dtype, reinterpret = _dtype(dst, casts)
    if reinterpret:  # both sides, in wire-dtype units from here on
        real = dict(reinterpret)
        src, dst = _reinterpreted(src, real, dtype, "source"), _reinterpreted(dst, real, dtype, "destination")
    index = index_sources(src)
    kinds = param_kinds(dst)
    padding = check_dest(dst, kinds)
    itemsize = DTYPE_BYTES[dtype]
    order = {name: i for i, name in enumerate(dst.tensors)}

    shapes = [shape for shape, _ in dst.tensors.values()]
    num_dst = max(dst.world_size, 1 + max((p.rank for p in dst.params), default=0))
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # by shape: many tensors share one
    keys = _Keys(src.world_size, num_dst, 1 + max(map(math.prod, shapes), default=0),
                 {name: strides.get(tuple(shape)) or strides.setdefault(tuple(shape), contiguous_strides(shape))
                  for name, (shape, _) in dst.tensors.items()})

    hits, cut = _fragment(dst, index, order, kinds)
    costs = None
    if link_cost is not None:  # by destination rank: a row of per-source costs
        costs = [[link_cost(s, d) for s in range(src.world_size)] for d in range(num_dst)]
    blocks, maybe = _choose_senders(hits, cut, src.world_size, itemsize, costs)
    del hits, cut, index  # their memory is reused for the transfers
    merged, first_numel = _merge(maybe)
    first_numel = {len(blocks.sites) + i: n for i, n in first_numel.items()}
    _add_moves(blocks, merged)
    transfers, num_buckets, planned = _bucket(blocks, first_numel, itemsize, bucket_bytes, keys, charges)
    if reinterpret:
        _check_whole_elements(transfers, dict(reinterpret), dtype, bucket_bytes)

    dst_numel = sum(p.numel for p in dst.params) - sum(n for _, _, n in padding)
    total_elems = sum(math.prod(shape) for shape, _ in dst.tensors.values())
    plan = TransferPlan(
        transfers=tuple(transfers),
        num_buckets=num_buckets,
        num_src=src.world_size,
        num_dst=dst.world_size,
        itemsize=itemsize,
        dtype=dtype,
        bytes_min=dst_numel * itemsize,
        bytes_hf_broadcast=total_elems * itemsize * dst.world_size,
        bucket_bytes=bucket_bytes,
        padding=tuple(padding),
        not_direct=tuple(not_direct),
        casts=casts,
        notes=tuple(src.notes) + tuple(dst.notes),
        reinterpret=reinterpret,
    )
    if planned != plan.bytes_min:
        raise PlanError(
            f"planned {planned} bytes but the destination holds {plan.bytes_min}: coverage is not exact "
            f"({_first_uncovered(dst, plan)})"
        )
    return plan


def _dtype(dst: SideLayout, casts: Sequence[tuple[str, str, str]] = ()) -> tuple[str, tuple[tuple[str, str], ...]]:
    """One element type per refit: the wire carries the destination's -- the dtype holding most
    of its elements (the first in its table on a tie). A tensor in a wider dtype that is a whole
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
    wire = max(order, key=lambda d: (numel[d], -order.index(d)))
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


def _reinterpreted(side: SideLayout, real: dict[str, str], wire: str, what: str) -> SideLayout:
    """``side`` with the tensors of ``real`` (name -> real dtype) described in ``wire`` units:
    one real element is ``r`` wire elements along the last dim (shape[-1], box offsets/sizes[-1]
    and view offset and outer strides x r, last stride 1). Other local tensors are kept as they
    are (same objects)."""
    w = DTYPE_BYTES[wire]
    tensors = {}
    for name, (shape, d) in side.tensors.items():
        if name in real:
            if d != real[name]:  # a cast into a reinterpreted tensor: refused by ``_dtype`` already
                raise PlanError(f"{name}: {what} dtype {d} != {real[name]}")
            r = DTYPE_BYTES[d] // w
            shape = (*tuple(shape)[:-1], shape[-1] * r)
            d = wire
        tensors[name] = (shape, d)
    params = []
    for p in side.params:
        pieces = p.pieces
        if (pieces[0].canonical not in real) if len(pieces) == 1 else not any(q.canonical in real for q in pieces):
            params.append(p)
            continue
        _check_param_dtype(p, side, what)  # every piece's tensor is in p's dtype (not the wire's)
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
            box = Box((*b.offsets[:-1], b.offsets[-1] * r), (*b.sizes[:-1], b.sizes[-1] * r))
            view = View(v.offset * r, box.sizes, (*(s * r for s in v.stride[:-1]), 1))
            pieces.append(Piece(q.rank, q.local_name, q.canonical, box, view))
        params.append(LocalParam(p.rank, p.name, (*p.shape[:-1], p.shape[-1] * r), wire, tuple(pieces)))
    return SideLayout(side.name, side.world_size, tuple(params), tensors, side.notes)


def _check_whole_elements(transfers: Sequence[Transfer], real: dict[str, str], wire: str, budget: int) -> None:
    """A reinterpreted tensor's boxes hold whole real elements (a bucket split could cut one)."""
    w = DTYPE_BYTES[wire]
    for t in transfers:
        d = real.get(t.canonical)
        if d is not None:
            r = DTYPE_BYTES[d] // w
            if t.box.offsets[-1] % r or t.box.sizes[-1] % r:
                raise PlanError(f"{t.canonical}: the bucket budget ({budget} bytes) cuts its {d} elements in half; "
                                f"raise it or make it a multiple of {DTYPE_BYTES[d]}")


def _first_uncovered(dst: SideLayout, plan) -> str:
    """Name the first destination parameter whose planned elements differ from its size."""
    got: dict[tuple[int, str], int] = defaultdict(int)
    for t in plan.transfers:
        got[(t.dst, t.dst_name)] += t.box.numel
    for p in dst.params:
        want = p.numel - p.padding
        if got[(p.rank, p.name)] != want:
            return f"{p.name} on destination rank {p.rank}: {got[(p.rank, p.name)]} of {want} elements planned"
    return "per-parameter counts agree"


class _Hit(NamedTuple):
    """One destination box x source box intersection, computed once per distinct destination
    box and shared by every destination piece with that box (engine replicas, DP ranks)."""

    order: int  # model order of the canonical tensor
    canonical: str
    box: Box  # the intersection
    src_box: Box  # the unique source box it lies in
    replicas: list[_Replica]  # sorted by rank (stable)
    ranks: list[int]  # the replicas' ranks
    #: One fragment per destination piece it lands in: the piece itself when it is its local
    #: tensor's only fragment of this canonical tensor, else a ``_Frag`` (may merge).
    sites: list[Piece | _Frag]
    senders: list[int]  # per site, the chosen replica's index (empty: the only one)
    #: With one replica, its sender tuple (see ``_Blocks``), made while the hit is at hand.
    sender: tuple | None = None


#: ``_Hit`` from one tuple (all fields), without the Python-level ``__new__`` of a named tuple.
_new_hit = functools.partial(tuple.__new__, _Hit)


class _Frag(NamedTuple):
    """The part of a destination piece one hit covers (field names as in Piece)."""

    rank: int
    local_name: str
    view: View


_new_frag = functools.partial(tuple.__new__, _Frag)  # as ``_new_hit``


class _Move(NamedTuple):
    """A fragment with its sender: what merge, split and bucket work on (a Transfer to be)."""

    order: int
    src: int
    dst: int
    canonical: str
    box: Box
    src_name: str
    src_view: View
    dst_name: str
    dst_view: View


_new_move = functools.partial(tuple.__new__, _Move)  # as ``_new_hit``


#: A sender: ``(order, src, canonical, box, src_name, src_view)``, one per hit and replica.
_Sender = tuple
_ORDER, _SRC, _CANONICAL, _BOX, _SRC_NAME, _SRC_VIEW = range(6)
_SRC_OF, _BOX_OF = operator.itemgetter(_SRC), operator.itemgetter(_BOX)
_NUMEL = operator.attrgetter("numel")
_RANK, _LOCAL_NAME, _VIEW = (operator.attrgetter(a) for a in ("rank", "local_name", "view"))
_CANONICAL_ATTR, _BOX_ATTR = operator.attrgetter("canonical"), operator.attrgetter("box")
_RANKS = operator.attrgetter("ranks")


class _Blocks(NamedTuple):
    """Fragments with their senders, in columns: block ``b`` sends ``senders[b]``'s box to the
    next ``counts[b]`` destination sites (``Piece`` or ``_Frag``: rank, local_name, view). A
    full-size plan has ~300k fragments but ~8x fewer blocks (destination replicas share one),
    and a whole-piece fragment needs no object of its own: its site is the ``Piece``."""

    senders: list[_Sender]
    counts: list[int]
    sites: list[Piece | _Frag]


class _Keys(NamedTuple):
    """How placement keys are formed: ((tensor order * num_src + src) * num_dst + dst) * span
    + the box's offsets as a row-major index in its tensor (``strides``)."""

    num_src: int
    num_dst: int
    span: int
    strides: dict[str, tuple[int, ...]]


def _fragment(
    dst: SideLayout, index: dict[str, dict[Box, list[_Replica]]], order: dict[str, int], kinds: list[int]
) -> tuple[list[_Hit], set[int]]:
    """Intersect every destination piece with the source boxes of its tensor; return the hits
    and the ids of those that hold cut fragments.

    Destination replicas (vLLM DP ranks, engine replicas) repeat the same box: the
    intersections are computed once per (tensor, box) and each piece only adds a site; a
    local tensor of a kind already seen (``param_kinds``) reuses its kind's hits outright. A
    piece whose local tensor gets several fragments of one canonical tensor (the only ones
    that can merge) is cut into ``_Frag`` sites even when one hit covers it.
    """
    sources: dict[str, _SourceBoxes | tuple] = {}  # by tensor, built on first use (``_source_boxes``)
    memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[_Hit]] = {}
    cuts: dict[tuple, list[View]] = {}  # (tensor, box, view offset, view stride) -> view per hit
    by_kind: dict[int, tuple[list[list[Piece | _Frag]] | None, list[list[_Hit]]]] = {}
    out: list[_Hit] = []
    cut: set[int] = set()  # ids of the hits that get cut fragments
    append = list.append
    for param, kind in zip(dst.params, kinds):
        pieces = param.pieces
        known = by_kind.get(kind)
        if known is None:
            found = [_piece_hits(piece, memo, sources, index, order, out) for piece in pieces]
            whole = all(len(hits) == 1 for hits in found) and (
                len(pieces) == 1 or len({p.canonical for p in pieces}) == len(pieces)
            )
            known = by_kind[kind] = ([hit.sites for (hit,) in found] if whole else None, found)
            if not whole:
                cut.update(map(id, itertools.chain.from_iterable(found)))
        sites, found = known
        if sites is not None:  # one hit covering each piece: the piece is the fragment
            collections.deque(map(append, sites, pieces), maxlen=0)
            continue
        for piece, hits in zip(pieces, found):
            view, box = piece.view, piece.box
            key = (piece.canonical, box.offsets, box.sizes, view.offset, view.stride)
            views = cuts.get(key)
            if views is None:
                views = cuts[key] = [view.sub(box, hit.box) for hit in hits]
            for hit, view_cut in zip(hits, views):
                hit.sites.append(_new_frag((piece.rank, piece.local_name, view_cut)))
    return out, cut


def _piece_hits(
    piece: Piece,
    memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[_Hit]],
    sources: dict[str, _SourceBoxes | tuple],
    index: dict[str, dict[Box, list[_Replica]]],
    order: dict[str, int],
    out: list[_Hit],
) -> list[_Hit]:
    """The hits of a piece's (tensor, box), computed (and added to ``out``) when first seen."""
    box, canonical = piece.box, piece.canonical
    key = (canonical, box.offsets, box.sizes)
    hits = memo.get(key)
    if hits is None:
        boxes = sources.get(canonical)
        if boxes is None:
            boxes = sources[canonical] = _source_boxes(index[canonical])
        if type(boxes) is tuple:  # the whole tensor (it tiles), so it holds the whole piece
            sbox, replicas, ranks = boxes
            sender = _sender(order[canonical], canonical, replicas[0], box, sbox) if len(replicas) == 1 else None
            hits = memo[key] = [_new_hit((order[canonical], canonical, box, sbox, replicas, ranks, [], [], sender))]
        else:
            hits = memo[key] = _hits(piece, boxes, order[canonical])
        out.extend(hits)
    return hits


def _source_boxes(boxes: dict[Box, list[_Replica]]) -> _SourceBoxes | tuple[Box, list[_Replica], list[int]]:
    """A tensor's source boxes for ``_hits``; for most tensors, held whole, just the one box
    with its replicas sorted by rank and their ranks (as in ``_SourceBoxes``)."""
    if len(boxes) != 1:
        return _SourceBoxes(boxes)
    ((box, replicas),) = boxes.items()
    if len(replicas) > 1:
        replicas = sorted(replicas, key=operator.attrgetter("rank"))
    return (box, replicas, [r.rank for r in replicas])


class _SourceBoxes:
    """A tensor's unique source boxes sorted along dim 0, so a destination box only tests
    the few that can reach it (DeepSeek-sized QKV has 128 per tensor), each with its
    replicas sorted by rank (stable: the first least-loaded one is the sender) and their ranks."""

    __slots__ = ("boxes", "starts", "reach")

    def __init__(self, boxes: dict[Box, list[_Replica]]) -> None:
        by_rank = operator.attrgetter("rank")
        self.boxes = []
        for b in sorted(boxes, key=lambda sbox: sbox.offsets[:1]):
            reps = boxes[b] if len(boxes[b]) == 1 else sorted(boxes[b], key=by_rank)
            self.boxes.append((b, reps, [r.rank for r in reps]))
        self.starts = [b.offsets[0] if b.offsets else 0 for b, _, _ in self.boxes]
        self.reach = max((b.sizes[0] for b, _, _ in self.boxes if b.sizes), default=0)

    def near(self, box: Box) -> list[tuple[Box, list[_Replica], list[int]]]:
        if not box.offsets:
            return self.boxes
        lo = bisect.bisect_right(self.starts, box.offsets[0] - self.reach)
        hi = bisect.bisect_left(self.starts, box.offsets[0] + box.sizes[0])
        return self.boxes[lo:hi]


def _hits(piece: Piece, sources: _SourceBoxes, order: int) -> list[_Hit]:
    """The intersections of one destination box, which must add up to it."""
    box = piece.box
    hits = []
    covered = 0
    for sbox, replicas, ranks in sources.near(box):
        sub = box.intersect(sbox)
        if sub is not None:
            hits.append(_Hit(order, piece.canonical, box if sub == box else sub, sbox, replicas, ranks, [], []))
            covered += sub.numel
    if covered != piece.numel:
        raise PlanError(
            f"{piece.local_name} (destination rank {piece.rank}): {piece.canonical} box {piece.box} "
            f"is covered {covered} of {piece.numel} elements by the source"
        )
    return hits


def _choose_senders(hits: list[_Hit], cut: set[int], num_src: int, itemsize: int,
                    costs: list[list[int]] | None = None) -> tuple[_Blocks, list[_Move]]:
    """One sender per fragment: the replica with the fewest bytes so far, largest fragments
    first (LPT), ties broken by rank -- deterministic on every rank. With ``costs`` (per
    destination rank, per source rank) the replicas on the cheapest link to the fragment's
    destination compete first: bytes that never leave a device or a node stay there.

    Fragments go in (size desc, tensor, dst rank, dst name, dst offset) order. Only groups of
    one (size, tensor) that contain a choice are ordered fragment by fragment; elsewhere the
    sender is forced and only its byte count matters. Returns the fragments that cannot
    merge, as blocks, and the moves that might (cut fragments).
    """
    load = [0] * num_src
    #: (id of a replica-rank list, destination rank) -> indices of the replicas on the cheapest
    #: link (the lists are shared by every hit of a source box and live while planning)
    cheapest: dict[tuple[int, int], list[int]] = {}
    groups: dict[tuple[int, int], list[_Hit]] = defaultdict(list)
    for hit in hits:
        groups[(-hit.box.numel, hit.order)].append(hit)
    for key in sorted(groups):
        group = groups[key]
        nbytes = group[0].box.numel * itemsize
        if max(map(len, map(_RANKS, group))) == 1:
            for h in group:
                load[h.ranks[0]] += nbytes * len(h.sites)
            continue
        frags = [(f.rank, f.local_name, f.view.offset) for h in group for f in h.sites]
        where = [(h, i) for h in group for i in range(len(h.sites))]
        # unique keys (destination views of one tensor are disjoint); stable all the same
        for h, i in map(where.__getitem__, sorted(range(len(frags)), key=frags.__getitem__)):
            ranks = h.ranks
            if len(ranks) == 1:
                load[ranks[0]] += nbytes
                continue
            if not h.senders:
                h.senders.extend([0] * len(h.sites))
            if costs is None:
                loads = list(map(load.__getitem__, ranks))
                best = loads.index(min(loads))  # ranks ascend: the least-loaded, then lowest rank
            else:  # the replicas on the cheapest link to this destination, then as above
                d = h.sites[i].rank
                cand = cheapest.get((id(ranks), d))
                if cand is None:
                    row = costs[d]
                    low = min(row[r] for r in ranks)
                    cand = cheapest[(id(ranks), d)] = [j for j, r in enumerate(ranks) if row[r] == low]
                if len(cand) == 1:
                    best = cand[0]
                else:
                    loads = [load[ranks[j]] for j in cand]
                    best = cand[loads.index(min(loads))]
            h.senders[i] = best
            load[ranks[best]] += nbytes
    return _emit(hits, cut)


def _emit(hits: list[_Hit], cut: set[int]) -> tuple[_Blocks, list[_Move]]:
    """Gather every site of every hit into blocks by sender or, for cut fragments, into
    ``_Move``s to merge. Sites keep their order: hit by hit, site by site. ``cut``: the ids
    of the hits that hold cut fragments (only those need looking at site by site)."""
    blocks = _Blocks([], [], [])
    senders, counts, out = blocks
    maybe: list[_Move] = []
    for h in hits:
        sites, sender = h.sites, h.sender
        if sender is not None and id(h) not in cut:  # the common case: the whole hit is one block
            senders.append(sender)
            counts.append(len(sites))
            out += sites
            continue
        order, canonical, box, src_box = h.order, h.canonical, h.box, h.src_box
        if not h.senders:  # one replica
            sender = sender or _sender(order, canonical, h.replicas[0], box, src_box)
            if id(h) not in cut:
                senders.append(sender)
                counts.append(len(sites))
                out += sites
                continue
            by_replica: dict[int, _Sender] = {0: sender}  # replica index -> its sender tuple
            chosen: Iterable[int] = itertools.repeat(0, len(sites))
        else:
            by_replica, chosen = {}, h.senders
        for f, k in zip(sites, chosen):
            sender = by_replica.get(k)
            if sender is None:
                sender = by_replica[k] = _sender(order, canonical, h.replicas[k], box, src_box)
            if type(f) is _Frag:
                _, src, _, _, src_name, sview = sender
                maybe.append(_new_move((order, src, f.rank, canonical, box, src_name, sview, f.local_name, f.view)))
            else:
                senders.append(sender)
                counts.append(1)
                out.append(f)
    return blocks, maybe


def _sender(order: int, canonical: str, rep: _Replica, box: Box, src_box: Box) -> _Sender:
    """The sender tuple of replica ``rep`` sending ``box`` (inside its ``src_box``)."""
    same = box is src_box or (box.offsets == src_box.offsets and box.sizes == src_box.sizes)
    return (order, rep.rank, canonical, box, rep.name, rep.view if same else _sub_view(rep.view, src_box, box))


_VIEW_SETTERS = tuple(getattr(View, name).__set__ for name in ("offset", "shape", "stride"))


def _sub_view(view: View, outer: Box, inner: Box) -> View:
    """``view.sub(outer, inner)`` built without the frozen dataclass ``__init__`` (one per
    hit of a full-size plan: tens of thousands)."""
    out = object.__new__(View)
    set_offset, set_shape, set_stride = _VIEW_SETTERS
    set_offset(out, view.offset + sum(map(operator.mul, map(operator.sub, inner.offsets, outer.offsets), view.stride)))
    set_shape(out, inner.sizes)
    set_stride(out, view.stride)
    return out


def _add_moves(blocks: _Blocks, moves: list[_Move]) -> None:
    """Append moves as blocks of one site each."""
    senders, counts, sites = blocks
    for m in moves:
        senders.append((m.order, m.src, m.canonical, m.box, m.src_name, m.src_view))
        counts.append(1)
        sites.append(_new_frag((m.dst, m.dst_name, m.dst_view)))


def _merge(moves: list[_Move]) -> tuple[list[_Move], dict[int, int]]:
    """Fuse fragments adjacent in one dim whose source and destination views continue each
    other (same local tensors, same strides), so a contiguous TP shard is one transfer.

    Only fragments whose destination tensor gets several of one canonical tensor can fuse.
    Returns the moves and, by index, the size of the first fragment of each fused one: the
    order between otherwise equal transfers depends on it (see ``_bucket``).
    """
    moves.sort(key=_merge_key)
    out: list[_Move] = []
    first_numel: dict[int, int] = {}
    for m in moves:
        if out:
            fused = _try_merge(out[-1], m)
            if fused is not None:
                first_numel.setdefault(len(out) - 1, out[-1].box.numel)
                out[-1] = fused
                continue
        out.append(m)
    return out, first_numel


def _merge_key(m: _Move) -> tuple:
    """Merge order: same local tensors together, then by offsets; the fragments' sender-choice
    order, (size desc, destination offset), breaks what is left."""
    return (m.src, m.dst, m.order, m.src_name, m.dst_name, m.box.offsets, -m.box.numel, m.dst_view.offset)


def _try_merge(a: _Move, b: _Move) -> _Move | None:
    if (a.src, a.dst, a.canonical, a.src_name, a.dst_name) != (b.src, b.dst, b.canonical, b.src_name, b.dst_name):
        return None
    ba, bb = a.box, b.box
    diff = [d for d in range(len(ba.offsets)) if ba.offsets[d] != bb.offsets[d] or ba.sizes[d] != bb.sizes[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    if ba.offsets[d] + ba.sizes[d] != bb.offsets[d]:
        return None
    sva, svb, dva, dvb = a.src_view, b.src_view, a.dst_view, b.dst_view
    if sva.stride != svb.stride or dva.stride != dvb.stride:
        return None
    if svb.offset != sva.offset + ba.sizes[d] * sva.stride[d] or dvb.offset != dva.offset + ba.sizes[d] * dva.stride[d]:
        return None
    sizes = list(ba.sizes)
    sizes[d] += bb.sizes[d]
    box = Box(ba.offsets, tuple(sizes))
    src_view, dst_view = View(sva.offset, box.sizes, sva.stride), View(dva.offset, box.sizes, dva.stride)
    return a._replace(box=box, src_view=src_view, dst_view=dst_view)


def _split(sender: _Sender, site: Piece | _Frag, itemsize: int, budget: int) -> list[tuple[_Sender, Piece | _Frag]]:
    """Cut a fragment larger than the budget into boxes that fit: along the outermost dim
    whose trailing slab fits the budget, one index at a time along the dims before it."""
    order, src, canonical, box, src_name, src_view = sender
    if box.numel * itemsize <= budget:
        return [(sender, site)]
    if itemsize > budget:
        raise PlanError(f"{canonical}: bucket budget {budget} bytes is smaller than one element")
    nd = len(box.sizes)
    d, slab = nd - 1, itemsize  # innermost: one element always fits
    for i in range(nd):
        trailing = math.prod(box.sizes[i + 1 :]) * itemsize
        if trailing <= budget:
            d, slab = i, trailing
            break
    step = max(1, budget // slab)
    parts = []
    for outer in itertools.product(*(range(n) for n in box.sizes[:d])):
        for start in range(0, box.sizes[d], step):
            offs = list(box.offsets)
            sizes = list(box.sizes)
            for i, k in enumerate(outer):
                offs[i] += k
                sizes[i] = 1
            offs[d] += start
            sizes[d] = min(step, box.sizes[d] - start)
            sub = Box(tuple(offs), tuple(sizes))
            parts.append(((order, src, canonical, sub, src_name, src_view.sub(box, sub)),
                          _Frag(site.rank, site.local_name, site.view.sub(box, sub))))
    return parts


def _bucket(
    blocks: _Blocks, first_numel: dict[int, int], itemsize: int, budget: int, keys: _Keys,
    charges: dict[tuple[int, str], tuple[int, ...]] | None = None,
) -> tuple[list[Transfer], int, int]:
    """Pack transfers into rounds so each rank sends <= budget and receives <= budget per
    round; tensors go in model order so the receiver can finish layers early.

    Parts are placed in (tensor, src, dst, offsets) order, one int key per part (the offsets
    as a row-major index); equal keys (a rank receiving the same elements twice) fall back to
    the merge order of their fragments (``first_numel``: by site index, the first fragment's
    size of a fused one). The result is sorted by (round, src, dst, tensor, offsets): parts
    are grouped by (round, src, dst) in placement order. Returns the transfers, the number
    of rounds and the bytes planned.
    """
    senders, counts, sites = blocks
    owner = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(senders)), counts)))
    if itemsize > budget and sites:  # named as always: the first in (src, dst, tensor) order

        def rank_order(i: int) -> tuple[int, int, int]:
            sender = senders[owner[i]]
            return (sender[_SRC], sites[i].rank, sender[_ORDER])

        first = senders[owner[min(range(len(sites)), key=rank_order)]]
        raise PlanError(f"{first[_CANONICAL]}: bucket budget {budget} bytes is smaller than one element")
    tie_break = _merge_order(blocks, owner, range(len(sites)), first_numel)
    if senders and max(map(_NUMEL, map(_BOX_OF, senders))) * itemsize > budget:
        cut = [(i, part) for i, site in enumerate(sites) for part in _split(senders[owner[i]], site, itemsize, budget)]
        tie_break = _merge_order(blocks, owner, [i for i, _ in cut], first_numel)
        senders, sites = [s for _, (s, _) in cut], [f for _, (_, f) in cut]
        owner = list(range(len(cut)))
    placed = _placement(senders, owner, sites, keys, tie_break)
    return _pack(senders, owner, sites, placed, itemsize, budget, keys, charges)


def _merge_order(blocks: _Blocks, owner: list[int], parent: Sequence[int], first_numel: dict[int, int]):
    """Tie-break for parts with equal keys: the merge order of the fragment (at site
    ``parent[i]``) that part ``i`` is (a cut of)."""
    senders, _, sites = blocks

    def merge_order(i: int) -> tuple:
        j = parent[i]
        sender, site = senders[owner[j]], sites[j]
        box = sender[_BOX]
        return (sender[_SRC_NAME], site.local_name, box.offsets, -first_numel.get(j, box.numel), site.view.offset)

    return merge_order


def _placement(
    senders: list[_Sender], owner: list[int], sites: list[Piece | _Frag], keys: _Keys, tie_break
) -> list[int]:
    """Part indices in placement order: by key; equal keys by ``tie_break``."""
    num_src, num_dst, span, strides = keys
    bases = [  # per block: the key without its destination rank
        (s[_ORDER] * num_src + s[_SRC]) * num_dst * span
        + sum(map(operator.mul, s[_BOX].offsets, strides[s[_CANONICAL]]))
        for s in senders
    ]
    dst = list(map(_RANK, sites))
    if _np is not None and max(bases, default=0) + num_dst * span < _INT64_END:
        key_of = _np.array(bases, dtype=_np.int64)[_np.array(owner, dtype=_np.intp)]
        key_of += _np.array(dst, dtype=_np.int64) * span
        by_key = _np.argsort(key_of, kind="stable")
        ordered = key_of[by_key]
        ties = bool((ordered[1:] == ordered[:-1]).any())
        placed, key = by_key.tolist(), key_of.tolist() if ties else []
    else:
        key = [bases[b] + d * span for b, d in zip(owner, dst)]
        placed = sorted(range(len(key)), key=key.__getitem__)
        ties = len(set(key)) < len(key)
    if ties:
        placed.sort(key=lambda i: (key[i], *tie_break(i)))
    return placed


def _pack(
    senders: list[_Sender], owner: list[int], sites: list[Piece | _Frag], placed: list[int], itemsize: int, budget: int,
    keys: _Keys, charges: dict[tuple[int, str], tuple[int, ...]] | None = None,
) -> tuple[list[Transfer], int, int]:
    """Rounds for the placed parts, then the transfers sorted by (round, src, dst), stable."""
    owners = list(map(owner.__getitem__, placed))
    by_sender = list(map(senders.__getitem__, owners))
    by_site = list(map(sites.__getitem__, placed))
    src, dst = list(map(_SRC_OF, by_sender)), list(map(_RANK, by_site))
    nbytes = list(map([numel * itemsize for numel in map(_NUMEL, map(_BOX_OF, senders))].__getitem__, owners))
    extra = [charges.get(k) for k in zip(dst, map(_LOCAL_NAME, by_site))] if charges else None
    rounds = _rounds(src, dst, nbytes, budget, keys.num_src, keys.num_dst, extra)
    get = operator.itemgetter
    made = transfers_from_columns(len(placed), [
        src, dst, map(get(_CANONICAL), by_sender), map(get(_BOX), by_sender), map(get(_SRC_NAME), by_sender),
        map(get(_SRC_VIEW), by_sender), map(_LOCAL_NAME, by_site), map(_VIEW, by_site), nbytes, rounds,
    ])
    final = _group_order(rounds, src, dst, keys.num_src, keys.num_dst)
    return list(map(made.__getitem__, final)), 1 + max(rounds) if rounds else 0, sum(nbytes)


_INT64_END = 1 << 63


def _group_order(rounds: list[int], src: list[int], dst: list[int], num_src: int, num_dst: int) -> list[int]:
    """Indices sorted by (round, src, dst), stable: placement order within a group. numpy's
    sort when it is installed (a few times faster on ~300k parts); the same order either way."""
    if _np is not None and (max(rounds, default=0) + 1) * num_src * num_dst < _INT64_END:
        group = (_np.array(rounds, dtype=_np.int64) * num_src + _np.array(src, dtype=_np.int64)) * num_dst
        return _np.argsort(group + _np.array(dst, dtype=_np.int64), kind="stable").tolist()
    group_of = [(r * num_src + s) * num_dst + d for r, s, d in zip(rounds, src, dst)]
    return sorted(range(len(group_of)), key=group_of.__getitem__)


def _rounds(src: list[int], dst: list[int], nbytes: list[int], budget: int, num_src: int, num_dst: int,
            extra: list[tuple[int, ...] | None] | None = None) -> list[int]:
    """Greedy rounds in placement order: each part goes to the first round, from the first
    its two ranks can still fill, where both stay within the budget (or both are empty).
    ``extra``: per part, more destination ranks it counts against (see ``build_plan``)."""
    if extra is not None and any(extra):
        return _rounds_charged(src, dst, nbytes, budget, num_src, num_dst, extra)
    levels: list[list[int]] = []  # per round: bytes sent by each source, then received by each destination
    cur = [0] * (num_src + num_dst)  # first round each rank can still fill
    full = budget - (budget >> 6)  # a round with less than 1/64 of the budget left is skipped
    rounds: list[int] = []
    width = num_src + num_dst
    low: dict[tuple[int, int], int] = {}  # see ``_first_fit``
    for s, d, nb in zip(src, dst, nbytes):
        d += num_src
        r = cur[s]
        rd = cur[d]
        if rd > r:
            r = rd
        scanned = 0
        while True:
            if r == len(levels):
                levels.append([0] * width)
            lv = levels[r]
            a, b = lv[s] + nb, lv[d] + nb
            if (a <= budget and b <= budget) or (a == nb and b == nb):
                break
            r += 1
            scanned += 1
            if scanned == _SCAN and nb <= budget:
                r = _first_fit(levels, (s, d), nb, budget, r, cur, low)
        lv[s] = a
        lv[d] = b
        if a > full and r == cur[s]:
            _advance(cur, s, levels, full)
        if b > full and r == cur[d]:
            _advance(cur, d, levels, full)
        rounds.append(r)
    return rounds


def _rounds_charged(src: list[int], dst: list[int], nbytes: list[int], budget: int, num_src: int, num_dst: int,
                    extra: list[tuple[int, ...] | None]) -> list[int]:
    """``_rounds`` where a part also counts against other destination ranks: every rank it
    counts against stays within the budget (or all of them are empty in that round)."""
    levels: list[list[int]] = []
    cur = [0] * (num_src + num_dst)
    full = budget - (budget >> 6)
    rounds: list[int] = []
    width = num_src + num_dst
    low: dict[tuple[int, int], int] = {}  # see ``_first_fit``
    for s, d, nb, more in zip(src, dst, nbytes, extra):
        ranks = (s, d + num_src) + tuple(m + num_src for m in (more or ()) if m != d)
        r = max(cur[k] for k in ranks)
        scanned = 0
        while True:
            if r == len(levels):
                levels.append([0] * width)
            lv = levels[r]
            after = [lv[k] + nb for k in ranks]
            if all(a <= budget for a in after) or all(a == nb for a in after):
                break
            r += 1
            scanned += 1
            if scanned == _SCAN and nb <= budget:
                r = _first_fit(levels, ranks, nb, budget, r, cur, low)
        for k, a in zip(ranks, after):
            lv[k] = a
            if a > full and r == cur[k]:
                _advance(cur, k, levels, full)
        rounds.append(r)
    return rounds


#: Rounds a part tries one by one before ``_first_fit`` takes over (most fit in the first).
_SCAN = 4


def _first_fit(levels: list[list[int]], ranks: Sequence[int], nb: int, budget: int, r: int, cur: list[int],
               low: dict[tuple[int, int], int]) -> int:
    """The first round from ``r`` where every rank of ``ranks`` has room for ``nb`` bytes
    (``len(levels)``: a new one), as the one-by-one scan finds it, without rescanning rounds.

    Loads only grow, so a round without room for ``nb`` on rank ``k`` never gets it again,
    and rounds before ``cur[k]`` are never tried for ``k``: ``low[(k, nb)]`` remembers where
    that prefix ends. Parts of one size to one busy sender would otherwise each rescan all
    its rounds left just short of full (quadratic: minutes on a 2000-round plan)."""
    n = len(levels)
    while r < n:
        moved = False
        for k in ranks:
            x = low.get((k, nb), 0)
            if cur[k] > x:
                x = cur[k]
            while x < n and levels[x][k] + nb > budget:
                x += 1
            low[(k, nb)] = x  # the first round k has room for nb in
            if x < r:
                x = r
                while x < n and levels[x][k] + nb > budget:
                    x += 1
            if x > r:
                r, moved = x, True
        if not moved:
            break
    return r


def _advance(cur: list[int], k: int, levels: list[list[int]], full: int) -> None:
    """Move rank slot ``k`` past the rounds it has filled."""
    r = cur[k]
    while r < len(levels) and levels[r][k] > full:
        r += 1
    cur[k] = r
