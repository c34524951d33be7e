"""Phases 2 and 3 of the planner: fragments, each with its sender, then merged.

``fragment``        destination box x source box intersections: computed once per distinct
                    destination box and shared by its sites (engine replicas, DP ranks); a
                    local tensor of a kind already seen (``param_kinds``) reuses its hits.
``choose_senders``  one sender per fragment chosen among the replicas by bytes already
                    assigned (largest first); with link costs the cheapest link to the
                    destination first (a holder on the same device, then the same node).
``merge``           adjacent fragments between the same pair of local tensors become one.

Cost: a full-size MoE plan has ~300k fragments, so a fragment that is a whole destination
piece (the bulk) gets no Python object of its own: fragments travel in blocks (one
``Sender``, a run of destination sites). Records are named tuples built with
``tuple.__new__`` (no Python-level ``__new__`` per object).
"""

from __future__ import annotations

import bisect
import collections
import functools
import itertools
import operator
from collections import defaultdict
from typing import Iterable, NamedTuple

from ..layout.descriptor import Box, Piece, SideLayout, View
from .types import PlanError
from .validate import Replica

__all__ = ["Sender", "Hit", "Frag", "Move", "Blocks", "new_sender", "new_frag", "fragment", "choose_senders", "merge",
           "add_moves"]


class Sender(NamedTuple):
    """A source rank sending one box (inside its source box), as every fragment of a block
    shares it: one per hit and replica."""

    order: int  # model order of the canonical tensor
    src: int
    canonical: str
    box: Box
    src_name: str
    src_view: View


#: ``Sender`` from one tuple (all fields), without the Python-level ``__new__`` of a named
#: tuple (one per hit: tens of thousands in a full-size plan); likewise ``_new_hit`` & co.
new_sender = functools.partial(tuple.__new__, Sender)
_RANKS = operator.attrgetter("ranks")


class Hit(NamedTuple):
    """One destination box x source box intersection, computed once per distinct destination
    box and shared by every destination piece with that box (engine replicas, DP ranks)."""

    order: int  # model order of the canonical tensor
    canonical: str
    box: Box  # the intersection
    src_box: Box  # the unique source box it lies in
    replicas: list[Replica]  # sorted by rank (stable)
    ranks: list[int]  # the replicas' ranks
    #: One fragment per destination piece it lands in: the piece itself when it is its local
    #: tensor's only fragment of this canonical tensor, else a ``Frag`` (may merge).
    sites: list[Piece | Frag]
    senders: list[int]  # per site, the chosen replica's index (empty: the only one)
    #: With one replica, its sender (see ``Blocks``), made while the hit is at hand.
    sender: Sender | None = None


_new_hit = functools.partial(tuple.__new__, Hit)  # as ``new_sender``


class Frag(NamedTuple):
    """The part of a destination piece one hit covers (field names as in Piece)."""

    rank: int
    local_name: str
    view: View


new_frag = functools.partial(tuple.__new__, Frag)  # as ``new_sender``


class Move(NamedTuple):
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


_new_move = functools.partial(tuple.__new__, Move)  # as ``new_sender``



class Blocks(NamedTuple):
    """Fragments with their senders, in columns: block ``b`` sends ``senders[b]``'s box to the
    next ``counts[b]`` destination sites (``Piece`` or ``Frag``: rank, local_name, view). A
    full-size plan has ~300k fragments but ~8x fewer blocks (destination replicas share one),
    and a whole-piece fragment needs no object of its own: its site is the ``Piece``."""

    senders: list[Sender]
    counts: list[int]
    sites: list[Piece | Frag]


