"""Where ranks sit, and what a plan's bytes cost on the links between them.

Every rank of both sides gets a :class:`Location` (node, device). A transfer is then
same-device (never needs the network: IPC or a copy), intra-node (NVLink-class) or inter-node
(the fabric), and a plan has bytes per class, the busiest rank's bytes per class, and a
modelled time at stated link bandwidths. Pure metadata, like the planner: a full-size
placement is checked on a laptop.

The floor over the fabric is *one copy per destination node*: what a node's inference ranks
hold, minus what a training rank on the same node already holds, has to cross into that node
once (:func:`inter_node_minimum`); :func:`placement_report` sets the plan's inter-node bytes
next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..layout import Box, SideLayout, View
from ..layout.descriptor import DTYPE_BYTES
from .tags import relayed_tags_fit
from .types import PlanError, TransferPlan, member_site

__all__ = ["Location", "Links", "Placement", "PlacementReport", "TopologyConfig", "LINK_CLASSES",
           "placement_report", "inter_node_minimum", "hf_ipc_bytes", "relay_groups", "piece_relays", "same_device_pairs",
           "plan_for_placement"]

#: Link classes, cheapest first.
LINK_CLASSES = ("same_device", "intra_node", "inter_node")


@dataclass(frozen=True, order=True)
class Location:
    node: int
    device: int  # index within the node


@dataclass(frozen=True)
class Links:
    """Per-GPU link bandwidths in GB/s (10**9 bytes/s): NVLink-class inside a node, the
    fabric (one NIC per GPU) between nodes; same-device copies at HBM speed."""

    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    same_device_gbps: float = 2000.0

    def __post_init__(self) -> None:
        for name in ("intra_node_gbps", "inter_node_gbps", "same_device_gbps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name}={v!r} must be a positive number of GB/s")

    def gbps(self, link: str) -> float:
        return {"same_device": self.same_device_gbps, "intra_node": self.intra_node_gbps,
                "inter_node": self.inter_node_gbps}[link]


@dataclass(frozen=True)
class Placement:
    """The location of every source (training) and destination (inference) rank."""

    src: tuple[Location, ...]
    dst: tuple[Location, ...]
    gpus_per_node: int

    @classmethod
    def separate(cls, num_src: int, num_dst: int, gpus_per_node: int) -> "Placement":
        """Trainers fill nodes 0.., inference ranks the nodes after them (non-colocated)."""
        _positive(gpus_per_node)
        src = tuple(Location(r // gpus_per_node, r % gpus_per_node) for r in range(num_src))
        first = -(-num_src // gpus_per_node)
        dst = tuple(Location(first + r // gpus_per_node, r % gpus_per_node) for r in range(num_dst))
        return cls(src, dst, gpus_per_node)

    @classmethod
    def colocated(cls, num_src: int, num_dst: int, gpus_per_node: int) -> "Placement":
        """Training rank i and inference rank i share device i (NeMo RL's colocated mode)."""
        _positive(gpus_per_node)
        loc = lambda r: Location(r // gpus_per_node, r % gpus_per_node)  # noqa: E731
        return cls(tuple(map(loc, range(num_src))), tuple(map(loc, range(num_dst))), gpus_per_node)

    def link(self, src: int, dst: int) -> str:
        """Link class from training rank ``src`` to inference rank ``dst``."""
        return _link_class(self.src[src], self.dst[dst])

    def dst_link(self, a: int, b: int) -> str:
        """Link class between two inference ranks (a relay forwarding inside a group)."""
        return _link_class(self.dst[a], self.dst[b])

    @property
    def dst_nodes(self) -> list[int]:
        return sorted({loc.node for loc in self.dst})


def _link_class(a: Location, b: Location) -> str:
    if a == b:
        return "same_device"
    return "intra_node" if a.node == b.node else "inter_node"


def _positive(gpus_per_node: int) -> None:
    if not (isinstance(gpus_per_node, int) and not isinstance(gpus_per_node, bool) and gpus_per_node >= 1):
        raise ValueError(f"gpus_per_node={gpus_per_node!r} must be an integer >= 1")


@dataclass(frozen=True)
class TopologyConfig:
    """``topology.*`` of ``configs/plan.yaml``: how the modelled cluster places both sides."""

    gpus_per_node: int = 8
    #: separate: trainers fill their own nodes, inference ranks the next ones (non-colocated);
    #: colocated: training rank i and inference rank i share device i.
    placement: str = "separate"
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0

    def __post_init__(self) -> None:
        from ..errors import ConfigError

        try:
            _positive(self.gpus_per_node)
            Links(self.intra_node_gbps, self.inter_node_gbps)
        except ValueError as exc:
            raise ConfigError(f"topology.{exc}") from None
        if self.placement not in ("separate", "colocated"):
            raise ConfigError(f"topology.placement={self.placement!r} is not one of ['separate', 'colocated']")

    @property
    def links(self) -> Links:
        return Links(self.intra_node_gbps, self.inter_node_gbps)

    def place(self, num_src: int, num_dst: int) -> Placement:
        if self.placement == "colocated":
            if num_src != num_dst:
                from ..errors import ConfigError

                raise ConfigError(f"topology.placement=colocated needs as many training ranks as inference ranks "
                                  f"(one of each per device), got {num_src} and {num_dst}")
            return Placement.colocated(num_src, num_dst, self.gpus_per_node)
        return Placement.separate(num_src, num_dst, self.gpus_per_node)


# ------------------------------------------------------------------ the per-node minimum


def _covered(boxes: Sequence[Box], minus: Sequence[Box] = ()) -> int:
    """Elements covered by the union of ``boxes`` and not by the union of ``minus``
    (coordinate compression: the cells between every box edge, per dimension)."""
    if not boxes:
        return 0
    uniq = list(dict.fromkeys(boxes))
    if len(uniq) == 1 and not minus:
        return uniq[0].numel
    everything = uniq + list(minus)
    ndim = len(uniq[0].sizes)
    cuts = [sorted({b.offsets[d] for b in everything} | {b.offsets[d] + b.sizes[d] for b in everything})
            for d in range(ndim)]
    total = 0

    def inside(b: Box, cell: tuple[int, ...]) -> bool:
        return all(b.offsets[d] <= cell[d] < b.offsets[d] + b.sizes[d] for d in range(ndim))

    def walk(d: int, cell: list[int], vol: int) -> None:
        nonlocal total
        if d == ndim:
            c = tuple(cell)
            if any(inside(b, c) for b in uniq) and not any(inside(b, c) for b in minus):
                total += vol
            return
        for lo, hi in zip(cuts[d], cuts[d][1:]):
            cell.append(lo)
            walk(d + 1, cell, vol * (hi - lo))
            cell.pop()

    walk(0, [], 1)
    return total


def _boxes_by_node(side: SideLayout, locs: Sequence[Location]) -> dict[int, dict[str, list[Box]]]:
    out: dict[int, dict[str, list[Box]]] = {}
    for p in side.params:
        node = locs[p.rank].node
        for q in p.pieces:
            out.setdefault(node, {}).setdefault(q.canonical, []).append(q.box)
    return out


#: inter_node_minimum by (layouts, placement): one plan's report asks for it several times
#: (direct vs relayed, then the CLI). Holds the layouts so their ids stay theirs.
_MIN_CACHE: dict[tuple, tuple[SideLayout, SideLayout, int]] = {}


def inter_node_minimum(src: SideLayout, dst: SideLayout, placement: Placement, itemsize: int) -> int:
    """Bytes that must cross into destination nodes: per node, the distinct elements its
    inference ranks hold (padding excluded: it is never sent) that no training rank on the
    same node holds."""
    key = (id(src), id(dst), placement, itemsize)
    hit = _MIN_CACHE.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    total = _inter_node_minimum(src, dst, placement, itemsize)
    if len(_MIN_CACHE) >= 8:
        _MIN_CACHE.pop(next(iter(_MIN_CACHE)))
    _MIN_CACHE[key] = (src, dst, total)
    return total


def _inter_node_minimum(src: SideLayout, dst: SideLayout, placement: Placement, itemsize: int) -> int:
    return sum(_floors(src, dst, placement, itemsize).values())


def _floors(src: SideLayout, dst: SideLayout, placement: Placement, itemsize: int) -> dict[tuple[int, str], int]:
    """(destination node, tensor) -> bytes of it that must cross into that node."""
    held = _boxes_by_node(dst, placement.dst)
    local = _boxes_by_node(src, placement.src)
    size = _element_bytes(dst, itemsize)
    return {(node, name): _covered(boxes, local.get(node, {}).get(name, ())) * size.get(name, itemsize)
            for node, tensors in held.items() for name, boxes in tensors.items()}


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


# ------------------------------------------------------------------------------ report


@dataclass(frozen=True)
class PlacementReport:
    """A plan's bytes on the links of a placement (``mcore-reshard plan --json`` keys)."""

    bytes_same_device: int
    bytes_intra_node: int
    bytes_inter_node: int
    #: The busiest rank's bytes per class (the larger of what a rank sends and receives).
    busiest_same_device: int
    busiest_intra_node: int
    busiest_inter_node: int
    bytes_inter_node_min: int  # one copy per destination node (see inter_node_minimum)
    modelled_seconds: float
    #: NeMo RL's colocated path for the same layout: every inference rank gets every full tensor.
    bytes_hf_ipc: int
    links: Links
    gpus_per_node: int
    nodes_src: int
    nodes_dst: int

    def lines(self) -> list[str]:
        """The plan table's placement lines."""
        from .report import format_bytes as fb

        ratio = self.bytes_inter_node / self.bytes_inter_node_min if self.bytes_inter_node_min else 0.0
        return [
            f"placement: {self.nodes_src} training + {self.nodes_dst} inference node(s) of {self.gpus_per_node} GPUs",
            f"  bytes same device / intra-node / inter-node: {fb(self.bytes_same_device)} / "
            f"{fb(self.bytes_intra_node)} / {fb(self.bytes_inter_node)}",
            f"  inter-node floor (one copy per inference node): {fb(self.bytes_inter_node_min)}"
            + (f" -- the plan moves {ratio:.4f}x it over the fabric" if ratio > 1.0 + 1e-9 else " -- met"),
            f"  busiest rank same device / intra-node / inter-node: {fb(self.busiest_same_device)} / "
            f"{fb(self.busiest_intra_node)} / {fb(self.busiest_inter_node)}",
            f"  modelled refit: {self.modelled_seconds:.3f} s at {self.links.intra_node_gbps:g} GB/s intra-node, "
            f"{self.links.inter_node_gbps:g} GB/s inter-node per GPU",
            f"  NeMo RL colocated path (every inference rank gets the full model over IPC): {fb(self.bytes_hf_ipc)}",
        ]

    def to_json(self) -> dict:
        return {
            "bytes_same_device": self.bytes_same_device, "bytes_intra_node": self.bytes_intra_node,
            "bytes_inter_node": self.bytes_inter_node, "bytes_inter_node_min": self.bytes_inter_node_min,
            "busiest_rank_bytes": {"same_device": self.busiest_same_device, "intra_node": self.busiest_intra_node,
                                   "inter_node": self.busiest_inter_node},
            "modelled_seconds": self.modelled_seconds, "bytes_hf_ipc": self.bytes_hf_ipc,
            "links_gbps": {"intra_node": self.links.intra_node_gbps, "inter_node": self.links.inter_node_gbps,
                           "same_device": self.links.same_device_gbps},
            "gpus_per_node": self.gpus_per_node, "nodes": {"training": self.nodes_src, "inference": self.nodes_dst},
        }


def placement_report(plan: TransferPlan, src: SideLayout, dst: SideLayout, placement: Placement,
                     links: Links = Links()) -> PlacementReport:
    """Bytes per link class, the busiest rank per class, and the modelled time: the slowest
    rank, whose links of different classes run at once (max over classes of bytes / rate),
    sending and receiving at once (full duplex: the larger direction counts)."""
    if len(placement.src) != plan.num_src or len(placement.dst) != plan.num_dst:
        raise ValueError(f"placement has {len(placement.src)} + {len(placement.dst)} ranks, the plan "
                         f"{plan.num_src} + {plan.num_dst}")
    totals = dict.fromkeys(LINK_CLASSES, 0)
    sent = {c: [0] * plan.num_src for c in LINK_CLASSES}
    recv = {c: [0] * plan.num_dst for c in LINK_CLASSES}
    recv_all = [0] * plan.num_dst  # from the sources only
    for t in plan.transfers:
        c = placement.link(t.src, t.dst)
        totals[c] += t.nbytes
        sent[c][t.src] += t.nbytes
        recv[c][t.dst] += t.nbytes
        recv_all[t.dst] += t.nbytes
    # Relays: a group member forwards what it receives from the sources to the other members.
    relay_sent = {c: [0] * plan.num_dst for c in LINK_CLASSES}
    for t, g in zip(plan.transfers, plan.relay_of):
        if g < 0:
            continue
        for m in plan.relay_groups[g]:
            if m != t.dst:
                c = placement.dst_link(t.dst, m)
                totals[c] += t.nbytes
                recv[c][m] += t.nbytes
                relay_sent[c][t.dst] += t.nbytes
    busiest = {c: max(max(sent[c], default=0), max(recv[c], default=0), max(relay_sent[c], default=0))
               for c in LINK_CLASSES}
    seconds = 0.0
    for per_rank in (sent, recv, relay_sent):
        n = len(per_rank["inter_node"])
        for r in range(n):
            seconds = max(seconds, max(per_rank[c][r] / (links.gbps(c) * 1e9) for c in LINK_CLASSES))
    return PlacementReport(
        bytes_same_device=totals["same_device"], bytes_intra_node=totals["intra_node"],
        bytes_inter_node=totals["inter_node"], busiest_same_device=busiest["same_device"],
        busiest_intra_node=busiest["intra_node"], busiest_inter_node=busiest["inter_node"],
        bytes_inter_node_min=inter_node_minimum(src, dst, placement, plan.itemsize),
        modelled_seconds=seconds, bytes_hf_ipc=hf_ipc_bytes(dst, plan.itemsize), links=links, gpus_per_node=placement.gpus_per_node,
        nodes_src=len({loc.node for loc in placement.src}), nodes_dst=len(placement.dst_nodes),
    )


# ------------------------------------------------------------------------ fan-out relays


def _signature(params: Sequence) -> tuple:
    """What a destination rank holds, independent of its rank number."""
    return tuple(sorted((p.name, tuple(p.shape), p.dtype, tuple((q.local_name, q.canonical, q.box, q.view)
                                                                  for q in p.pieces)) for p in params))


def relay_groups(dst: SideLayout, placement: Placement) -> tuple[tuple[int, ...], ...]:
    """Destination ranks on one node that hold exactly the same pieces (rank r of several
    engines of one layout on that node), as sorted groups of two or more."""
    by_rank: dict[int, list] = {}
    for p in dst.params:
        by_rank.setdefault(p.rank, []).append(p)
    groups: dict[tuple, list[int]] = {}
    for r in sorted(by_rank):
        groups.setdefault((placement.dst[r].node, _signature(by_rank[r])), []).append(r)
    return tuple(sorted(tuple(g) for g in groups.values() if len(g) > 1))


def _spread(plan: TransferPlan, groups: tuple[tuple[int, ...], ...], group_of: list[int],
            sites: tuple[tuple[tuple[int, str, str, Box, View], ...], ...] = ()) -> TransferPlan:
    """Hand each relayed transfer (``group_of``: its group, -1 for none) to the member of its
    group with the fewest bytes so far (plan order; ties to the lower rank): every member
    then receives its share over the fabric and the rest from the other members. The
    buckets were cut with every member's whole share counted (``charges``), so the bucket
    budget holds. ``sites``: boxes the members hold at different places (``relay_sites``):
    a transfer handed to another member lands at that member's place."""
    load = {m: 0 for g in groups for m in g}
    index: dict = {}
    out = []
    for t, g in zip(plan.transfers, group_of):
        if g >= 0:
            a = min(groups[g], key=lambda m: (load[m], m))
            load[a] += t.nbytes
            if a != t.dst:
                if sites:
                    name, view = member_site(sites, index, t, a)
                    t = replace(t, dst=a, dst_name=name, dst_view=view)
                else:
                    t = replace(t, dst=a)
        out.append(t)
    # stable: wire order inside each message kept
    keys = [(t.bucket, t.src, t.dst) for t in out]
    order = sorted(range(len(out)), key=keys.__getitem__)
    return replace(plan, transfers=tuple(out[i] for i in order), relay_groups=groups,
                   relay_of=tuple(group_of[i] for i in order), relay_sites=sites,
                   _by_src={}, _by_dst={}, _by_group={}, _sites={})


def _piece_key(p, q) -> tuple:
    """A destination piece as another rank would hold it identically (same local tensor,
    same place in it): a box one member receives, unpacked the same way by every member."""
    return (p.name, tuple(p.shape), p.dtype, q.canonical, q.box, q.view)


#: A member's place for a relayed box: (rank, local tensor, canonical, box, view).
_Site = tuple[int, str, str, Box, View]


@dataclass(frozen=True)
class _Relays:
    """Fan-out relays of one placement: the destination side reduced to one holder per
    piece per node, the relay groups, and what the planner and ``_spread`` need."""

    reduced: SideLayout
    groups: tuple[tuple[int, ...], ...]
    default: dict[int, int]  # holder rank -> group of its pieces held by no other holder (-1: none)
    #: (holder, local, canonical) -> (piece box, group, the holder's view of it where the members
    #: hold it at different places -- a transfer must land in that piece -- else None)
    shared: dict[tuple[int, str, str], list[tuple[Box, int, View | None]]]
    charges: tuple[tuple[int, str, tuple[int, ...]], ...]
    #: Per box its members hold at different places, every member's place (``relay_sites``).
    sites: tuple[tuple[_Site, ...], ...] = ()
    #: (node, tensor) whose pieces keep the direct path there, and each destination rank's node.
    direct: frozenset[tuple[int, str]] = frozenset()
    nodes: tuple[int, ...] = ()

    def group_of(self, t) -> int:
        for box, g, view in self.shared.get((t.dst, t.dst_name, t.canonical), ()):
            if box.contains(t.box) and (view is None or view.sub(box, t.box) == t.dst_view):
                return g
        if self.direct and (self.nodes[t.dst], t.canonical) in self.direct:
            return -1
        return self.default.get(t.dst, -1)

    def in_wire_units(self, reinterpret: Sequence[tuple[str, str]], itemsize: int) -> "_Relays":
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

        def entry(name: str, box: Box, g: int, view: View | None) -> tuple[Box, int, View | None]:
            box, view = wire(name, box, view)
            return box, g, view

        shared = {k: [entry(k[2], b, g, v) for b, g, v in e] if k[2] in ratio else e for k, e in self.shared.items()}
        sites = tuple(tuple((r, n, c, *wire(c, b, v)) for r, n, c, b, v in s) for s in self.sites)
        return replace(self, shared=shared, sites=sites)


def piece_relays(dst: SideLayout, placement: Placement,
                 direct: frozenset[tuple[int, str]] = frozenset()) -> _Relays | None:
    """Relay groups at piece level. Ranks with identical pieces on one node (rank r of
    several engines, :func:`relay_groups`) form a group; then every box of a tensor that
    several of those groups hold on one node is held by the first of them only, in a group
    of all their members -- so each distinct box crosses into a node once. The holders may
    hold it alike (what an engine replicates over its TP ranks: norms, the router,
    replicated KV heads) or at different places (vLLM EPLB's redundant expert copies: another
    slot of another rank; each member then unpacks it at its own place, ``relay_sites``). A
    rank holding one box twice gets it once relayed and once more directly. ``direct``:
    (node, tensor) whose pieces keep the direct path on that node. None: no relays."""
    whole = relay_groups(dst, placement)
    ident = {m: g for g in whole for m in g}
    others = {m for g in whole for m in g[1:]}
    nodes = tuple(loc.node for loc in placement.dst)
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
        keyed.append((p, [_piece_key(p, q) for q in p.pieces]))
    holders: dict[tuple, list[tuple[int, tuple]]] = {}  # (node, tensor, box) -> (rank, piece key) per site
    for p, keys in keyed:
        node, rank = nodes[p.rank], p.rank
        for key in keys:
            if direct and (node, key[3]) in direct:
                continue
            holders.setdefault((node, key[3], key[4]), []).append((rank, key))
    multi: dict[tuple, list[tuple[int, tuple]]] = {}  # the boxes several ranks hold: one site per rank
    for k, found in holders.items():
        if len(found) > 1:
            first: dict[int, tuple] = {}
            for rank, key in found:
                first.setdefault(rank, key)
            if len(first) > 1:
                multi[k] = sorted(first.items(), key=lambda s: s[0])
    if not whole and not multi:
        return None
    members_of = {k: tuple(sorted({m for r, _ in reps for m in ident.get(r, (r,))})) for k, reps in multi.items()}
    groups = tuple(sorted(set(whole) | set(members_of.values())))
    index = {g: i for i, g in enumerate(groups)}
    default = {g[0]: index[g] for g in whole}
    shared: dict[tuple[int, str, str], list[tuple[Box, int, View | None]]] = {}
    charged: dict[tuple[int, str], set[int]] = {}
    dropped: set[tuple[int, tuple]] = set()
    sites: list[tuple[_Site, ...]] = []
    for k, reps in multi.items():
        owner, okey = reps[0]
        name, _, _, canonical, box, view = okey
        alike = len(holders[k]) == len(reps) and all(key == okey for _, key in reps[1:])
        shared.setdefault((owner, name, canonical), []).append((box, index[members_of[k]], None if alike else view))
        charged.setdefault((owner, name), set()).update(r for r, _ in reps[1:])
        dropped.update(reps[1:])
        if not alike:
            sites.append(tuple(sorted(((m, key[0], canonical, box, key[5]) for r, key in reps
                                       for m in ident.get(r, (r,))), key=lambda s: s[0])))
    params = []
    for p, keys in keyed:
        if dropped:
            kept = tuple(q for q, key in zip(p.pieces, keys) if (p.rank, key) not in dropped)
            if not kept:
                continue
            if len(kept) != len(p.pieces):
                p = replace(p, pieces=kept)
        params.append(p)
    reduced = SideLayout(dst.name, dst.world_size, tuple(params), dst.tensors, dst.notes)
    charges = tuple(sorted((r, n, tuple(sorted(o))) for (r, n), o in charged.items()))
    return _Relays(reduced, groups, default, shared, charges, tuple(sites), frozenset(direct), nodes)


def same_device_pairs(placement: Placement) -> tuple[tuple[int, int], ...]:
    """(source rank, destination rank) pairs that share a device: their bytes move through
    shared memory (``transport/shm.py``), never through the network."""
    at: dict[Location, list[int]] = {}
    for d, loc in enumerate(placement.dst):
        at.setdefault(loc, []).append(d)
    return tuple((s, d) for s, loc in enumerate(placement.src) for d in at.get(loc, ()))


def plan_for_placement(src: SideLayout, dst: SideLayout, placement: Placement, links: Links = Links(), *,
                       bucket_bytes: int, allow_cast: bool = False,
                       not_direct: tuple[tuple[str, str], ...] = ()) -> TransferPlan:
    """The plan for a placement: direct, or with fan-out relays where that does not raise the
    modelled time. Relays (:func:`piece_relays`): every distinct box a node's inference ranks
    hold is sent over the fabric to one of its holders there, which forwards it to the
    others over the node's links -- so each element crosses into a node once, spread over the
    group's links. Where relays cannot meet that floor for some tensors (a rank holding a
    box twice), those keep the direct path and the notes say so: a performance miss never
    refuses a layout. Bytes delivered other than the destinations hold are a ``PlanError``."""
    from .cache import get_plan

    direct = get_plan(src, dst, bucket_bytes=bucket_bytes, allow_cast=allow_cast, not_direct=not_direct,
                      placement=placement)
    pairs = same_device_pairs(placement)
    relays = piece_relays(dst, placement)
    if relays is None:
        return replace(direct, same_device=pairs, _by_src={}, _by_dst={}) if pairs else direct

    def relay(relays: _Relays) -> tuple[TransferPlan, PlacementReport]:
        plan = get_plan(src, relays.reduced, bucket_bytes=bucket_bytes, allow_cast=allow_cast,
                        not_direct=not_direct, placement=placement, charges=relays.charges)
        relays = relays.in_wire_units(plan.reinterpret, plan.itemsize)
        plan = replace(_spread(plan, relays.groups, [relays.group_of(t) for t in plan.transfers], relays.sites),
                       bytes_min=direct.bytes_min, bytes_hf_broadcast=direct.bytes_hf_broadcast, padding=direct.padding)
        if plan.bytes_planned != direct.bytes_min:  # a lost or doubled box: never a performance matter
            raise PlanError(f"fan-out relays deliver {plan.bytes_planned} bytes, the destinations hold "
                            f"{direct.bytes_min}: {_misdelivered(plan, direct)}")
        return plan, placement_report(plan, src, dst, placement, links)

    def keep_direct(why: str) -> TransferPlan:
        return replace(direct, same_device=pairs, _by_src={}, _by_dst={}, notes=direct.notes + (
            f"fan-out relays not used: {why}",))

    t_direct = placement_report(direct, src, dst, placement, links).modelled_seconds
    relayed, rep = relay(relays)
    if rep.modelled_seconds > t_direct:
        return keep_direct(f"modelled {rep.modelled_seconds:.4f} s with relays vs {t_direct:.4f} s direct")
    kept: tuple[str, ...] = ()
    if rep.bytes_inter_node > rep.bytes_inter_node_min:
        over = _over_floor(relayed, src, dst, placement)
        why = f"({_why_over(dst, placement, over)}), e.g. {_over_line(over[0])}"
        kept = (f"fan-out relays keep the direct path for {len(over)} (node, tensor) pair(s) they cannot take "
                f"into the node once {why}",)
        relays = piece_relays(dst, placement, direct=frozenset((node, name) for node, name, _, _ in over))
        if relays is None:
            return keep_direct(f"nothing is left to relay once the {len(over)} (node, tensor) pair(s) they cannot "
                               f"take into the node once keep the direct path {why}")
        relayed, rep = relay(relays)
        if rep.modelled_seconds > t_direct:
            return keep_direct(f"modelled {rep.modelled_seconds:.4f} s with relays (some tensors direct) vs "
                               f"{t_direct:.4f} s direct")
    elif rep.bytes_inter_node < rep.bytes_inter_node_min:
        raise PlanError(f"fan-out relays move {rep.bytes_inter_node} bytes over the fabric, below the floor (one "
                        f"copy per inference node) of {rep.bytes_inter_node_min}: some box never reaches its node")
    if not _tags_fit(relayed, relays) and relays.sites:
        # the boxes members hold at different places bring groups of their own: with those
        # boxes direct, the other relays may fit the tags
        nodes = relays.nodes
        alias = relays.direct | {(nodes[site[0]], site[2]) for box in relays.sites for site in box}
        fewer = piece_relays(dst, placement, direct=frozenset(alias))
        if fewer is not None:
            plan, fewer_rep = relay(fewer)
            if _tags_fit(plan, fewer) and fewer_rep.modelled_seconds <= t_direct:
                kept += (f"fan-out relays keep the direct path for {len(alias - relays.direct)} (node, tensor) pair(s) "
                         f"their holders on a node hold at different places (e.g. redundant expert copies): relaying "
                         f"them too needs {relayed.num_buckets} buckets x {len(relays.groups)} relay groups, more "
                         f"message tags than gloo has (raise refit.buffer_bytes for fewer buckets); modelled "
                         f"{rep.modelled_seconds:.4f} s with them relayed",)
                relays, relayed, rep = fewer, plan, fewer_rep
    if not _tags_fit(relayed, relays):
        return keep_direct(
            f"{relayed.num_buckets} buckets x {len(relays.groups)} relay groups need more "
            f"message tags than gloo has (raise refit.buffer_bytes for fewer buckets); modelled {t_direct:.4f} s "
            f"direct vs {rep.modelled_seconds:.4f} s with relays")
    n = len({m for g in relays.groups for m in g})
    return replace(relayed, same_device=pairs, notes=relayed.notes + (
        f"fan-out relays: {len(relays.groups)} group(s) of inference ranks ({n} ranks) holding the same pieces on "
        f"shared nodes take each box over the fabric once and forward it inside the node; modelled "
        f"{rep.modelled_seconds:.4f} s vs {t_direct:.4f} s direct",) + kept)


def _tags_fit(plan: TransferPlan, relays: _Relays) -> bool:
    """Whether the executor's message tags (gloo's are C ints, below 2**29) cover every
    (bucket, relay group) of a relayed plan."""
    return relayed_tags_fit(plan.num_buckets, len(relays.groups))


def _over_floor(plan: TransferPlan, src: SideLayout, dst: SideLayout,
                placement: Placement) -> list[tuple[int, str, int, int]]:
    """(node, tensor, bytes moved into it, floor) of every destination tensor whose bytes into
    some node exceed that node's floor, in (node, tensor) order."""
    moved: dict[tuple[int, str], int] = {}
    for t in plan.transfers:
        if placement.link(t.src, t.dst) == "inter_node":
            key = (placement.dst[t.dst].node, t.canonical)
            moved[key] = moved.get(key, 0) + t.nbytes
    floors = _floors(src, dst, placement, plan.itemsize)
    return [(node, name, nb, floors.get((node, name), 0)) for (node, name), nb in sorted(moved.items())
            if nb > floors.get((node, name), 0)]


def _over_line(over: tuple[int, str, int, int]) -> str:
    node, name, nb, floor = over
    return f"{name} crosses into node {node} as {nb} bytes, its floor there is {floor}"


def _why_over(dst: SideLayout, placement: Placement, over: Sequence[tuple[int, str, int, int]]) -> str:
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


def _misdelivered(plan: TransferPlan, direct: TransferPlan) -> str:
    """Name the first destination local tensor a relayed plan delivers other bytes to than
    the direct plan does (which the planner proved exact)."""
    got: dict[tuple[int, str], int] = {}
    index: dict = {}
    for t, g in zip(plan.transfers, plan.relay_of):
        for m in plan.relay_groups[g] if g >= 0 else (t.dst,):
            name = t.dst_name if m == t.dst else member_site(plan.relay_sites, index, t, m)[0]
            got[(m, name)] = got.get((m, name), 0) + t.nbytes
    want: dict[tuple[int, str], int] = {}
    for t in direct.transfers:
        want[(t.dst, t.dst_name)] = want.get((t.dst, t.dst_name), 0) + t.nbytes
    for key in sorted(set(got) | set(want)):
        if got.get(key, 0) != want.get(key, 0):
            return f"{key[1]} on destination rank {key[0]} gets {got.get(key, 0)} bytes, it holds {want.get(key, 0)}"
    return "every local tensor gets its bytes"
