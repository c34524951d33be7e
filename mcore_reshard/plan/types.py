"""Plan value types: what moves from which training rank to which inference rank.

Like DCP's ``SavePlan``/``LoadPlan``: plain frozen data that can be printed, diffed and
hashed, produced by the planner and consumed by a transport that knows nothing of models.
Source ranks (training) and destination ranks (inference) are separate rank spaces; the
transport maps both into its own process group.
"""

from __future__ import annotations

import hashlib
import operator
from collections import deque
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Iterable, Sequence

from ..layout.descriptor import Box, View
from ..layout.quant import SCALE_SUFFIX, scale_name

__all__ = ["PlanError", "Transfer", "RankPlan", "TransferPlan", "digest_text", "member_site", "quantized_locals"]


class PlanError(ValueError):
    """The two sides cannot be planned against each other; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one canonical tensor, read from ``src``'s local tensor and written into
    ``dst``'s, inside bucket ``bucket``."""

    src: int
    dst: int
    canonical: str
    box: Box
    src_name: str
    src_view: View
    dst_name: str
    dst_view: View
    nbytes: int
    bucket: int = 0


_SRC, _DST, _NBYTES = (operator.attrgetter(a) for a in ("src", "dst", "nbytes"))
#: Slot setters of ``Transfer`` in field order (what its generated ``__init__`` sets).
_TRANSFER_SETTERS = tuple(getattr(Transfer, name).__set__ for name in Transfer.__slots__)


def transfers_from_columns(n: int, columns: Sequence[Iterable]) -> list[Transfer]:
    """Build ``n`` transfers at once from one iterable per field (in field order).

    Same objects as calling ``Transfer(...)`` for each row, at under half the cost: the
    frozen ``__init__`` pays a Python-level ``object.__setattr__`` per field, while this
    sets each slot column by column in C loops -- a full-size plan has ~300k transfers.
    Every column must hold at least ``n`` values (a short one leaves slots unset).
    """
    if len(columns) != len(_TRANSFER_SETTERS):
        raise ValueError(f"need {len(_TRANSFER_SETTERS)} columns, got {len(columns)}")
    out = list(map(object.__new__, repeat(Transfer, n)))
    for setter, col in zip(_TRANSFER_SETTERS, columns):
        deque(map(setter, out, col), maxlen=0)
    return out


