"""The records the planner's named passes add to a plan, and their per-rank slices.

The core of a plan (``types.TransferPlan``) says who sends which box to whom in which bucket.
Everything else a feature needs is a typed record produced by one named pass, which brings
its own ``slice`` (its part of each rank's ``RankPlan``) and its own part of the digest:

==============  ================================  ==========================================
pass (name)     made by                           record: plan -> rank slice
==============  ================================  ==========================================
``fp8``         ``layout.quant.fp8_sides``        ``Quantized`` -> ``RankQuantize`` (senders)
``casts``       ``validate.check_sides``          ``Casts`` (nothing per rank: packing casts)
``reinterpret`` ``validate.wire_dtype``           ``Reinterpreted`` -> ``RankBits``
``lora``        ``SideLayout.scale`` (dst)        ``Scaled`` -> ``RankScale`` (senders)
``placement``   ``placement.same_device_pairs``   ``Colocated`` -> ``RankPeers``
``relays``      ``relays.spread``                 ``Relayed`` -> ``RankRelays``
==============  ================================  ==========================================

A pass that finds nothing adds no record, so a plan without the feature hashes and slices as
the core alone. Like DTensor's placements: small frozen values that know how to cut
themselves, so neither the core nor the transport grows a field per feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Iterable, Mapping, Sequence

from ..layout.descriptor import Box, View
from ..layout.quant import SCALE_SUFFIX, scale_name
from .types import RankPlan, Transfer, TransferPlan

__all__ = ["Casts", "Quantized", "Reinterpreted", "Scaled", "Colocated", "Relayed", "RankQuantize", "RankBits",
           "RankPeers", "RankRelays", "RankScale", "SLICE_RECORDS", "member_site", "quantized_locals"]

#: A member's place for a relayed box: (rank, local tensor, canonical, box, view).
Site = tuple[int, str, str, Box, View]


# -- per-rank records (what a rank runs; shipped in its slice) --

@dataclass(frozen=True)
class RankQuantize:
    """Source side: local tensors this rank quantizes to block FP8 before packing."""

    name: ClassVar[str] = "fp8"
    stage: ClassVar[int] = 1
    locals: tuple[str, ...]

    def digest_text(self) -> str:
        return repr(self.locals)

    def to_wire(self) -> list:
        return list(self.locals)

    @classmethod
    def from_wire(cls, d: Any) -> "RankQuantize":
        return cls(tuple(str(n) for n in d))


@dataclass(frozen=True)
class RankBits:
    """(local tensor, real dtype) this rank views as the wire dtype to move its bits."""

    name: ClassVar[str] = "reinterpret"
    stage: ClassVar[int] = 1
    locals: tuple[tuple[str, str], ...]

    def digest_text(self) -> str:
        return repr(self.locals)

    def to_wire(self) -> list:
        return [list(r) for r in self.locals]

    @classmethod
    def from_wire(cls, d: Any) -> "RankBits":
        return cls(tuple((str(n), str(dt)) for n, dt in d))


@dataclass(frozen=True)
class RankPeers:
    """Ranks of the other side on this rank's device: messages through shared memory."""

    name: ClassVar[str] = "placement"
    stage: ClassVar[int] = 1
    peers: tuple[int, ...]

    def digest_text(self) -> str:
        return repr(self.peers)

    def to_wire(self) -> list:
        return list(self.peers)

    @classmethod
    def from_wire(cls, d: Any) -> "RankPeers":
        return cls(tuple(int(r) for r in d))


@dataclass(frozen=True)
class RankRelays:
    """Every relay group of the plan, per transfer its group (-1: none) and, destination side,
    the member that receives it from the source and forwards it (``via``)."""

    name: ClassVar[str] = "relays"
    stage: ClassVar[int] = 0
    groups: tuple[tuple[int, ...], ...]
    relay_of: tuple[int, ...] = ()
    via: tuple[int, ...] = ()

    def digest_text(self) -> str:
        return repr((self.groups, self.relay_of, self.via))

    def to_wire(self) -> dict:
        return {"groups": [list(m) for m in self.groups], "stream": list(self.relay_of), "via": list(self.via)}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "RankRelays":
        return cls(tuple(tuple(int(m) for m in members) for members in d.get("groups", ())),
                   tuple(int(g) for g in d.get("stream", ())), tuple(int(v) for v in d.get("via", ())))


