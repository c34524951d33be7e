"""The bucket schedule: two buffers of each kind, and the order of one refit's rounds.

Per bucket (round) every sender packs its boxes for each peer back to back into one slice of a
preallocated send buffer and posts one send per peer; every receiver posts one receive per peer
into one preallocated receive buffer and, once they land, hands each box to a sink. Buffers come
in pairs: bucket k+1 is packed while bucket k is on the wire, and is on the wire while bucket k
is delivered (so the receiver's apply overlaps the transfer); at most two buckets are in flight,
hence a plan's bucket budget is half the memory a rank may spend. All sends and receives of a
bucket are posted before any wait, and every rank walks the buckets in the same order, so the
schedule cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from ..plan.types import Transfer

__all__ = ["BufferSizes", "Rounds", "run_rounds"]


@dataclass(frozen=True)
class BufferSizes:
    """The wire buffers of one refit on one rank: ``n_send`` (``n_recv``) of ``send_numel``
    (``recv_numel``) elements; at most two each, one per bucket in flight."""

    send_numel: int
    recv_numel: int
    n_send: int
    n_recv: int

    @classmethod
    def of(cls, send_b: Sequence[Mapping[Any, list[Transfer]]], recv_b: Sequence[Mapping[Any, list[Transfer]]],
           packed_numel: Callable[[Sequence[Transfer]], int], remote: Callable[[Any], bool]) -> "BufferSizes":
        """Sized for the largest bucket; ``remote(channel)``: its message lands in a receive
        buffer (not a message to myself, not one in shared memory)."""
        send_numel = max((sum(packed_numel(ts) for ts in b.values()) for b in send_b), default=0)
        recv_numel = max((sum(packed_numel(ts) for c, ts in b.items() if remote(c)) for b in recv_b), default=0)
        # Two of each: bucket k+1 is packed and on the wire while bucket k is delivered.
        n_send = min(2, sum(1 for b in send_b if b))
        n_recv = min(2, sum(1 for b in recv_b if any(remote(c) for c in b)))
        return cls(send_numel, recv_numel, n_send, n_recv)

    def nbytes(self, itemsize: int) -> int:
        return (self.n_send * self.send_numel + self.n_recv * self.recv_numel) * itemsize


class Rounds(Protocol):
    """The steps of one rank's refit that ``run_rounds`` puts in order."""

    def pack(self, k: int) -> Any:
        """Pack bucket ``k`` into its send buffer."""

    def post(self, k: int, packed: Any) -> list[Any]:
        """Post every send and receive of bucket ``k``; returns the ops."""

    def posted(self) -> None:
        """The bucket just posted is on the wire (work that should overlap it goes here)."""

    def land(self, k: int, ops: list[Any]) -> None:
        """Wait until bucket ``k``'s messages are here (and forwarded)."""

    def deliver(self, k: int, ops: list[Any]) -> None:
        """Hand bucket ``k``'s boxes to the sink."""

    def release(self, k: int) -> None:
        """Bucket ``k`` is done: its buffers may be reused."""


def run_rounds(num_buckets: int, r: Rounds) -> None:
    """Walk the buckets, two in flight: bucket k+1 is packed while bucket k is on the wire, and
    on the wire while bucket k is delivered."""
    ops = r.post(0, r.pack(0)) if num_buckets else []
    r.posted()
    for k in range(num_buckets):
        last = k + 1 == num_buckets
        nxt = {} if last else r.pack(k + 1)  # while bucket k is on the wire
        r.land(k, ops)
        nxt_ops = [] if last else r.post(k + 1, nxt)
        r.posted()
        r.deliver(k, ops)  # while k+1 is on the wire
        r.release(k)
        ops = nxt_ops
