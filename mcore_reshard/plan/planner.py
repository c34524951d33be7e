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
                       chosen among the replicas by bytes already assigned (largest first).
5. ``merge``           adjacent fragments between the same pair of local tensors become one.
6. ``bucket``          fragments split to the byte budget and packed into rounds so no rank
                       sends or receives more than ``bucket_bytes`` in one round.

Cost: a full-size MoE plan has ~300k transfers, so the per-fragment work is kept to a few
small objects and one int sort key. Intersections are computed once per distinct destination
box (replicated engines repeat every box), sender choice walks fragments one by one only
where there is a choice, merge only sees local tensors that get several fragments of one
canonical tensor, and the cycle collector is paused while planning. The plan is the same as
the straightforward one-sort-per-phase version: ``tests/test_plan_speed.py`` pins digests.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import math
import operator
import time
from collections import defaultdict
from typing import Iterable, Iterator, NamedTuple, Sequence

from ..layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from .types import PlanError, Transfer, TransferPlan

__all__ = ["build_plan", "check_sides", "index_sources", "check_dest"]


class _Replica(NamedTuple):
    """A source rank holding one unique box, and where it holds it."""

    rank: int
    name: str
    view: View


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
    for param in src.params:
        _check_param_dtype(param, src, "source")
        for piece in param.pieces:
            box = piece.box
            key = (piece.canonical, box.offsets, box.sizes)
            reps = found.get(key)
            if reps is None:
                reps = found[key] = index[piece.canonical][box] = []
            reps.append(_Replica(piece.rank, piece.local_name, piece.view))
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


def check_dest(dst: SideLayout) -> list[tuple[int, str, int]]:
    """Validate destination pieces; return the padding each local tensor zero-fills itself."""
    padding = []
    inside: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()  # (tensor, offsets, sizes) checked
    lengths: _Lengths = {}
    for param in dst.params:
        _check_param_dtype(param, dst, "destination")
        covered = 0
        for piece in param.pieces:
            box = piece.box
            key = (piece.canonical, box.offsets, box.sizes)
            if key not in inside:
                shape, _ = dst.tensors.get(piece.canonical, (None, None))
                if shape is None:
                    raise PlanError(f"{param.name} (rank {param.rank}): unknown canonical tensor {piece.canonical!r}")
                if not Box.full(shape).contains(box):
                    raise PlanError(f"{param.name} (rank {param.rank}): box {box} outside {piece.canonical} {shape}")
                inside.add(key)
            if piece.view.shape != box.sizes:
                raise PlanError(f"{param.name} (rank {param.rank}): view shape {piece.view.shape} != box {box.sizes}")
            covered += box.numel
        numel = param.numel
        _check_disjoint_views(param, numel, lengths)
        if numel != covered:
            padding.append((param.rank, param.name, numel - covered))
    return padding


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
) -> TransferPlan:
    """Plan a refit from ``src`` (training) to ``dst`` (inference). See module docstring."""
    t0 = time.perf_counter()
    with _gc_paused():
        plan = _build_plan(src, dst, bucket_bytes, allow_cast, not_direct)
    object.__setattr__(plan, "plan_seconds", time.perf_counter() - t0)
    return plan


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates a few objects per transfer and frees none of them: the cycle
    collector would rescan them all again and again (about 40% of a full-size plan)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _build_plan(
    src: SideLayout, dst: SideLayout, bucket_bytes: int, allow_cast: bool, not_direct: Iterable[tuple[str, str]]
) -> TransferPlan:
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    casts = check_sides(src, dst, allow_cast=allow_cast)
    index = index_sources(src)
    padding = check_dest(dst)
    dtype = _dtype(dst)
    itemsize = DTYPE_BYTES[dtype]
    order = {name: i for i, name in enumerate(dst.tensors)}

    hits = _fragment(dst, index, order)
    fixed, maybe = _choose_senders(hits, src.world_size, itemsize)
    merged, first_numel = _merge(maybe)
    shapes = {name: shape for name, (shape, _) in dst.tensors.items()}
    num_dst = max(dst.world_size, 1 + max((p.rank for p in dst.params), default=0))
    transfers, num_buckets = _bucket(fixed + merged, first_numel, itemsize, bucket_bytes, (src.world_size, num_dst), shapes)

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
    )
    if plan.bytes_planned != plan.bytes_min:
        raise PlanError(
            f"planned {plan.bytes_planned} bytes but the destination holds {plan.bytes_min}: coverage is not exact "
            f"({_first_uncovered(dst, plan)})"
        )
    return plan


def _dtype(dst: SideLayout) -> str:
    """One element type per refit: the wire carries the destination's."""
    by_dtype: dict[str, str] = {}
    for name, (_, d) in dst.tensors.items():
        by_dtype.setdefault(d, name)
    if len(by_dtype) != 1:
        raise PlanError("mixed element types on the destination: " + ", ".join(f"{n} is {d}" for d, n in by_dtype.items()))
    return next(iter(by_dtype))


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


