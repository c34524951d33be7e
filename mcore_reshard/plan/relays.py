"""Fan-out relays: destination ranks of one node that hold the same box form a relay group;
the box crosses into the node once, to one member, which forwards it to the others.

Vocabulary used throughout ``plan/``: a *relay group* is a sorted tuple of destination
ranks (``Relayed.groups``, the ``relays`` pass's record); a transfer's relay group is its index there
(``relay_of``, -1: not relayed), named ``group`` in code.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Sequence

from ..layout import Box, SideLayout, View
from ..layout.descriptor import DTYPE_BYTES, LocalParam
from ..layout.memo import ValueIds
from .placement import RankPlacement
from .extensions import Relayed, Site, member_site
from .types import Transfer, TransferPlan

__all__ = ["Relays", "Site", "relay_groups", "piece_relays", "spread", "misdelivered"]

_SRC, _DST = operator.attrgetter("src"), operator.attrgetter("dst")
#: A destination piece as another rank would hold it identically: see ``_piece_keys``.
_PieceKey = tuple[str, tuple[int, ...], str, str, int, int]


_LOCAL_NAME, _CANONICAL, _BOX, _VIEW = (operator.attrgetter(a) for a in ("local_name", "canonical", "box", "view"))


def _signature(params: Sequence[LocalParam], ids: ValueIds) -> tuple:
    """What a destination rank holds, independent of its rank number."""
    return tuple(sorted((p.name, tuple(p.shape), p.dtype,
                         tuple(zip(map(_LOCAL_NAME, p.pieces), map(_CANONICAL, p.pieces), ids.many(map(_BOX, p.pieces)),
                                   ids.many(map(_VIEW, p.pieces))))) for p in params))


def relay_groups(dst: SideLayout, placement: RankPlacement) -> tuple[tuple[int, ...], ...]:
    """Destination ranks on one node that hold exactly the same pieces (rank r of several
    engines of one layout on that node), as sorted groups of two or more."""
    return _relay_groups(dst, placement, ValueIds())


def _relay_groups(dst: SideLayout, placement: RankPlacement, ids: ValueIds) -> tuple[tuple[int, ...], ...]:
    by_rank: dict[int, list] = {}
    for p in dst.params:
        by_rank.setdefault(p.rank, []).append(p)
    groups: dict[tuple, list[int]] = {}
    for r in sorted(by_rank):
        groups.setdefault((placement.dst[r].node, _signature(by_rank[r], ids)), []).append(r)
    return tuple(sorted(tuple(members) for members in groups.values() if len(members) > 1))


def spread(plan: TransferPlan, groups: tuple[tuple[int, ...], ...], relay_of: list[int],
           sites: tuple[tuple[Site, ...], ...] = ()) -> TransferPlan:
    """Hand each relayed transfer (``relay_of``: its relay group, -1 for none) to the member
    of its group with the fewest bytes so far (plan order; ties to the lower rank): every
    member then receives its share over the fabric and the rest from the other members. The
    buckets were cut with every member's whole share counted (``charges``), so the bucket
    budget holds. ``sites``: boxes the members hold at different places (``Relayed.sites``):
    a transfer handed to another member lands at that member's place."""
    load = {m: 0 for members in groups for m in members}
    # members in rank order: ``min`` by load then keeps the first, the lower rank, on a tie
    ranked = [tuple(sorted(members)) for members in groups]
    index: dict = {}
    out = []
    for t, group in zip(plan.transfers, relay_of):
        if group >= 0:
            a = min(ranked[group], key=load.__getitem__)
            load[a] += t.nbytes
            if a != t.dst:  # (the constructor: ``dataclasses.replace`` costs ~10x, per transfer)
                name, view = member_site(sites, index, t, a) if sites else (t.dst_name, t.dst_view)
                t = Transfer(t.src, a, t.canonical, t.box, t.src_name, t.src_view, name, view, t.nbytes, t.bucket)
        out.append(t)
    # stable: wire order inside each message kept; (bucket, src, dst) as one int key
    num_src = max(plan.num_src, 1 + max(map(_SRC, out), default=0))
    num_dst = max(plan.num_dst, 1 + max(map(_DST, out), default=0))
    keys = [(t.bucket * num_src + t.src) * num_dst + t.dst for t in out]
    order = sorted(range(len(out)), key=keys.__getitem__)
    return plan.extended(Relayed(groups, tuple(relay_of[i] for i in order), sites),
                         transfers=tuple([out[i] for i in order]))


def _piece_keys(p: LocalParam, ids: ValueIds) -> list[_PieceKey]:
    """Each destination piece of ``p`` as another rank would hold it identically (same local
    tensor, same place in it): a box one member receives, unpacked the same way by every
    member. Box and view as ``ids``."""
    n, ps = len(p.pieces), p.pieces
    return list(zip(repeat(p.name, n), repeat(tuple(p.shape), n), repeat(p.dtype, n), map(_CANONICAL, ps),
                    ids.many(map(_BOX, ps)), ids.many(map(_VIEW, ps))))


