"""Fan-out relays (``plan.placed``): one member of a relay group receives a message from its
source and forwards the same bytes (no packing) to the other members.

A relayed message comes from a peer that forwards only once its own direct messages arrived,
so a bucket lands in three steps: wait for the direct messages, forward, wait for the relayed
ones. Forwards are waited for after delivery, before their receive buffer is reused.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .channels import ChannelKey, GroupChannel, LocalChannel, Op, ShmChannel

__all__ = ["RelayForwarder"]


class RelayForwarder:
    """Forwards this rank's relayed messages, one bucket at a time."""

    def __init__(self, wire: GroupChannel, shm: ShmChannel, local: LocalChannel) -> None:
        self.wire, self.shm, self.local, self.route = wire, shm, local, wire.route
        self.pending: list[Op] = []  # forwards of the last bucket, not yet waited for

    def split(self, ops: Sequence[Op]) -> tuple[list[Op], list[Op]]:
        """(ops to wait for before forwarding, receives of relayed messages to wait for after)."""
        relayed = [op for op in ops if self.route.relayed(op)]
        return [op for op in ops if not self.route.relayed(op)], relayed

    def forward(self, k: int, ops: Sequence[Op]) -> None:
        """Pass every relayed message this rank received from a source in bucket ``k`` (over
        the group, through shared memory or from itself) on to the other members of its
        relay group."""
        route, dst_rank = self.route, self.route.dst_rank
        got: dict[ChannelKey, torch.Tensor] = {
            channel: self.shm.msgs.get((k, channel), t) for side, channel, t, _ in ops
            if side in ("src", "shm_src") and channel[1] == dst_rank and channel[2] >= 0}
        got.update(self.local.relayed(k))
        specs = [("dst", m, msg, route.rank_map.group_rank("dst", m), route.tag(k, g, forwarded_from=src))
                 for (src, _, g), msg in sorted(got.items()) for m in route.groups[g] if m != dst_rank]
        self.pending = self.wire.post_all(k, specs)

    def take(self) -> list[Op]:
        """The forwards posted for the last bucket (to wait for), forgotten here."""
        pending, self.pending = self.pending, []
        return pending