@dataclass(frozen=True)
class RankScale:
    """Source side: (local tensor, factor) this rank multiplies by ``factor`` while packing."""

    name: ClassVar[str] = "lora"
    stage: ClassVar[int] = 1
    locals: tuple[tuple[str, float], ...]

    def digest_text(self) -> str:
        return repr(self.locals)

    def to_wire(self) -> list:
        return [[n, f] for n, f in self.locals]

    @classmethod
    def from_wire(cls, d: Any) -> "RankScale":
        return cls(tuple((str(n), float(f)) for n, f in d))


#: Per-rank record types by pass name: what ``plan.wire`` decodes.
SLICE_RECORDS = {c.name: c for c in (RankQuantize, RankBits, RankPeers, RankRelays, RankScale)}


# -- plan records (one per pass that found something) --

@dataclass(frozen=True)
class Casts:
    """(canonical tensor, source dtype, destination dtype) of every tensor whose dtypes differ
    (``refit.allow_cast=true``), in the destination's tensor order. The sender casts while
    packing (the wire carries the plan's dtype), so no rank's slice changes."""

    name: ClassVar[str] = "casts"
    stage: ClassVar[int] = 1
    entries: tuple[tuple[str, str, str], ...]

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        return rank_plan

    def digest_text(self) -> str:
        return "".join(f"{n}|{s}|{d};" for n, s, d in self.entries)


@dataclass(frozen=True)
class Quantized:
    """(canonical tensor, dtype the sender holds) of every tensor the senders quantize to
    block FP8 while packing (``layout.quant``: the wire carries codes and scales, ``bytes_min``
    counts them), and (tensor, dtype sent, why) of FP8 tensors whose blocks the training
    layout cuts: sent unquantized, the receiver quantizes them."""

    name: ClassVar[str] = "fp8"
    stage: ClassVar[int] = 1
    entries: tuple[tuple[str, str], ...]
    at_receiver: tuple[tuple[str, str, str], ...] = ()

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        if rank_plan.side != "src":
            return rank_plan
        names = quantized_locals(rank_plan.transfers, self.entries)
        return rank_plan.extended(RankQuantize(names)) if names else rank_plan

    def digest_text(self) -> str:
        return repr((self.entries, self.at_receiver))


@dataclass(frozen=True)
class Scaled:
    """(canonical tensor, factor) of every tensor the destination holds multiplied by
    ``factor`` (vLLM folds a LoRA adapter's ``alpha / r`` into its B, ``layout.lora``): the
    senders multiply while packing, in the wire dtype, as vLLM's loader does (``lora_b *=
    scaling``), so the engine holds what loading the same PEFT adapter gives, bit for bit."""

    name: ClassVar[str] = "lora"
    stage: ClassVar[int] = 1
    entries: tuple[tuple[str, float], ...]

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        if rank_plan.side != "src":
            return rank_plan
        factor = dict(self.entries)
        local: dict[str, float] = {}
        for t in rank_plan.transfers:
            f = factor.get(t.canonical, 1.0)
            if local.setdefault(t.src_name, f) != f:
                raise ValueError(f"{t.src_name}: holds tensors scaled by {local[t.src_name]} and by {f}")
        mine = tuple(sorted((n, f) for n, f in local.items() if f != 1.0))
        return rank_plan.extended(RankScale(mine)) if mine else rank_plan

    def digest_text(self) -> str:
        return repr(self.entries)


@dataclass(frozen=True)
class Reinterpreted:
    """(canonical tensor, real dtype) of every tensor both sides hold in a dtype other than the
    wire's (e.g. DeepSeek's fp32 router bias in a bf16 refit): carried bit for bit as
    wire-dtype elements, never cast. Its transfers' boxes and views are in wire units (last
    dim x itemsize ratio); ``bytes_min`` counts real bytes."""

    name: ClassVar[str] = "reinterpret"
    stage: ClassVar[int] = 1
    entries: tuple[tuple[str, str], ...]

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        real = dict(self.entries)
        src = rank_plan.side == "src"
        local = {(t.src_name if src else t.dst_name): real[t.canonical]
                 for t in rank_plan.transfers if t.canonical in real}
        return rank_plan.extended(RankBits(tuple(sorted(local.items())))) if local else rank_plan

    def digest_text(self) -> str:
        return repr(self.entries)


