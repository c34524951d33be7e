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
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import repeat
from typing import ClassVar, Iterable, Protocol, Sequence, runtime_checkable

from ..layout.descriptor import DTYPE_BYTES, Box, View

__all__ = ["PlanError", "Transfer", "RankPlan", "TransferPlan", "Extension", "PlanExtension", "PLAN_SCHEMA",
           "digest_text", "plan_digest"]


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


#: Version of the digest's schema: hashed first, so a digest of another schema never matches.
PLAN_SCHEMA = 2


@runtime_checkable
class Extension(Protocol):
    """A typed record a named planner pass adds to a plan or a slice: what the core (who
    sends which box to whom, in which bucket) does not say. ``name`` is its pass's name and
    its key on the wire and in the digest; ``stage`` orders slicing (0 first: it may change
    the slice's transfers). Records are frozen values: a pass makes a new plan with
    ``TransferPlan.extended``, never changes one."""

    name: ClassVar[str]
    stage: ClassVar[int]

    def digest_text(self) -> str:
        """This record's part of the digest."""
        ...


class PlanExtension(Extension, Protocol):
    """A plan's record: it cuts its own part of each rank's slice."""

    def slice(self, plan: "TransferPlan", rank_plan: "RankPlan") -> "RankPlan":
        """``rank_plan`` (the core slice, and the records of earlier stages) with this
        record's part for that rank added."""
        ...


def _ordered(records: Iterable[Extension]) -> tuple:
    """Records in slicing and digest order; one per pass."""
    out = sorted(records, key=lambda e: (e.stage, e.name))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"one record per pass, got {names}")
    return tuple(out)


class _Records:
    """What a plan and a slice share: their records, one per pass."""

    extensions: tuple

    def get(self, name: str):
        """The record of pass ``name``, or None where the pass added nothing here."""
        for e in self.extensions:
            if e.name == name:
                return e
        return None

    def extended(self, record: Extension, **changes):
        """A new value with ``record`` (replacing its pass's earlier one) and ``changes``."""
        others = tuple(e for e in self.extensions if e.name != record.name)
        return replace(self, extensions=_ordered(others + (record,)), **changes)

    @property
    def relay_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every relay group of the plan (destination ranks on one node that hold the same
        pieces; a rank may be in several)."""
        r = self.get("relays")
        return r.groups if r else ()

    @property
    def relay_of(self) -> tuple[int, ...]:
        """Per transfer its relay group, aligned with ``transfers`` (-1: not relayed)."""
        r = self.get("relays")
        return r.relay_of if r else ()


@dataclass(frozen=True)
class RankPlan(_Records):
    """One rank's slice of a plan: what it sends (as a source) or receives (as a destination),
    in bucket order, each bucket grouped by peer in peer order -- both ends of a message derive
    the same order, so a packed buffer needs no header. What the passes add for this rank
    (relays, same-device peers, tensors carried as bits, FP8 at the sender) are the
    ``extensions`` (``plan.extensions``), read through the properties below."""

    side: str  # "src" | "dst"
    rank: int
    num_buckets: int
    transfers: tuple[Transfer, ...]
    #: Element type on the wire (the destination's; a cast happens while packing).
    dtype: str = "float32"
    extensions: tuple[Extension, ...] = ()

    # -- the records, read as plain values (empty where the pass added nothing) --
    @property
    def via(self) -> tuple[int, ...]:
        """Destination side, per transfer: the member that receives it from the source and
        forwards it to the group's others (this rank or a peer)."""
        r = self.get("relays")
        return r.via if r else ()

    @property
    def scale(self) -> tuple[tuple[str, float], ...]:
        """Source side: (local tensor, factor) this rank multiplies while packing."""
        r = self.get("lora")
        return r.locals if r else ()

    @property
    def same_device(self) -> tuple[int, ...]:
        """Peers of the other side on this rank's device: their messages move through shared
        memory, never through the group's sockets."""
        r = self.get("placement")
        return r.peers if r else ()

    @property
    def reinterpret(self) -> tuple[tuple[str, str], ...]:
        """(local tensor, its real dtype) this rank views as ``dtype`` (the wire's) to move
        its bits unchanged; views and boxes of their transfers are in wire-dtype units."""
        r = self.get("reinterpret")
        return r.locals if r else ()

    @property
    def quantize(self) -> tuple[str, ...]:
        """Source side: local tensors this rank quantizes to block FP8 before packing; the plan
        reads their codes under the same name and their scales as ``<name>_scale_inv``."""
        r = self.get("fp8")
        return r.locals if r else ()

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
        return self._digest

    @cached_property
    def _digest(self) -> str:  # (not a field: ``replace`` never carries it to another slice)
        return plan_digest(self.transfers, self.num_buckets, self.dtype, _ordered(self.extensions))


