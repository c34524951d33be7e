"""The planner: intersect source and destination pieces into a minimal-bytes transfer plan.

Pure and deterministic: it imports neither megatron nor vllm and works on descriptors alone,
so full-size plans can be computed and checked anywhere. Phases, in the spirit of DCP's
planner (local plan -> global plan -> finish):

1. ``check_sides``     both sides describe the same canonical tensors (name, shape, dtype).
2. ``index_sources``   unique source boxes per tensor, each with its replicas; the boxes must
                       tile every tensor exactly (no gap, no overlap).
3. ``check_dest``      every destination piece lies inside its tensor and no two pieces of one
                       local tensor overlap (so every destination element is written once).
4. ``fragment``        destination box x source box intersections, one sender per fragment
                       chosen among the replicas by bytes already assigned (largest first).
5. ``merge``           adjacent fragments between the same pair of local tensors become one.
6. ``bucket``          fragments split to the byte budget and packed into rounds so no rank
                       sends or receives more than ``bucket_bytes`` in one round.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from typing import Iterable, Sequence

from ..layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View
from .types import PlanError, Transfer, TransferPlan

__all__ = ["build_plan", "check_sides", "index_sources", "check_dest"]

# A source replica: (rank, local name, view of the unique box).
_Replica = tuple[int, str, View]


def check_sides(src: SideLayout, dst: SideLayout, *, allow_cast: bool = False) -> None:
    """Both sides must describe the same canonical tensors, or the refit would be wrong."""
    missing = sorted(set(dst.tensors) - set(src.tensors))
    if missing:
        raise PlanError(
            f"destination needs {len(missing)} tensor(s) the source does not describe, e.g. {missing[0]!r}"
        )
    for name, (shape, dtype) in dst.tensors.items():
        s_shape, s_dtype = src.tensors[name]
        if tuple(s_shape) != tuple(shape):
            raise PlanError(f"{name}: source shape {tuple(s_shape)} != destination shape {tuple(shape)}")
        if s_dtype != dtype and not allow_cast:
            raise PlanError(f"{name}: source dtype {s_dtype} != destination dtype {dtype} (no explicit cast)")
    unneeded = sorted(set(src.tensors) - set(dst.tensors))
    if unneeded:
        raise PlanError(
            f"source tensor {unneeded[0]!r} (and {len(unneeded) - 1} more) has no place on the destination"
        )


def index_sources(src: SideLayout) -> dict[str, dict[Box, list[_Replica]]]:
    """Unique boxes per canonical tensor with the replicas holding each, checked to tile it."""
    index: dict[str, dict[Box, list[_Replica]]] = defaultdict(dict)
    for param in src.params:
        _check_param_dtype(param, src, "source")
    for piece in src.pieces():
        index[piece.canonical].setdefault(piece.box, []).append((piece.rank, piece.local_name, piece.view))
    for name, (shape, _dtype) in src.tensors.items():
        boxes = index.get(name)
        if not boxes:
            raise PlanError(f"{name}: no source rank holds any part of it")
        _check_tiling(name, shape, list(boxes), "source")
    return index


def _check_tiling(name: str, shape: Sequence[int], boxes: list[Box], side: str) -> None:
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


def check_dest(dst: SideLayout) -> list[tuple[int, str, int]]:
    """Validate destination pieces; return the padding each local tensor zero-fills itself."""
    padding = []
    for param in dst.params:
        _check_param_dtype(param, dst, "destination")
        for piece in param.pieces:
            shape, _ = dst.tensors.get(piece.canonical, (None, None))
            if shape is None:
                raise PlanError(f"{param.name} (rank {param.rank}): unknown canonical tensor {piece.canonical!r}")
            if not Box.full(shape).contains(piece.box):
                raise PlanError(f"{param.name} (rank {param.rank}): box {piece.box} outside {piece.canonical} {shape}")
            if piece.view.shape != piece.box.sizes:
                raise PlanError(f"{param.name} (rank {param.rank}): view shape {piece.view.shape} != box {piece.box.sizes}")
        _check_disjoint_views(param)
        if param.padding:
            padding.append((param.rank, param.name, param.padding))
    return padding


def _check_param_dtype(param: LocalParam, side: SideLayout, what: str) -> None:
    for piece in param.pieces[:1]:
        _, dtype = side.tensors.get(piece.canonical, (None, param.dtype))
        if dtype != param.dtype:
            raise PlanError(f"{param.name} ({what} rank {param.rank}) holds {param.dtype} but {piece.canonical} is {dtype}")


def _check_disjoint_views(param: LocalParam) -> None:
    """No local element is written twice; exact element sets only when extents interleave."""
    numel = param.numel
    spans = sorted(((p.view.extent(), p) for p in param.pieces), key=lambda span: span[0])
    interleaved = False
    for ((lo, hi), piece) in spans:
        if lo < 0 or hi > numel:
            raise PlanError(f"{param.name} (rank {param.rank}): piece of {piece.canonical} reaches outside the local tensor")
    for ((_, hi_a), _), ((lo_b, _), _) in zip(spans, spans[1:]):
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
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    check_sides(src, dst, allow_cast=allow_cast)
    index = index_sources(src)
    padding = check_dest(dst)
    dtype = _dtype(dst)
    itemsize = DTYPE_BYTES[dtype]
    order = {name: i for i, name in enumerate(dst.tensors)}

    frags = _fragment(dst, index, order)
    frags = _choose_senders(frags, index, src.world_size, itemsize)
    merged = _merge(frags)
    transfers, num_buckets = _bucket(merged, itemsize, bucket_bytes)

    dst_numel = sum(p.numel - p.padding for p in dst.params)
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
        notes=tuple(src.notes) + tuple(dst.notes),
    )
    if plan.bytes_planned != plan.bytes_min:
        raise PlanError(
            f"planned {plan.bytes_planned} bytes but the destination holds {plan.bytes_min}: coverage is not exact "
            f"({_first_uncovered(dst, plan)})"
        )
    object.__setattr__(plan, "plan_seconds", time.perf_counter() - t0)
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


# A fragment before sender choice: (order, dst rank, dst name, dst view of fragment, canonical,
# fragment box, source box, numel).
_Frag = tuple


def _fragment(dst: SideLayout, index: dict[str, dict[Box, list[_Replica]]], order: dict[str, int]) -> list[_Frag]:
    """Intersect every destination piece with the source boxes of its tensor.

    Destination replicas (vLLM DP ranks, engine replicas) repeat the same box; the
    intersection is computed once per (tensor, box) and reused.
    """
    memo: dict[tuple[str, Box], list[tuple[Box, Box]]] = {}
    out: list[_Frag] = []
    for piece in dst.pieces():
        key = (piece.canonical, piece.box)
        hits = memo.get(key)
        if hits is None:
            hits = []
            for sbox in index[piece.canonical]:
                sub = piece.box.intersect(sbox)
                if sub is not None:
                    hits.append((sub, sbox))
            memo[key] = hits
        covered = 0
        for sub, sbox in hits:
            view = piece.view if sub == piece.box else piece.view.sub(piece.box, sub)
            out.append((order[piece.canonical], piece.rank, piece.local_name, view, piece.canonical, sub, sbox, sub.numel))
            covered += sub.numel
        if covered != piece.numel:
            raise PlanError(
                f"{piece.local_name} (destination rank {piece.rank}): {piece.canonical} box {piece.box} "
                f"is covered {covered} of {piece.numel} elements by the source"
            )
    return out


def _choose_senders(frags: list[_Frag], index, num_src: int, itemsize: int) -> list[tuple]:
    """One sender per fragment: the replica with the fewest bytes so far, largest fragments
    first (LPT), ties broken by rank -- deterministic on every rank."""
    load = [0] * num_src
    sub_views: dict[tuple[int, str, str, Box], View] = {}
    frags.sort(key=lambda f: (-f[7], f[0], f[1], f[2], f[3].offset))
    out = []
    for order_i, drank, dname, dview, canonical, sub, sbox, n in frags:
        replicas = index[canonical][sbox]
        best = replicas[0]
        if len(replicas) > 1:
            best_load = load[best[0]]
            for rep in replicas[1:]:
                l = load[rep[0]]
                if l < best_load or (l == best_load and rep[0] < best[0]):
                    best, best_load = rep, l
        srank, sname, sview = best
        load[srank] += n * itemsize
        if sub == sbox:
            sv = sview
        else:
            key = (srank, sname, canonical, sub)
            sv = sub_views.get(key)
            if sv is None:
                sv = sub_views[key] = sview.sub(sbox, sub)
        out.append((order_i, srank, drank, canonical, sub, sname, sv, dname, dview))
    return out


def _merge(frags: list[tuple]) -> list[tuple]:
    """Fuse fragments adjacent in one dim whose source and destination views continue each
    other (same local tensors, same strides), so a contiguous TP shard is one transfer."""
    frags.sort(key=lambda f: (f[1], f[2], f[0], f[5], f[7], f[4].offsets))
    out: list[tuple] = []
    for f in frags:
        if out:
            g = out[-1]
            m = _try_merge(g, f)
            if m is not None:
                out[-1] = m
                continue
        out.append(f)
    return out


def _try_merge(a: tuple, b: tuple) -> tuple | None:
    if a[1:4] != b[1:4] or a[5] != b[5] or a[7] != b[7]:
        return None
    ba, bb = a[4], b[4]
    diff = [d for d in range(len(ba.offsets)) if ba.offsets[d] != bb.offsets[d] or ba.sizes[d] != bb.sizes[d]]
    if len(diff) != 1:
        return None
    d = diff[0]
    if ba.offsets[d] + ba.sizes[d] != bb.offsets[d]:
        return None
    sva, svb, dva, dvb = a[6], b[6], a[8], b[8]
    if sva.stride != svb.stride or dva.stride != dvb.stride:
        return None
    if svb.offset != sva.offset + ba.sizes[d] * sva.stride[d] or dvb.offset != dva.offset + ba.sizes[d] * dva.stride[d]:
        return None
    sizes = list(ba.sizes)
    sizes[d] += bb.sizes[d]
    box = Box(ba.offsets, tuple(sizes))
    return (a[0], a[1], a[2], a[3], box, a[5], View(sva.offset, box.sizes, sva.stride), a[7], View(dva.offset, box.sizes, dva.stride))


def _split(f: tuple, itemsize: int, budget: int) -> list[tuple]:
    """Cut a fragment larger than the budget into boxes that fit: along the outermost dim
    whose trailing slab fits the budget, one index at a time along the dims before it."""
    box: Box = f[4]
    if box.numel * itemsize <= budget:
        return [f]
    if itemsize > budget:
        raise PlanError(f"{f[3]}: bucket budget {budget} bytes is smaller than one element")
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
            parts.append((f[0], f[1], f[2], f[3], sub, f[5], f[6].sub(box, sub), f[7], f[8].sub(box, sub)))
    return parts


def _bucket(frags: list[tuple], itemsize: int, budget: int) -> tuple[list[Transfer], int]:
    """Pack transfers into rounds so each rank sends <= budget and receives <= budget per
    round; tensors go in model order so the receiver can finish layers early."""
    frags = [p for f in frags for p in _split(f, itemsize, budget)]
    frags.sort(key=lambda f: (f[0], f[1], f[2], f[3], f[4].offsets))
    send: dict[int, list[int]] = defaultdict(list)
    recv: dict[int, list[int]] = defaultdict(list)
    cur_s: dict[int, int] = defaultdict(int)
    cur_d: dict[int, int] = defaultdict(int)
    placed = []
    for f in frags:
        s, d, nbytes = f[1], f[2], f[4].numel * itemsize
        sl, rl = send[s], recv[d]
        r = max(cur_s[s], cur_d[d])
        while True:
            while len(sl) <= r:
                sl.append(0)
            while len(rl) <= r:
                rl.append(0)
            if (sl[r] + nbytes <= budget and rl[r] + nbytes <= budget) or (sl[r] == 0 and rl[r] == 0):
                break
            r += 1
        sl[r] += nbytes
        rl[r] += nbytes
        # Rounds this rank can no longer fill (less than 1/64 of the budget left) are skipped.
        while cur_s[s] < len(sl) and sl[cur_s[s]] > budget - (budget >> 6):
            cur_s[s] += 1
        while cur_d[d] < len(rl) and rl[cur_d[d]] > budget - (budget >> 6):
            cur_d[d] += 1
        placed.append((r, f))
    placed.sort(key=lambda rf: (rf[0], rf[1][1], rf[1][2], rf[1][0], rf[1][3], rf[1][4].offsets))
    transfers = [
        Transfer(f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[4].numel * itemsize, r) for r, f in placed
    ]
    num_buckets = (placed[-1][0] + 1) if placed else 0
    return transfers, num_buckets