@dataclass(frozen=True)
class Colocated:
    """(source rank, destination rank) pairs on one device: the executor moves their messages
    through shared memory."""

    name: ClassVar[str] = "placement"
    stage: ClassVar[int] = 1
    pairs: tuple[tuple[int, int], ...]

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        rank = rank_plan.rank
        peers = (d for r, d in self.pairs if r == rank) if rank_plan.side == "src" else \
            (r for r, d in self.pairs if d == rank)
        mine = tuple(sorted(set(peers)))
        return rank_plan.extended(RankPeers(mine)) if mine else rank_plan

    def digest_text(self) -> str:
        return repr(self.pairs)


@dataclass(frozen=True)
class Relayed:
    """Fan-out relays: groups of destination ranks on one node that hold the same pieces, and
    per transfer its relay group (``relay_of``, aligned with the plan's transfers; -1: not
    relayed). A relayed transfer goes to one member over the fabric (its ``dst``), which
    forwards it to the group's others over the node's links.

    ``sites``: relayed boxes whose members hold them at different places (vLLM EPLB: a
    redundant expert copy in another slot of another rank): per box, every member's
    (rank, local tensor, canonical, box, view), in wire units. Empty: every member holds each
    relayed box where its receiver does."""

    name: ClassVar[str] = "relays"
    stage: ClassVar[int] = 0  # first: a member's slice gains the transfers it receives forwarded
    groups: tuple[tuple[int, ...], ...]
    relay_of: tuple[int, ...]
    sites: tuple[tuple[Site, ...], ...] = ()

    def slice(self, plan: TransferPlan, rank_plan: RankPlan) -> RankPlan:
        rank = rank_plan.rank
        if rank_plan.side == "src":
            mine = plan.positions("src", rank)
            return rank_plan.extended(RankRelays(self.groups, tuple(self.relay_of[i] for i in mine)))
        groups = [group for group, members in enumerate(self.groups) if rank in members]
        if not groups:  # nothing relayed to it: its own messages only
            return rank_plan.extended(RankRelays(self.groups))
        # plan order (bucket, source, ...): what this rank receives itself, and every transfer
        # to its groups that a peer receives and forwards
        mine = sorted(set(plan.positions("dst", rank)).union(*(self._by_group.get(g, ()) for g in groups)))
        ts = plan.transfers
        out = tuple(ts[i] if ts[i].dst == rank else self.at_member(ts[i], rank) for i in mine)
        return rank_plan.extended(
            RankRelays(self.groups, tuple(self.relay_of[i] for i in mine), tuple(ts[i].dst for i in mine)),
            transfers=out)

    def at_member(self, t: Transfer, member: int) -> Transfer:
        """Relayed transfer ``t`` as group member ``member`` receives it: at its own place."""
        name, view = member_site(self.sites, self._sites_index, t, member) if self.sites else (t.dst_name, t.dst_view)
        return Transfer(t.src, member, t.canonical, t.box, t.src_name, t.src_view, name, view, t.nbytes, t.bucket)

    @cached_property
    def _by_group(self) -> dict[int, tuple[int, ...]]:
        tmp: dict[int, list[int]] = {}
        for i, group in enumerate(self.relay_of):
            if group >= 0:
                tmp.setdefault(group, []).append(i)
        return {group: tuple(v) for group, v in tmp.items()}

    @cached_property
    def _sites_index(self) -> dict:
        return {}

    def digest_text(self) -> str:
        # members' own places only when some differ
        return repr((self.groups, self.relay_of) + ((self.sites,) if self.sites else ()))


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


def member_site(sites: Sequence[tuple[Site, ...]], index: dict, t: Transfer, member: int) -> tuple[str, View]:
    """(local tensor, view) where relay-group ``member`` holds the box of ``t``, a transfer to
    another member (``t.dst``): its own place where ``sites`` (``Relayed.sites``) lists the
    box ``t`` lies in, else the receiver's (the members hold it alike).
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
