"""Hand a bucket's received boxes to the sink, and record the checksum of what it then holds.

One path for every box, through the sink's two calls (``sink.py``): each box's tensor is
resolved, written -- the packed boxes of a message in one batch (``packing.unpack_into``), a
zero-copy box already received into it, a delta's patched box as the baseline plus its
changes -- and, when verifying, hashed where it now lies; then every box is committed
(``commit_box``), in wire order. A delta's unchanged box is not resolved: it is hashed where
the destination holds it (``baseline``) and committed as kept. The hash is of the
destination's tensor before ``commit_box`` may repack a layer, so verification checks the
parameter itself, not only the bytes received.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ..plan.types import Transfer
from ..wire.faults import Fault
from .channels import ChannelKey
from .checksum import digest_at
from .injection import flip_first
from .group import RefitError
from .ledger import ChecksumLedger
from .packing import unpack_into
from .sink import Sink, baseline_of
from .stats import Tally
from .views import copy_unless_same, scatter_flat

__all__ = ["Delivery"]


class Delivery:
    """Delivers every bucket of one refit on a destination rank. ``landed``: zero-copy boxes
    received straight into their resolved tensor, by (bucket, id); ``temps``: the others,
    received into a temporary. ``fault``: a destination bit flip (tests: ``Fault.tensor``)."""

    def __init__(self, sink: Sink, verify: bool, box_sum: Callable[[torch.Tensor], Any], direct: set[int],
                 landed: dict[tuple[int, int], torch.Tensor], temps: Mapping[tuple[int, int], torch.Tensor],
                 ledger: ChecksumLedger, tally: Tally, fault: Fault | None = None) -> None:
        self.sink, self.verify, self.box_sum, self.direct = sink, verify, box_sum, direct
        self.landed, self.temps, self.ledger, self.tally = landed, temps, ledger, tally
        self.baseline = baseline_of(sink)
        self.fault = fault if fault is not None and fault.kind == "bitflip" and fault.tensor else None

    def deliver(self, k: int, msgs: Mapping[ChannelKey, torch.Tensor],
                bucket: Mapping[ChannelKey, list[Transfer]], special: Mapping[int, Any] | None = None) -> None:
        """Hand every box of bucket ``k`` to the sink (``msgs``: each channel's packed message),
        then checksum what it holds. ``special``: boxes of a delta refit that are not in the
        messages, by id: None -- unchanged, kept where the destination holds it; (positions,
        values) -- the baseline with those changes."""
        for peer, ts in bucket.items():
            self._deliver(k, peer, ts, msgs.get(peer), special or {})

    def _deliver(self, k: int, peer: ChannelKey, ts: Sequence[Transfer], msg: torch.Tensor | None,
                 special: Mapping[int, Any]) -> None:
        t0 = time.perf_counter()
        sink = self.sink
        targets: list[torch.Tensor | None] = []  # per box: where it lies now (None: kept)
        packed: list[torch.Tensor] = []
        for t in ts:
            key = id(t)
            if key in special:
                change = special[key]
                targets.append(None if change is None else self._patch(t, *change))
            elif key in self.direct:
                targets.append(self._landed(k, t))
            else:
                x = sink.resolve(t.dst_name, t.dst_view)
                packed.append(x)
                targets.append(x)
        written = iter(unpack_into(packed, msg) if packed else ())
        if self.fault is not None:
            self._flip(ts, targets)
        t1 = time.perf_counter()
        if self.verify:
            rows = []
            for t, x in zip(ts, targets):
                if x is None:
                    rows.append(self.box_sum(self.baseline(t.dst_name, t.dst_view)))
                    continue
                w = next(written) if id(t) not in self.direct and id(t) not in special else x
                rows.append(digest_at(w) if isinstance(w, tuple) else self.box_sum(w))
            self.ledger.received(peer, rows)
        t2 = time.perf_counter()
        for t in ts:
            sink.commit_box(t.dst_name, t.dst_view)
        t3 = time.perf_counter()
        self.tally.phase["unpack"] += (t1 - t0) + (t3 - t2)
        self.tally.phase["verify"] += t2 - t1

    def _landed(self, k: int, t: Transfer) -> torch.Tensor:
        """A zero-copy box: where it was received, or its temporary copied into its tensor."""
        x = self.landed.pop((k, id(t)), None)
        if x is None:
            x = self.sink.resolve(t.dst_name, t.dst_view)
            x.copy_(self.temps[(k, id(t))].view(x.shape))
        return x

    def _patch(self, t: Transfer, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A delta's changed box: its tensor holds the baseline, then the changes."""
        if self.baseline is None:
            raise RefitError(f"{t.dst_name}: a delta refit reached a sink without a baseline")
        x = self.sink.resolve(t.dst_name, t.dst_view)
        base = self.baseline(t.dst_name, t.dst_view)
        copy_unless_same(x, base)
        scatter_flat(x, positions.to(x.device), values.to(x.device))
        return x

    def _flip(self, ts: Sequence[Transfer], targets: Sequence[torch.Tensor | None]) -> None:
        """Fault injection: the first box of ``fault.tensor`` (at ``fault.offset`` where set)
        corrupted where it landed, before it is hashed -- a broken write at the destination."""
        f = self.fault
        for t, x in zip(ts, targets):
            if x is not None and t.dst_name == f.tensor and f.offset in (-1, t.dst_view.offset):
                flip_first(x)
                self.fault = None
                return