class _Frag(NamedTuple):
    """The part of a destination piece one hit covers (field names as in Piece)."""

    rank: int
    local_name: str
    view: View


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


def _fragment(dst: SideLayout, index: dict[str, dict[Box, list[_Replica]]], order: dict[str, int]) -> list[_Hit]:
    """Intersect every destination piece with the source boxes of its tensor.

    Destination replicas (vLLM DP ranks, engine replicas) repeat the same box: the
    intersections are computed once per (tensor, box) and each piece only adds a site. A
    piece whose local tensor gets several fragments of one canonical tensor (the only ones
    that can merge) is cut into ``_Frag`` sites even when one hit covers it.
    """
    sources = {name: _SourceBoxes(boxes) for name, boxes in index.items()}
    memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[_Hit]] = {}
    cuts: dict[tuple, list[View]] = {}  # (tensor, box, view offset, view stride) -> view per hit
    out: list[_Hit] = []
    for param in dst.params:
        pieces = param.pieces
        found = []
        for piece in pieces:
            box = piece.box
            key = (piece.canonical, box.offsets, box.sizes)
            hits = memo.get(key)
            if hits is None:
                hits = memo[key] = _hits(piece, sources[piece.canonical], order[piece.canonical])
                out.extend(hits)
            found.append(hits)
        if all(len(hits) == 1 for hits in found) and (
            len(pieces) == 1 or len({p.canonical for p in pieces}) == len(pieces)
        ):
            for piece, (hit,) in zip(pieces, found):
                hit.sites.append(piece)  # one hit covering the whole piece: the piece is the fragment
            continue
        for piece, hits in zip(pieces, found):
            view, box = piece.view, piece.box
            key = (piece.canonical, box.offsets, box.sizes, view.offset, view.stride)
            views = cuts.get(key)
            if views is None:
                views = cuts[key] = [view.sub(box, hit.box) for hit in hits]
            for hit, cut in zip(hits, views):
                hit.sites.append(_Frag(piece.rank, piece.local_name, cut))
    return out


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
    if len(sources.boxes) == 1:  # the whole tensor (it tiles), so it holds the whole piece
        sbox, replicas, ranks = sources.boxes[0]
        return [_Hit(order, piece.canonical, box, sbox, replicas, ranks, [], [])]
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


def _choose_senders(hits: list[_Hit], num_src: int, itemsize: int) -> tuple[list[_Move], list[_Move]]:
    """One sender per fragment: the replica with the fewest bytes so far, largest fragments
    first (LPT), ties broken by rank -- deterministic on every rank.

    Fragments go in (size desc, tensor, dst rank, dst name, dst offset) order. Only groups of
    one (size, tensor) that contain a choice are ordered fragment by fragment; elsewhere the
    sender is forced and only its byte count matters. Returns the moves that cannot merge
    and those that might (cut fragments).
    """
    load = [0] * num_src
    groups: dict[tuple[int, int], list[_Hit]] = defaultdict(list)
    for hit in hits:
        groups[(-hit.box.numel, hit.order)].append(hit)
    for key in sorted(groups):
        group = groups[key]
        nbytes = group[0].box.numel * itemsize
        if all(len(h.ranks) == 1 for h in group):
            for h in group:
                load[h.ranks[0]] += nbytes * len(h.sites)
            continue
        frags = [(f.rank, f.local_name, f.view.offset, h, i) for h in group for i, f in enumerate(h.sites)]
        frags.sort(key=lambda e: e[:3])  # unique: destination views of one tensor are disjoint
        for _, _, _, h, i in frags:
            ranks = h.ranks
            if len(ranks) == 1:
                load[ranks[0]] += nbytes
                continue
            if not h.senders:
                h.senders.extend([0] * len(h.sites))
            loads = list(map(load.__getitem__, ranks))
            best = loads.index(min(loads))  # ranks ascend: the least-loaded, then lowest rank
            h.senders[i] = best
            load[ranks[best]] += nbytes
    fixed: list[_Move] = []
    maybe: list[_Move] = []
    for h in hits:
        order, canonical, box, src_box = h.order, h.canonical, h.box, h.src_box
        same = box == src_box
        if not h.senders:  # one replica: the common case, kept tight
            rep = h.replicas[0]
            rank, name, sview = rep.rank, rep.name, rep.view if same else rep.view.sub(src_box, box)
            for f in h.sites:
                move = _Move(order, rank, f.rank, canonical, box, name, sview, f.local_name, f.view)
                (maybe if type(f) is _Frag else fixed).append(move)
            continue
        views: dict[int, View] = {}  # replica index -> view of the hit's box
        for f, k in zip(h.sites, h.senders):
            rep = h.replicas[k]
            sview = views.get(k)
            if sview is None:
                sview = views[k] = rep.view if same else rep.view.sub(src_box, box)
            move = _Move(order, rep.rank, f.rank, canonical, box, rep.name, sview, f.local_name, f.view)
            (maybe if type(f) is _Frag else fixed).append(move)
    return fixed, maybe