def fragment(
    dst: SideLayout, index: dict[str, dict[Box, list[Replica]]], order: dict[str, int], kinds: list[int]
) -> tuple[list[Hit], set[int]]:
    """Intersect every destination piece with the source boxes of its tensor; return the hits
    and the ids of those that hold cut fragments.

    Destination replicas (vLLM DP ranks, engine replicas) repeat the same box: the
    intersections are computed once per (tensor, box) and each piece only adds a site; a
    local tensor of a kind already seen (``param_kinds``) reuses its kind's hits outright. A
    piece whose local tensor gets several fragments of one canonical tensor (the only ones
    that can merge) is cut into ``Frag`` sites even when one hit covers it.
    """
    sources: dict[str, _SourceBoxes | tuple] = {}  # by tensor, built on first use (``_source_boxes``)
    memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Hit]] = {}
    cuts: dict[tuple, list[View]] = {}  # (tensor, box, view offset, view stride) -> view per hit
    by_kind: dict[int, tuple[list[list[Piece | Frag]] | None, list[list[Hit]]]] = {}
    out: list[Hit] = []
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
                hit.sites.append(new_frag((piece.rank, piece.local_name, view_cut)))
    return out, cut


def _piece_hits(
    piece: Piece,
    memo: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[Hit]],
    sources: dict[str, _SourceBoxes | tuple],
    index: dict[str, dict[Box, list[Replica]]],
    order: dict[str, int],
    out: list[Hit],
) -> list[Hit]:
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


def _source_boxes(boxes: dict[Box, list[Replica]]) -> _SourceBoxes | tuple[Box, list[Replica], list[int]]:
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

    def __init__(self, boxes: dict[Box, list[Replica]]) -> None:
        by_rank = operator.attrgetter("rank")
        self.boxes = []
        for b in sorted(boxes, key=lambda sbox: sbox.offsets[:1]):
            reps = boxes[b] if len(boxes[b]) == 1 else sorted(boxes[b], key=by_rank)
            self.boxes.append((b, reps, [r.rank for r in reps]))
        self.starts = [b.offsets[0] if b.offsets else 0 for b, _, _ in self.boxes]
        self.reach = max((b.sizes[0] for b, _, _ in self.boxes if b.sizes), default=0)

    def near(self, box: Box) -> list[tuple[Box, list[Replica], list[int]]]:
        if not box.offsets:
            return self.boxes
        lo = bisect.bisect_right(self.starts, box.offsets[0] - self.reach)
        hi = bisect.bisect_left(self.starts, box.offsets[0] + box.sizes[0])
        return self.boxes[lo:hi]


def _hits(piece: Piece, sources: _SourceBoxes, order: int) -> list[Hit]:
    """The intersections of one destination box, which must add up to it."""
    box = piece.box
    hits = []
    covered = 0
    for sbox, replicas, ranks in sources.near(box):
        sub = box.intersect(sbox)
        if sub is not None:
            hits.append(Hit(order, piece.canonical, box if sub == box else sub, sbox, replicas, ranks, [], []))
            covered += sub.numel
    if covered != piece.numel:
        raise PlanError(
            f"{piece.local_name} (destination rank {piece.rank}): {piece.canonical} box {piece.box} "
            f"is covered {covered} of {piece.numel} elements by the source"
        )
    return hits