@dataclass(frozen=True)
class Relays:
    """Fan-out relays of one placement: the destination side reduced to one holder per
    piece per node, the relay groups, and what the planner and ``spread`` need."""

    reduced: SideLayout
    groups: tuple[tuple[int, ...], ...]
    default: dict[int, int]  # holder rank -> relay group of its pieces held by no other holder
    #: (holder, local, canonical) -> (piece box, relay group, the holder's view of it where the
    #: members hold it at different places -- a transfer must land in that piece -- else None)
    shared: dict[tuple[int, str, str], list[tuple[Box, int, View | None]]]
    #: (destination rank, local tensor, other members): the planner's ``charges``.
    charges: tuple[tuple[int, str, tuple[int, ...]], ...]
    #: Per box its members hold at different places, every member's place (``relay_sites``).
    sites: tuple[tuple[Site, ...], ...] = ()
    #: (node, tensor) whose pieces keep the direct path there, and each destination rank's node.
    direct: frozenset[tuple[int, str]] = frozenset()
    nodes: tuple[int, ...] = ()

    def group_of(self, t: Transfer) -> int:
        """The relay group of transfer ``t`` of the reduced side's plan (-1: not relayed)."""
        for box, group, view in self.shared.get((t.dst, t.dst_name, t.canonical), ()):
            if box.contains(t.box) and (view is None or view.sub(box, t.box) == t.dst_view):
                return group
        if self.direct and (self.nodes[t.dst], t.canonical) in self.direct:
            return -1
        return self.default.get(t.dst, -1)

    def in_wire_units(self, reinterpret: Sequence[tuple[str, str]], itemsize: int) -> "Relays":
        """The same relays with the boxes and views of tensors carried as their bits
        (``TransferPlan.reinterpret``: one fp32 element is two bf16 wire elements along the last
        dim) as the plan's transfers have them -- else a relayed transfer of such a tensor would
        lie in no piece and reach its holder only."""
        ratio = {name: DTYPE_BYTES[d] // itemsize for name, d in reinterpret}
        if not ratio or not any(k[2] in ratio for k in self.shared):
            return self

        def wire(name: str, box: Box, view: View | None) -> tuple[Box, View | None]:
            r = ratio.get(name)
            if r is None:
                return box, view
            box = Box((*box.offsets[:-1], box.offsets[-1] * r), (*box.sizes[:-1], box.sizes[-1] * r))
            if view is not None:
                view = View(view.offset * r, box.sizes, (*(s * r for s in view.stride[:-1]), 1))
            return box, view

        def entry(name: str, box: Box, group: int, view: View | None) -> tuple[Box, int, View | None]:
            box, view = wire(name, box, view)
            return box, group, view

        shared = {k: [entry(k[2], b, group, v) for b, group, v in e] if k[2] in ratio else e
                  for k, e in self.shared.items()}
        sites = tuple(tuple((r, n, c, *wire(c, b, v)) for r, n, c, b, v in s) for s in self.sites)
        return replace(self, shared=shared, sites=sites)


def piece_relays(dst: SideLayout, placement: RankPlacement,
                 direct: frozenset[tuple[int, str]] = frozenset()) -> Relays | None:
    """Relay groups at piece level. Ranks with identical pieces on one node (rank r of
    several engines, :func:`relay_groups`) form a group; then every box of a tensor that
    several of those groups hold on one node is held by the first of them only, in a group
    of all their members -- so each distinct box crosses into a node once. The holders may
    hold it alike (what an engine replicates over its TP ranks: norms, the router,
    replicated KV heads) or at different places (vLLM EPLB's redundant expert copies: another
    slot of another rank; each member then unpacks it at its own place, ``relay_sites``). A
    rank holding one box twice gets it once relayed and once more directly. ``direct``:
    (node, tensor) whose pieces keep the direct path on that node. None: no relays."""
    ids = ValueIds()
    whole = _relay_groups(dst, placement, ids)
    ident = {m: members for members in whole for m in members}
    nodes = tuple(loc.node for loc in placement.dst)
    keyed = _keyed_pieces(dst, {m for members in whole for m in members[1:]}, nodes, direct, ids)
    holders, multi = _holders(keyed, nodes, direct)
    if not whole and not multi:
        return None
    members_of = {k: tuple(sorted({m for r, _ in reps for m in ident.get(r, (r,))})) for k, reps in multi.items()}
    groups = tuple(sorted(set(whole) | set(members_of.values())))
    index = {members: i for i, members in enumerate(groups)}
    default = {members[0]: index[members] for members in whole}
    shared: dict[tuple[int, str, str], list[tuple[Box, int, View | None]]] = {}
    charged: dict[tuple[int, str], set[int]] = {}
    dropped: set[tuple[int, _PieceKey]] = set()
    sites: list[tuple[Site, ...]] = []
    for k, reps in multi.items():
        owner, okey = reps[0]
        name, _, _, canonical, box, view = okey
        box, view = ids.values[box], ids.values[view]
        alike = len(holders[k]) == len(reps) and all(key == okey for _, key in reps[1:])
        shared.setdefault((owner, name, canonical), []).append((box, index[members_of[k]], None if alike else view))
        charged.setdefault((owner, name), set()).update(r for r, _ in reps[1:])
        dropped.update(reps[1:])
        if not alike:
            sites.append(tuple(sorted(((m, key[0], canonical, box, ids.values[key[5]]) for r, key in reps
                                       for m in ident.get(r, (r,))), key=lambda s: s[0])))
    reduced = SideLayout(dst.name, dst.world_size, _without(keyed, dropped), dst.tensors, dst.notes)
    charges = tuple(sorted((r, n, tuple(sorted(o))) for (r, n), o in charged.items()))
    return Relays(reduced, groups, default, shared, charges, tuple(sites), frozenset(direct), nodes)


def _keyed_pieces(dst: SideLayout, others: set[int], nodes: tuple[int, ...], direct: frozenset[tuple[int, str]],
                  ids: ValueIds) -> list[tuple[LocalParam, list[_PieceKey]]]:
    """Every destination local tensor that may be held for others, with its pieces' keys:
    the members after the first of a whole-rank relay group (``others``) hold what the first
    holds, so only their pieces kept direct stay."""
    keyed = []
    for p in dst.params:
        if p.rank in others:  # the first of its group holds the same (unless kept direct)
            if not direct:
                continue
            kept = tuple(q for q in p.pieces if (nodes[p.rank], q.canonical) in direct)
            if not kept:
                continue
            if len(kept) != len(p.pieces):
                p = replace(p, pieces=kept)
        keyed.append((p, _piece_keys(p, ids)))
    return keyed


def _holders(keyed: list[tuple[LocalParam, list[_PieceKey]]], nodes: tuple[int, ...],
             direct: frozenset[tuple[int, str]]) -> tuple[dict[tuple, list], dict[tuple, list]]:
    """(node, tensor, box) -> every (rank, piece key) holding it, and of those the boxes
    several ranks hold: one site per rank (its first), by rank."""
    holders: dict[tuple, list[tuple[int, _PieceKey]]] = {}
    for p, keys in keyed:
        node, rank = nodes[p.rank], p.rank
        for key in keys:
            if direct and (node, key[3]) in direct:
                continue
            holders.setdefault((node, key[3], key[4]), []).append((rank, key))
    multi: dict[tuple, list[tuple[int, _PieceKey]]] = {}
    for k, found in holders.items():
        if len(found) > 1:
            first: dict[int, _PieceKey] = {}
            for rank, key in found:
                first.setdefault(rank, key)
            if len(first) > 1:
                multi[k] = sorted(first.items(), key=lambda s: s[0])
    return holders, multi


def _without(keyed: list[tuple[LocalParam, list[_PieceKey]]],
             dropped: set[tuple[int, _PieceKey]]) -> tuple[LocalParam, ...]:
    """The local tensors of ``keyed`` less the pieces another holder takes for them."""
    params = []
    for p, keys in keyed:
        if dropped:
            kept = tuple(q for q, key in zip(p.pieces, keys) if (p.rank, key) not in dropped)
            if not kept:
                continue
            if len(kept) != len(p.pieces):
                p = replace(p, pieces=kept)
        params.append(p)
    return tuple(params)


def misdelivered(plan: TransferPlan, direct: TransferPlan) -> str:
    """Name the first destination local tensor a relayed plan delivers other bytes to than
    the direct plan does (which the planner proved exact)."""
    got: dict[tuple[int, str], int] = {}
    index: dict = {}
    for t, group in zip(plan.transfers, plan.relay_of):
        for m in plan.relay_groups[group] if group >= 0 else (t.dst,):
            name = t.dst_name if m == t.dst else member_site(plan.relay_sites, index, t, m)[0]
            got[(m, name)] = got.get((m, name), 0) + t.nbytes
    want: dict[tuple[int, str], int] = {}
    for t in direct.transfers:
        want[(t.dst, t.dst_name)] = want.get((t.dst, t.dst_name), 0) + t.nbytes
    for key in sorted(set(got) | set(want)):
        if got.get(key, 0) != want.get(key, 0):
            return f"{key[1]} on destination rank {key[0]} gets {got.get(key, 0)} bytes, it holds {want.get(key, 0)}"
    return "every local tensor gets its bytes"
