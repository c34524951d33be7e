"""Plan value types: what moves from which training rank to which inference rank.

Like DCP's ``SavePlan``/``LoadPlan``: plain frozen data that can be printed, diffed and
hashed, produced by the planner and consumed by a transport that knows nothing of models.
Source ranks (training) and destination ranks (inference) are separate rank spaces; the
transport maps both into its own process group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable

from ..layout.descriptor import Box, View

__all__ = ["PlanError", "Transfer", "RankPlan", "TransferPlan"]


class PlanError(ValueError):
    """The two sides cannot be planned against each other; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One box of one canonical tensor, read from ``src``'s local tensor and written into
    ``dst``'s, inside bucket (round) ``bucket``."""

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

    def buckets(self) -> list[dict[int, list[Transfer]]]:
        """Per bucket: peer -> transfers in wire order."""
        out: list[dict[int, list[Transfer]]] = [dict() for _ in range(self.num_buckets)]
        for t in self.transfers:
            peer = t.dst if self.side == "src" else t.src
            out[t.bucket].setdefault(peer, []).append(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def digest(self) -> str:
        """Hash of this slice: a rank checks the slice it was given is the one it runs."""
        return plan_digest(self.transfers, self.num_buckets, self.dtype)


@dataclass(frozen=True)
class TransferPlan:
    """The global plan. ``transfers`` are sorted by (bucket, src, dst, wire order)."""

    transfers: tuple[Transfer, ...]
    num_buckets: int
    num_src: int
    num_dst: int
    itemsize: int
    dtype: str  # destination element type, what the wire carries
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
    _by_src: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)
    _by_dst: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def bytes_planned(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def send_bytes(self) -> list[int]:
        out = [0] * self.num_src
        for t in self.transfers:
            out[t.src] += t.nbytes
        return out

    def recv_bytes(self) -> list[int]:
        out = [0] * self.num_dst
        for t in self.transfers:
            out[t.dst] += t.nbytes
        return out

    def for_rank(self, side: str, rank: int) -> RankPlan:
        """This rank's slice (indexed once per plan, so every rank pays O(its transfers))."""
        index = self._by_src if side == "src" else self._by_dst
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        if not index:
            key = (lambda t: t.src) if side == "src" else (lambda t: t.dst)
            tmp: dict[int, list[int]] = {}
            for i, t in enumerate(self.transfers):
                tmp.setdefault(key(t), []).append(i)
            index.update({r: tuple(v) for r, v in tmp.items()})
        return RankPlan(side, rank, self.num_buckets, tuple(self.transfers[i] for i in index.get(rank, ())), self.dtype)

    def digest(self) -> str:
        """Stable hash of everything that moves; checked on every rank before the first byte.
        Casts are hashed only when there are any, so plans without casts keep their digests."""
        return plan_digest(self.transfers, self.num_buckets, self.dtype, self.casts)


def plan_digest(
    transfers: Iterable[Transfer], num_buckets: int, dtype: str, casts: Iterable[tuple[str, str, str]] = ()
) -> str:
    h = hashlib.sha256(f"{num_buckets}|{dtype}".encode())
    for t in transfers:
        h.update(
            f"{t.bucket}|{t.src}|{t.dst}|{t.canonical}|{t.box.offsets}{t.box.sizes}|{t.nbytes}|{t.src_name}|"
            f"{t.src_view.offset}{t.src_view.stride}|{t.dst_name}|{t.dst_view.offset}{t.dst_view.stride}\n".encode()
        )
    for name, s_dtype, d_dtype in casts:  # nothing hashed without casts: older digests stay valid
        h.update(f"cast|{name}|{s_dtype}|{d_dtype}\n".encode())
    return h.hexdigest()[:16]