def choose_senders(hits: list[Hit], cut: set[int], num_src: int, itemsize: int,
                    costs: list[list[int]] | None = None) -> tuple[Blocks, list[Move]]:
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
    #: (replica ranks as an int, destination rank) as one int -> the indices and ranks of the
    #: replicas on the cheapest link. Keyed by the ranks' values: expert tensors each have
    #: their own replica lists, alike on every layer (one key per list would be one per
    #: fragment); a list's int is looked up by identity (they live while planning).
    cheapest: dict[int, tuple[list[int], list[int]]] = {}
    ranks_ids: dict[int, int] = {}
    distinct: dict[tuple[int, ...], int] = {}
    width = len(costs) if costs is not None else 0
    by_size: dict[tuple[int, int], list[Hit]] = defaultdict(list)  # (size desc, tensor) -> its hits
    for hit in hits:
        by_size[(-hit.box.numel, hit.order)].append(hit)
    for key in sorted(by_size):
        same = by_size[key]
        nbytes = same[0].box.numel * itemsize
        if max(map(len, map(_RANKS, same))) == 1:
            for h in same:
                load[h.ranks[0]] += nbytes * len(h.sites)
            continue
        frags = [(f.rank, f.local_name, f.view.offset) for h in same for f in h.sites]
        where = [(h, i) for h in same for i in range(len(h.sites))]
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
                k = ranks_ids.get(id(ranks))
                if k is None:
                    k = ranks_ids[id(ranks)] = distinct.setdefault(tuple(ranks), len(distinct))
                k = k * width + d
                entry = cheapest.get(k)
                if entry is None:
                    row = costs[d]
                    low = min(row[r] for r in ranks)
                    cand = [j for j, r in enumerate(ranks) if row[r] == low]
                    entry = cheapest[k] = (cand, [ranks[j] for j in cand])
                cand, cand_ranks = entry
                if len(cand) == 1:
                    best = cand[0]
                else:
                    loads = list(map(load.__getitem__, cand_ranks))
                    best = cand[loads.index(min(loads))]
            h.senders[i] = best
            load[ranks[best]] += nbytes
    return _emit(hits, cut)


def _emit(hits: list[Hit], cut: set[int]) -> tuple[Blocks, list[Move]]:
    """Gather every site of every hit into blocks by sender or, for cut fragments, into
    ``Move``s to merge. Sites keep their order: hit by hit, site by site. ``cut``: the ids
    of the hits that hold cut fragments (only those need looking at site by site)."""
    blocks = Blocks([], [], [])
    senders, counts, out = blocks
    maybe: list[Move] = []
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
            by_replica: dict[int, Sender] = {0: sender}  # replica index -> its sender
            chosen: Iterable[int] = itertools.repeat(0, len(sites))
        else:
            by_replica, chosen = {}, h.senders
        for f, k in zip(sites, chosen):
            sender = by_replica.get(k)
            if sender is None:
                sender = by_replica[k] = _sender(order, canonical, h.replicas[k], box, src_box)
            if type(f) is Frag:
                _, src, _, _, src_name, sview = sender
                maybe.append(_new_move((order, src, f.rank, canonical, box, src_name, sview, f.local_name, f.view)))
            else:
                senders.append(sender)
                counts.append(1)
                out.append(f)
    return blocks, maybe


def _sender(order: int, canonical: str, rep: Replica, box: Box, src_box: Box) -> Sender:
    """The sender of replica ``rep`` sending ``box`` (inside its ``src_box``)."""
    same = box is src_box or (box.offsets == src_box.offsets and box.sizes == src_box.sizes)
    return new_sender((order, rep.rank, canonical, box, rep.name, rep.view if same else _sub_view(rep.view, src_box, box)))


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


def add_moves(blocks: Blocks, moves: list[Move]) -> None:
    """Append moves as blocks of one site each."""
    senders, counts, sites = blocks
    for m in moves:
        senders.append(new_sender((m.order, m.src, m.canonical, m.box, m.src_name, m.src_view)))
        counts.append(1)
        sites.append(new_frag((m.dst, m.dst_name, m.dst_view)))


def merge(moves: list[Move]) -> tuple[list[Move], dict[int, int]]:
    """Fuse fragments adjacent in one dim whose source and destination views continue each
    other (same local tensors, same strides), so a contiguous TP shard is one transfer.

    Only fragments whose destination tensor gets several of one canonical tensor can fuse.
    Returns the moves and, by index, the size of the first fragment of each fused one: the
    order between otherwise equal transfers depends on it (see ``buckets.assign``).
    """
    moves.sort(key=_merge_key)
    out: list[Move] = []
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


def _merge_key(m: Move) -> tuple:
    """Merge order: same local tensors together, then by offsets; the fragments' sender-choice
    order, (size desc, destination offset), breaks what is left."""
    return (m.src, m.dst, m.order, m.src_name, m.dst_name, m.box.offsets, -m.box.numel, m.dst_view.offset)


def _try_merge(a: Move, b: Move) -> Move | None:
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

