"""The floor over the fabric: *one copy per destination node*.

What a node's inference ranks hold, minus what a training rank on the same node already
holds, has to cross into that node once (:func:`inter_node_minimum`); the placement report
sets a plan's inter-node bytes next to it, and the relay choice names the tensors a plan moves
more of (:func:`over_floor`). Pure metadata, like the planner.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from ..layout import Box, SideLayout
from ..layout.descriptor import DTYPE_BYTES
from ..layout.memo import IdentityCache
from .placement import Location, RankPlacement
from .types import TransferPlan

__all__ = ["inter_node_minimum", "node_floors", "hf_ipc_bytes", "over_floor", "why_over"]


def _covered(boxes: Sequence[Box], minus: Sequence[Box] = ()) -> int:
    """Elements covered by the union of ``boxes`` and not by the union of ``minus``: a sweep,
    one dimension at a time, over the slabs between box edges, each slab keeping only the
    boxes that reach into it (a slab one box covers, with nothing to subtract, counts at once)."""
    return _sweep({(b.offsets, b.sizes) for b in boxes}, {(m.offsets, m.sizes) for m in minus})


_Span = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the dimensions left


def _sweep(boxes: set[_Span], minus: set[_Span]) -> int:
    if not boxes:
        return 0
    if not minus and len(boxes) == 1:
        return math.prod(next(iter(boxes))[1])
    if not next(iter(boxes))[0]:  # no dimension left: one cell, inside some box
        return 0 if minus else 1
    cuts = sorted({o[0] + e for o, n in (*boxes, *minus) for e in (0, n[0])})
    total = 0
    for lo, hi in zip(cuts, cuts[1:]):
        inside = {(o[1:], n[1:]) for o, n in boxes if o[0] <= lo < o[0] + n[0]}
        if inside:
            cut = {(o[1:], n[1:]) for o, n in minus if o[0] <= lo < o[0] + n[0]}
            total += (hi - lo) * _sweep(inside, cut)
    return total


def _spans_by_node(side: SideLayout, locs: Sequence[Location]) -> dict[int, dict[str, set[_Span]]]:
    """node -> tensor -> the distinct boxes its ranks hold, as spans. The rules share Box
    objects between ranks (a full-size vLLM side: ~300k pieces, ~1k boxes): pieces are
    gathered by box identity first, one dict store each, and turned into spans once."""
    by_id: dict[int, dict[str, dict[int, Box]]] = {}
    for p in side.params:
        tensors = by_id.setdefault(locs[p.rank].node, {})
        for q in p.pieces:
            boxes = tensors.get(q.canonical)
            if boxes is None:
                boxes = tensors[q.canonical] = {}
            boxes[id(q.box)] = q.box
    return {node: {name: {(b.offsets, b.sizes) for b in boxes.values()} for name, boxes in tensors.items()}
            for node, tensors in by_id.items()}


#: node_floors by (layouts, placement, itemsize): one plan's report asks for them several
#: times (direct vs relayed, then the CLI), the relay choice once more (``over_floor``).
_FLOOR_CACHE = IdentityCache(8)


def inter_node_minimum(src: SideLayout, dst: SideLayout, placement: RankPlacement, itemsize: int) -> int:
    """Bytes that must cross into destination nodes: per node, the distinct elements its
    inference ranks hold (padding excluded: it is never sent) that no training rank on the
    same node holds."""
    return sum(_node_floors(src, dst, placement, itemsize).values())


def clear_floor_cache() -> None:
    _FLOOR_CACHE.clear()


def node_floors(src: SideLayout, dst: SideLayout, placement: RankPlacement,
                itemsize: int) -> dict[tuple[int, str], int]:
    """(destination node, tensor) -> bytes of it that must cross into that node."""
    return dict(_node_floors(src, dst, placement, itemsize))


def _node_floors(src: SideLayout, dst: SideLayout, placement: RankPlacement,
                 itemsize: int) -> dict[tuple[int, str], int]:
    """:func:`node_floors`, cached (callers here only read it)."""
    return _FLOOR_CACHE.get((src, dst), (placement, itemsize), lambda: _floors(src, dst, placement, itemsize))


def _floors(src: SideLayout, dst: SideLayout, placement: RankPlacement, itemsize: int) -> dict[tuple[int, str], int]:
    held = _spans_by_node(dst, placement.dst)
    local = _spans_by_node(src, placement.src)
    size = _element_bytes(dst, itemsize)
    # the layers repeat a few box patterns thousands of times (experts x layers x nodes):
    # each distinct (held, minus) pair is swept once
    covered: dict[tuple[frozenset, frozenset], int] = {}
    floors = {}
    for node, tensors in held.items():
        here = local.get(node, {})
        for name, spans in tensors.items():
            minus = here.get(name, set())
            k = (frozenset(spans), frozenset(minus))
            n = covered.get(k)
            if n is None:
                n = covered[k] = _sweep(spans, minus)
            floors[(node, name)] = n * size.get(name, itemsize)
    return floors


def _element_bytes(dst: SideLayout, itemsize: int) -> dict[str, int]:
    """Bytes per element of each destination tensor: the wire's (``itemsize``), or its own for
    one carried as its bits (e.g. an fp32 router bias in a bf16 plan)."""
    return {name: DTYPE_BYTES.get(d, itemsize) for name, (_, d) in dst.tensors.items()}


def hf_ipc_bytes(dst: SideLayout, itemsize: int) -> int:
    """NeMo RL's colocated path: every inference rank receives every full HF tensor over IPC."""
    size = _element_bytes(dst, itemsize)
    full = sum(_numel(shape) * size[name] for name, (shape, _) in dst.tensors.items())
    return dst.world_size * full


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def over_floor(plan: TransferPlan, src: SideLayout, dst: SideLayout,
               placement: RankPlacement) -> list[tuple[int, str, int, int]]:
    """(node, tensor, bytes moved into it, floor) of every destination tensor whose bytes into
    some node exceed that node's floor, in (node, tensor) order."""
    moved: dict[tuple[int, str], int] = {}
    for t in plan.transfers:
        if placement.link(t.src, t.dst) == "inter_node":
            key = (placement.dst[t.dst].node, t.canonical)
            moved[key] = moved.get(key, 0) + t.nbytes
    floors = _node_floors(src, dst, placement, plan.itemsize)
    return [(node, name, nb, floors.get((node, name), 0)) for (node, name), nb in sorted(moved.items())
            if nb > floors.get((node, name), 0)]


def why_over(dst: SideLayout, placement: RankPlacement, over: Sequence[tuple[int, str, int, int]]) -> str:
    """Why relays miss the floor for ``over``: the one cause the relays leave to the direct
    path is a rank holding a box twice (the floor counts it once per node)."""
    want = {(node, name) for node, name, _, _ in over}
    seen: set[tuple[int, str, Box]] = set()
    for p in dst.params:
        for q in p.pieces:
            if (placement.dst[p.rank].node, q.canonical) in want:
                k = (p.rank, q.canonical, q.box)
                if k in seen:
                    return (f"destination rank {p.rank} holds {q.canonical} {q.box.offsets}+{q.box.sizes} twice, "
                            f"e.g. as two redundant expert slots")
                seen.add(k)
    return "no relay group takes them into the node once"