def _merge(moves: list[_Move]) -> tuple[list[_Move], dict[_Move, int]]:
    """Fuse fragments adjacent in one dim whose source and destination views continue each
    other (same local tensors, same strides), so a contiguous TP shard is one transfer.

    Only fragments whose destination tensor gets several of one canonical tensor can fuse.
    Returns the moves and, for fused ones, the size of their first fragment: the order
    between otherwise equal transfers depends on it (see ``_bucket``).
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
    return out, {out[i]: n for i, n in first_numel.items()}


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


def _split(m: _Move, itemsize: int, budget: int) -> list[_Move]:
    """Cut a fragment larger than the budget into boxes that fit: along the outermost dim
    whose trailing slab fits the budget, one index at a time along the dims before it."""
    box = m.box
    if box.numel * itemsize <= budget:
        return [m]
    if itemsize > budget:
        raise PlanError(f"{m.canonical}: bucket budget {budget} bytes is smaller than one element")
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
            parts.append(m._replace(box=sub, src_view=m.src_view.sub(box, sub), dst_view=m.dst_view.sub(box, sub)))
    return parts


def _bucket(
    moves: list[_Move],
    first_numel: dict[_Move, int],
    itemsize: int,
    budget: int,
    ranks: tuple[int, int],
    shapes: dict[str, tuple[int, ...]],
) -> tuple[list[Transfer], int]:
    """Pack transfers into rounds so each rank sends <= budget and receives <= budget per
    round; tensors go in model order so the receiver can finish layers early.

    Parts are placed in (tensor, src, dst, offsets) order, one int key per part (the offsets
    as a row-major index); equal keys (a rank receiving the same elements twice) fall back to
    the merge order of their fragments. The result is sorted by (round, src, dst, tensor,
    offsets): parts are grouped by (round, src, dst) in placement order.
    """
    num_src, num_dst = ranks
    if itemsize > budget and moves:  # named as always: the first in (src, dst, tensor) order
        first = min(moves, key=lambda m: (m.src, m.dst, m.order))
        raise PlanError(f"{first.canonical}: bucket budget {budget} bytes is smaller than one element")
    parts, parent = moves, range(len(moves))  # part i comes from move parent[i]
    limit = budget // itemsize
    if any(m.box.numel > limit for m in moves):
        parts, parent = [], []
        for j, m in enumerate(moves):
            cut = _split(m, itemsize, budget)
            parts.extend(cut)
            parent.extend([j] * len(cut))
    strides = {name: contiguous_strides(shape) for name, shape in shapes.items()}
    span = 1 + max((math.prod(shape) for shape in shapes.values()), default=0)
    mul = operator.mul
    keys = [
        ((m.order * num_src + m.src) * num_dst + m.dst) * span + sum(map(mul, m.box.offsets, strides[m.canonical]))
        for m in parts
    ]
    placed = sorted(range(len(parts)), key=keys.__getitem__)
    if len(set(keys)) < len(keys):

        def merge_order(i: int) -> tuple:
            m = moves[parent[i]]
            return (keys[i], m.src_name, m.dst_name, m.box.offsets, -first_numel.get(m, m.box.numel), m.dst_view.offset)

        placed.sort(key=merge_order)
    send: list[list[int]] = [[] for _ in range(num_src)]  # bytes per round, per rank
    recv: list[list[int]] = [[] for _ in range(num_dst)]
    cur_s = [0] * num_src  # first round each rank can still fill
    cur_d = [0] * num_dst
    full = budget - (budget >> 6)  # a round with less than 1/64 of the budget left is skipped
    rounds: dict[int, list[Transfer]] = defaultdict(list)  # (round, src, dst) -> transfers in order
    for i in placed:
        m = parts[i]
        s, d, nbytes = m.src, m.dst, m.box.numel * itemsize
        sl, rl = send[s], recv[d]
        r = cur_s[s] if cur_s[s] >= cur_d[d] else cur_d[d]
        while True:
            if len(sl) <= r:
                sl.extend([0] * (r + 1 - len(sl)))
            if len(rl) <= r:
                rl.extend([0] * (r + 1 - len(rl)))
            if (sl[r] + nbytes <= budget and rl[r] + nbytes <= budget) or (sl[r] == 0 and rl[r] == 0):
                break
            r += 1
        sl[r] += nbytes
        rl[r] += nbytes
        while cur_s[s] < len(sl) and sl[cur_s[s]] > full:
            cur_s[s] += 1
        while cur_d[d] < len(rl) and rl[cur_d[d]] > full:
            cur_d[d] += 1
        rounds[(r * num_src + s) * num_dst + d].append(
            Transfer(s, d, m.canonical, m.box, m.src_name, m.src_view, m.dst_name, m.dst_view, nbytes, r)
        )
    transfers = [t for key in sorted(rounds) for t in rounds[key]]
    num_buckets = transfers[-1].bucket + 1 if transfers else 0
    return transfers, num_buckets