@dataclass(frozen=True)
class TransferPlan(_Records):
    """The global plan: the core every refit needs, plus the records of the passes that ran
    (``extensions``; see ``plan.extensions``): casts, tensors carried as bits, FP8 at the
    sender, same-device pairs, fan-out relays. ``transfers`` are sorted by (bucket, src, dst,
    wire order)."""

    transfers: tuple[Transfer, ...]
    num_buckets: int
    num_src: int
    num_dst: int
    dtype: str  # destination element type, what the wire carries
    #: What the destination ranks hold (padding excluded), summed over all ``num_dst`` ranks.
    bytes_min: int
    bytes_hf_broadcast: int
    bucket_bytes: int
    #: (dst rank, local param, elements) the receiver zero-fills itself (never sent).
    padding: tuple[tuple[int, str, int], ...] = ()
    #: (parameter, reason) for anything not on the direct shard-to-shard path.
    not_direct: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    extensions: tuple[PlanExtension, ...] = ()
    plan_seconds: float = 0.0

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    # -- the records, read as plain values (empty where the pass did not run) --
    @property
    def casts(self) -> tuple[tuple[str, str, str], ...]:
        """(canonical tensor, source dtype, destination dtype) of every tensor whose dtypes
        differ (``refit.allow_cast=true``): the sender casts while packing."""
        r = self.get("casts")
        return r.entries if r else ()

    @property
    def reinterpret(self) -> tuple[tuple[str, str], ...]:
        """(canonical tensor, real dtype) of every tensor carried bit for bit as wire-dtype
        elements; its transfers' boxes and views are in wire units."""
        r = self.get("reinterpret")
        return r.entries if r else ()

    @property
    def quantized(self) -> tuple[tuple[str, str], ...]:
        """(canonical tensor, dtype the sender holds) of every tensor the senders quantize to
        block FP8 while packing."""
        r = self.get("fp8")
        return r.entries if r else ()

    @property
    def scaled(self) -> tuple[tuple[str, float], ...]:
        """(canonical tensor, factor) of every tensor the destination holds scaled."""
        r = self.get("lora")
        return r.entries if r else ()

    @property
    def quantized_at_receiver(self) -> tuple[tuple[str, str, str], ...]:
        """(canonical tensor, dtype sent, why) of FP8 tensors the receiver quantizes itself."""
        r = self.get("fp8")
        return r.at_receiver if r else ()

    @property
    def same_device(self) -> tuple[tuple[int, int], ...]:
        """(source rank, destination rank) pairs on one device."""
        r = self.get("placement")
        return r.pairs if r else ()

    @property
    def relay_sites(self) -> tuple[tuple[tuple[int, str, str, Box, View], ...], ...]:
        r = self.get("relays")
        return r.sites if r else ()

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
        """This rank's slice: its own transfers (indexed once per plan, so every rank pays
        O(its transfers)), then each record's part, in stage order."""
        s = RankPlan(side, rank, self.num_buckets, tuple(self.transfers[i] for i in self.positions(side, rank)),
                     self.dtype)
        for record in _ordered(self.extensions):
            s = record.slice(self, s)
        return s

    def positions(self, side: str, rank: int) -> tuple[int, ...]:
        """Where ``rank``'s own transfers are in ``transfers`` (as sender or receiver)."""
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        return (self._src_index if side == "src" else self._dst_index).get(rank, ())

    @cached_property
    def _src_index(self) -> dict[int, tuple[int, ...]]:
        return _index(map(_SRC, self.transfers))

    @cached_property
    def _dst_index(self) -> dict[int, tuple[int, ...]]:
        return _index(map(_DST, self.transfers))

    def digest(self) -> str:
        """Stable hash of everything that moves (the schema version, the core, every record);
        checked on every rank before the first byte."""
        return self._digest

    @cached_property
    def _digest(self) -> str:  # once: the driver and metrics ask on every refit, a full-size plan's takes seconds
        return plan_digest(self.transfers, self.num_buckets, self.dtype, _ordered(self.extensions))


def _index(ranks: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """rank -> positions of its transfers, in plan order."""
    tmp: dict[int, list[int]] = {}
    for i, r in enumerate(ranks):
        tmp.setdefault(r, []).append(i)
    return {r: tuple(v) for r, v in tmp.items()}


def digest_text(memo: dict[int, str], x: Box | View) -> str:
    """``x`` as text in the plan and layout digests, formatted once per object (by identity:
    the rules share a few thousand boxes and views among ~300k pieces or transfers, which the
    caller keeps alive while ``memo`` lives)."""
    t = memo.get(id(x))
    if t is None:
        t = memo[id(x)] = f"{x.offsets}{x.sizes}" if isinstance(x, Box) else f"{x.offset}{x.stride}"
    return t


def plan_digest(transfers: Iterable[Transfer], num_buckets: int, dtype: str,
                extensions: Iterable[Extension] = ()) -> str:
    """The schema version, the core, then each record's part under its pass's name."""
    h = hashlib.sha256(f"plan/v{PLAN_SCHEMA}|{num_buckets}|{dtype}\n".encode())
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
    for record in extensions:
        h.update(f"{record.name}|{record.digest_text()}\n".encode())
    return h.hexdigest()[:16]
