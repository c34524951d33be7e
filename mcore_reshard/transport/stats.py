"""What one rank did in one refit: the running tallies and the report made of them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..wire.protocol import DeltaStats

__all__ = ["Tally", "TransferStats"]

#: Sides of a posted op that send (see ``channels.Op``); every other counted side receives.
_SENDS = frozenset(("dst", "shm_dst", "ddst"))
_SAME_DEVICE = frozenset(("shm_src", "shm_dst"))
_ZERO_COPY = frozenset(("ddst", "dsrc"))


@dataclass(frozen=True)
class TransferStats:
    """What one rank did in one refit. Bytes and messages count what moved between processes
    (not copies a colocated rank makes to itself); ``bytes_same_device`` is the part of them
    that went through shared memory. Phases overlap, so they need not add up to ``seconds``."""

    bytes_sent: int
    bytes_received: int
    messages: int
    buckets: int
    seconds: float
    pack_s: float
    wire_s: float
    unpack_s: float
    verify_s: float
    peak_extra_bytes: int
    verified: bool
    bytes_same_device: int = 0
    #: The part that went zero-copy: from the source parameter into the destination's tensor.
    bytes_zero_copy: int = 0
    #: What a full refit would have received on this rank (equal to ``bytes_received`` then).
    bytes_full: int = 0
    #: The part of ``bytes_received`` that was delta headers (8 bytes per box).
    bytes_headers: int = 0
    #: Delta refits (``delta.py``).
    delta: DeltaStats = DeltaStats()
    #: Seconds this sender spent quantizing to block FP8 (``quantize.py``; 0 without).
    quantize_s: float = 0.0


@dataclass
class Tally:
    """The counters of one refit on one rank, shared by its parts (mutable, one per run)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    bytes_same_device: int = 0
    bytes_zero_copy: int = 0
    bytes_full: int = 0
    bytes_headers: int = 0
    delta_elements: int = 0
    delta_changed: int = 0
    #: Boxes encoded (unchanged, sparse, dense).
    delta_boxes: list[int] = field(default_factory=lambda: [0, 0, 0])
    #: Seconds per phase; parts add to them as they go.
    phase: dict[str, float] = field(default_factory=lambda: {"pack": 0.0, "wire": 0.0, "unpack": 0.0, "verify": 0.0})
    #: Wire buffers, and the most they and zero-copy temporaries held at once.
    buffer_bytes: int = 0
    temp_bytes: int = 0
    extra_bytes: int = 0

    def timed(self, name: str, t0: float) -> None:
        """Add the time since ``t0`` to phase ``name``."""
        self.phase[name] += time.perf_counter() - t0

    def count(self, side: str, nbytes: int) -> None:
        """One message (or zero-copy box) of ``nbytes`` moved, on an op of ``side``."""
        if side in _SAME_DEVICE:
            self.bytes_same_device += nbytes
        if side in _ZERO_COPY:
            self.bytes_zero_copy += nbytes
        if side in _SENDS:
            self.bytes_sent += nbytes
        else:
            self.bytes_received += nbytes
        self.messages += 1

    def hold(self, nbytes: int) -> None:
        """A temporary of ``nbytes`` is held (negative: released); tracks the peak."""
        self.temp_bytes += nbytes
        if nbytes > 0:
            self.extra_bytes = max(self.extra_bytes, self.buffer_bytes + self.temp_bytes)

    def report(self, buckets: int, seconds: float, verified: bool) -> TransferStats:
        p = self.phase
        return TransferStats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            messages=self.messages,
            buckets=buckets,
            seconds=seconds,
            pack_s=p["pack"],
            wire_s=p["wire"],
            unpack_s=p["unpack"],
            verify_s=p["verify"],
            peak_extra_bytes=self.extra_bytes,
            verified=verified,
            bytes_same_device=self.bytes_same_device,
            bytes_zero_copy=self.bytes_zero_copy,
            bytes_full=self.bytes_full,
            bytes_headers=self.bytes_headers,
            delta=DeltaStats(elements=self.delta_elements, changed=self.delta_changed, boxes=tuple(self.delta_boxes)),
        )