@dataclass(frozen=True)
class RankPlan:
    """One rank's slice of a plan: what it sends (as a source) or receives (as a destination),
    in bucket order, each bucket grouped by peer in peer order -- both ends of a message derive
    the same order, so a packed buffer needs no header."""

    side: str  # "src" | "dst"
    rank: int
    num_buckets: int
    transfers: tuple[Transfer, ...]
    #: Element type on the wire (the destination's; a cast happens while packing).
    dtype: str = "float32"
    #: Fan-out relays (``plan.relays``): every relay group of the plan (destination ranks on
    #: one node that hold the same pieces; a rank may be in several), and per transfer its
    #: relay group (``relay_of``; -1: not relayed) and, destination side, the member that
    #: receives it from the source and forwards it to the group's others (``via``; this rank
    #: or a peer).
    relay_groups: tuple[tuple[int, ...], ...] = ()
    relay_of: tuple[int, ...] = ()
    via: tuple[int, ...] = ()
    #: Peers of the other side on this rank's device (from the plan's placement): messages
    #: between them move through shared memory, never through the group's sockets.
    same_device: tuple[int, ...] = ()
    #: (local tensor, its real dtype) this rank views as ``dtype`` (the wire's) to move its
    #: bits unchanged: see ``TransferPlan.reinterpret``. Views and boxes of these tensors'
    #: transfers are in wire-dtype units.
    reinterpret: tuple[tuple[str, str], ...] = ()
    #: Source side: local tensors this rank quantizes to block FP8 before packing
    #: (``TransferPlan.quantized``); the plan reads their codes under the same name and their
    #: scales as ``<name>_scale_inv``.
    quantize: tuple[str, ...] = ()
    #: ``digest()``, once (not an init field: ``replace`` never carries it to another slice).
    _digest: list = field(default_factory=list, init=False, repr=False, compare=False)

    def channels(self) -> list[dict[tuple[int, int, int], list[Transfer]]]:
        """Destination side, per bucket: (source rank, via, relay group) -> transfers in wire
        order; ``via`` is this rank unless a relay-group member forwards the message, the
        group is -1 for a message that is not relayed."""
        out: list[dict[tuple[int, int, int], list[Transfer]]] = [dict() for _ in range(self.num_buckets)]
        via = self.via or (self.rank,) * len(self.transfers)
        relay_of = self.relay_of or (-1,) * len(self.transfers)
        for t, v, group in zip(self.transfers, via, relay_of):
            out[t.bucket].setdefault((t.src, v, group), []).append(t)
        return out

    def buckets(self) -> list[dict[int, list[Transfer]]]:
        """Per bucket: peer -> transfers in wire order (relay groups not told apart)."""
        out: list[dict[int, list[Transfer]]] = [dict() for _ in range(self.num_buckets)]
        for t in self.transfers:
            peer = t.dst if self.side == "src" else t.src
            out[t.bucket].setdefault(peer, []).append(t)
        return out

    def messages(self) -> list[dict[tuple[int, int], list[Transfer]]]:
        """Source side, per bucket: (destination rank, relay group) -> transfers in wire order:
        one message each (a relayed one goes to ``dst``, which forwards it to its group)."""
        out: list[dict[tuple[int, int], list[Transfer]]] = [dict() for _ in range(self.num_buckets)]
        relay_of = self.relay_of or (-1,) * len(self.transfers)
        for t, group in zip(self.transfers, relay_of):
            out[t.bucket].setdefault((t.dst, group), []).append(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def digest(self) -> str:
        """Hash of this slice: a rank checks the slice it was given is the one it runs."""
        if self._digest:
            return self._digest[0]
        relays = (self.relay_groups, self.relay_of, self.via) if self.relay_groups else None
        self._digest.append(plan_digest(self.transfers, self.num_buckets, self.dtype, relays=relays,
                                        same_device=self.same_device or None, reinterpret=self.reinterpret or None,
                                        quantize=self.quantize or None))
        return self._digest[0]


@dataclass(frozen=True)
class TransferPlan:
    """The global plan. ``transfers`` are sorted by (bucket, src, dst, wire order)."""

    transfers: tuple[Transfer, ...]
    num_buckets: int
    num_src: int
    num_dst: int
    itemsize: int
    dtype: str  # destination element type, what the wire carries
    #: What the destination ranks hold (padding excluded), summed over all ``num_dst`` ranks.
    bytes_min: int
    bytes_hf_broadcast: int
    bucket_bytes: int
    #: (dst rank, local param, elements) the receiver zero-fills itself (never sent).
    padding: tuple[tuple[int, str, int], ...] = ()
    #: (parameter, reason) for anything not on the direct shard-to-shard path.
    not_direct: tuple[tuple[str, str], ...] = ()
    #: (canonical tensor, source dtype, destination dtype) for every tensor whose dtypes differ
    #: (``refit.allow_cast=true``), in the destination's tensor order. The sender casts while
    #: packing: the wire carries ``dtype`` and ``bytes_min`` stays in it.
    casts: tuple[tuple[str, str, str], ...] = ()
    notes: tuple[str, ...] = ()
    plan_seconds: float = 0.0
    #: Fan-out relays (``plan.relays``): groups of destination ranks on one node that hold
    #: the same pieces, and per transfer its relay group (``relay_of``, aligned with ``transfers``;
    #: -1: not relayed; empty without relays). A relayed transfer goes to one member over the
    #: fabric (its ``dst``), which forwards it to the group's others over the node's links.
    relay_groups: tuple[tuple[int, ...], ...] = ()
    relay_of: tuple[int, ...] = ()
    #: (source rank, destination rank) pairs on one device (``plan.placement``): the executor
    #: moves their messages through shared memory.
    same_device: tuple[tuple[int, int], ...] = ()
    #: (canonical tensor, real dtype) of every tensor both sides hold in a dtype other than the
    #: wire's (e.g. DeepSeek's fp32 router bias in a bf16 refit): carried bit for bit as
    #: wire-dtype elements (an fp32 element is two bf16 ones), never cast. Its transfers' boxes
    #: and views are in wire units (last dim x itemsize ratio); ``bytes_min`` counts real bytes.
    reinterpret: tuple[tuple[str, str], ...] = ()
    #: Relayed boxes whose group's members hold them at different places (vLLM EPLB: a
    #: redundant expert copy in another slot of another rank): per box, every member's
    #: (rank, local tensor, canonical, box, view), in wire units. A member unpacks a relayed
    #: transfer inside such a box at its own place (``member_site``). Empty: every member
    #: holds each relayed box where its receiver does.
    relay_sites: tuple[tuple[tuple[int, str, str, Box, View], ...], ...] = ()
    #: (canonical tensor, dtype the sender holds) of every tensor the senders quantize to block
    #: FP8 while packing (``layout.quant``; the wire carries codes and scales, ``bytes_min``
    #: counts them): recorded like casts, in the source's tensor order.
    quantized: tuple[tuple[str, str], ...] = ()
    #: (canonical tensor, dtype sent, why) of tensors the destination holds in FP8 but receives
    #: unquantized and quantizes itself: the training layout cuts their blocks
    #: (``layout.quant.fp8_sides``); ``bytes_min`` counts them as sent.
    quantized_at_receiver: tuple[tuple[str, str, str], ...] = ()
    _by_src: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _by_dst: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _by_group: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _sites: dict = field(default_factory=dict, repr=False, compare=False)  # member_site's index
    #: ``digest()``, once: the driver and the metrics ask for it on every refit, and a full-size
    #: plan's takes seconds. Not an init field, so ``replace`` never carries it to another plan.
    _digest: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def bytes_planned(self) -> int:
        """Bytes every destination rank receives (relayed ones included)."""
        return sum(self.recv_bytes())

    def send_bytes(self) -> list[int]:
        """Per source rank (relays are destination ranks: not counted here)."""
        out = [0] * self.num_src
        for s, n in zip(map(_SRC, self.transfers), map(_NBYTES, self.transfers)):  # (C-level field reads)
            out[s] += n
        return out

    def recv_bytes(self) -> list[int]:
        out = [0] * self.num_dst
        ts = self.transfers
        for d, n in zip(map(_DST, ts), map(_NBYTES, ts)):
            out[d] += n
        if self.relay_of:
            for group, d, n in zip(self.relay_of, map(_DST, ts), map(_NBYTES, ts)):
                if group >= 0:
                    for m in self.relay_groups[group]:
                        if m != d:
                            out[m] += n
        return out

    def for_rank(self, side: str, rank: int) -> RankPlan:
        """This rank's slice (indexed once per plan, so every rank pays O(its transfers))."""
        s = self._for_rank(side, rank)
        if self.quantized and side == "src":
            s = replace(s, quantize=quantized_locals(s.transfers, self.quantized))
        if self.reinterpret:
            real = dict(self.reinterpret)
            local = {(t.src_name if side == "src" else t.dst_name): real[t.canonical]
                     for t in s.transfers if t.canonical in real}
            s = replace(s, reinterpret=tuple(sorted(local.items())))
        if not self.same_device:
            return s
        peers = (d for r, d in self.same_device if r == rank) if side == "src" else \
            (r for r, d in self.same_device if d == rank)
        return replace(s, same_device=tuple(sorted(set(peers))))

    def _for_rank(self, side: str, rank: int) -> RankPlan:
        index = self._by_src if side == "src" else self._by_dst
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        if not index:
            key = (lambda t: t.src) if side == "src" else (lambda t: t.dst)
            tmp: dict[int, list[int]] = {}
            for i, t in enumerate(self.transfers):
                tmp.setdefault(key(t), []).append(i)
            index.update({r: tuple(v) for r, v in tmp.items()})
        if not self.relay_groups:
            return RankPlan(side, rank, self.num_buckets, tuple(self.transfers[i] for i in index.get(rank, ())),
                            self.dtype)
        if side == "src":
            mine = index.get(rank, ())
            return RankPlan(side, rank, self.num_buckets, tuple(self.transfers[i] for i in mine), self.dtype,
                            relay_groups=self.relay_groups, relay_of=tuple(self.relay_of[i] for i in mine))
        if not self._by_group:
            tmp = {}
            for i, group in enumerate(self.relay_of):
                if group >= 0:
                    tmp.setdefault(group, []).append(i)
            self._by_group.update({group: tuple(v) for group, v in tmp.items()})
        groups = [group for group, members in enumerate(self.relay_groups) if rank in members]
        if not groups:  # nothing relayed to it: its own messages only (``via`` and ``relay_of`` default)
            return RankPlan(side, rank, self.num_buckets, tuple(self.transfers[i] for i in index.get(rank, ())),
                            self.dtype, relay_groups=self.relay_groups)
        # plan order (bucket, source, ...): what this rank receives itself, and every transfer
        # to its groups that a peer receives and forwards
        mine = sorted(set(index.get(rank, ())).union(*(self._by_group.get(group, ()) for group in groups)))
        if self.relay_sites:
            ts = tuple(self.transfers[i] if self.transfers[i].dst == rank else self._at_member(self.transfers[i], rank)
                       for i in mine)
        else:
            ts = tuple(self.transfers[i] if self.transfers[i].dst == rank else replace(self.transfers[i], dst=rank)
                       for i in mine)
        return RankPlan(side, rank, self.num_buckets, ts, self.dtype, relay_groups=self.relay_groups,
                        relay_of=tuple(self.relay_of[i] for i in mine), via=tuple(self.transfers[i].dst for i in mine))

    def _at_member(self, t: Transfer, member: int) -> Transfer:
        """Relayed transfer ``t`` as group member ``member`` receives it: at its own place."""
        name, view = member_site(self.relay_sites, self._sites, t, member)
        return replace(t, dst=member, dst_name=name, dst_view=view)

    def digest(self) -> str:
        """Stable hash of everything that moves; checked on every rank before the first byte.
        Casts are hashed only when there are any, so plans without casts keep their digests."""
        if not self._digest:
            self._digest.append(self._compute_digest())
        return self._digest[0]

    def _compute_digest(self) -> str:
        relays = None
        if self.relay_groups:  # members' own places only when some differ: older digests stay
            relays = (self.relay_groups, self.relay_of) + ((self.relay_sites,) if self.relay_sites else ())
        return plan_digest(self.transfers, self.num_buckets, self.dtype, self.casts, relays=relays,
                           same_device=self.same_device or None, reinterpret=self.reinterpret or None,
                           quantize=(self.quantized, self.quantized_at_receiver) if self.quantized_at_receiver
                           else (self.quantized or None))


def quantized_locals(transfers: Iterable[Transfer], quantized: Sequence[tuple[str, str]]) -> tuple[str, ...]:
    """Source local tensors that ``transfers`` read quantized (codes, or scales named
    ``<local>_scale_inv``), named as the sender holds them."""
    names = {name for name, _ in quantized}
    scales = {scale_name(name) for name in names}
    local = set()
    for t in transfers:
        if t.canonical in names:
            local.add(t.src_name)
        elif t.canonical in scales:
            local.add(t.src_name[: -len(SCALE_SUFFIX)])
    return tuple(sorted(local))


def member_site(sites: Sequence[tuple[tuple[int, str, str, Box, View], ...]], index: dict, t: Transfer,
                member: int) -> tuple[str, View]:
    """(local tensor, view) where relay-group ``member`` holds the box of ``t``, a transfer to
    another member (``t.dst``): its own place where ``sites`` (``TransferPlan.relay_sites``)
    lists the box ``t`` lies in, else the receiver's (the members hold it alike).
    ``index``: a cache for ``sites``, (re)filled on first use with them."""
    if index.get(None) is not sites:
        index.clear()
        index[None] = sites
        for k, box_sites in enumerate(sites):
            for rank, name, canonical, box, view in box_sites:
                index.setdefault((rank, name, canonical), []).append((box, view, k))
    for box, view, k in index.get((t.dst, t.dst_name, t.canonical), ()):
        if box.contains(t.box) and view.sub(box, t.box) == t.dst_view:
            for rank, name, _, m_box, m_view in sites[k]:
                if rank == member:
                    return name, m_view.sub(m_box, t.box)
    return t.dst_name, t.dst_view


def digest_text(memo: dict[int, str], x: Box | View) -> str:
    """``x`` as text in the plan and layout digests, formatted once per object (by identity:
    the rules share a few thousand boxes and views among ~300k pieces or transfers, which the
    caller keeps alive while ``memo`` lives)."""
    t = memo.get(id(x))
    if t is None:
        t = memo[id(x)] = f"{x.offsets}{x.sizes}" if isinstance(x, Box) else f"{x.offset}{x.stride}"
    return t


def plan_digest(
    transfers: Iterable[Transfer], num_buckets: int, dtype: str, casts: Iterable[tuple[str, str, str]] = (),
    *, relays: object = None, same_device: object = None, reinterpret: object = None, quantize: object = None,
) -> str:
    h = hashlib.sha256(f"{num_buckets}|{dtype}".encode())
    # Boxes and views as text, each object formatted once (by identity: a plan's ~300k
    # transfers share ~10k of them, and they outlive the call); lines hashed a few thousand
    # at a time (the same digest: sha256 of the concatenation).
    text: dict[int, str] = {}
    lines: list[str] = []
    if not isinstance(transfers, (tuple, list)):
        transfers = list(transfers)  # every object alive until the end (ids stay theirs)
    for t in transfers:
        b, s, d = digest_text(text, t.box), digest_text(text, t.src_view), digest_text(text, t.dst_view)
        lines.append(f"{t.bucket}|{t.src}|{t.dst}|{t.canonical}|{b}|{t.nbytes}|{t.src_name}|{s}|{t.dst_name}|{d}\n")
        if len(lines) >= 4096:
            h.update("".join(lines).encode())
            lines.clear()
    h.update("".join(lines).encode())
    for name, s_dtype, d_dtype in casts:  # nothing hashed without casts: older digests stay valid
        h.update(f"cast|{name}|{s_dtype}|{d_dtype}\n".encode())
    if relays is not None:  # likewise: plans without relays keep their digests
        h.update(f"relays|{relays}\n".encode())
    if same_device is not None:  # likewise
        h.update(f"same_device|{same_device}\n".encode())
    if reinterpret is not None:  # likewise: plans of one dtype keep their digests
        h.update(f"reinterpret|{reinterpret}\n".encode())
    if quantize is not None:  # likewise: plans without FP8 keep their digests
        h.update(f"quantize|{quantize}\n".encode())
    return h.hexdigest()[:16]
