"""Hand a bucket's received boxes to the sink, and record the checksum of what it then holds.

How is decided once, from the sink's declared ``capabilities`` (``sink.py``):

* not verifying and no zero-copy box from that peer: the whole message is scattered at once
  (``bulk``) or written box by box;
* a ``bulk`` sink on CPU: one batched scatter, then each box hashed where it now lies;
* otherwise box by box: the sink writes (``write_hashed``) or was received into (``landed``) and
  hashes what the destination holds at the box, still in cache.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from .views import local_view
from ..plan.types import Transfer
from .channels import ChannelKey
from .checksum import digest
from .ledger import ChecksumLedger, digest_written
from .packing import unpack
from .sink import Sink
from .stats import Tally

__all__ = ["Delivery"]


class Delivery:
    """Delivers every bucket of one refit on a destination rank."""

    def __init__(self, sink: Sink, dtype: torch.dtype, device: torch.device, verify: bool,
                 box_sum: Callable[[torch.Tensor], Any], direct: set[int],
                 temps: Mapping[tuple[int, int], torch.Tensor], ledger: ChecksumLedger, tally: Tally) -> None:
        self.sink, self.caps, self.dtype, self.verify, self.box_sum = sink, sink.capabilities, dtype, verify, box_sum
        self.direct, self.temps, self.ledger, self.tally = direct, temps, ledger, tally
        # On CPU a bulk sink's boxes are scattered into its tensors at once, hashed there.
        self.bulk_cpu = self.caps.bulk and device.type == "cpu"
        self._last_sum = 0.0

    def deliver(self, k: int, msgs: Mapping[ChannelKey, torch.Tensor],
                bucket: Mapping[ChannelKey, list[Transfer]], special: Mapping[int, Any] | None = None) -> None:
        """Hand every box of bucket ``k`` to the sink (``msgs``: each channel's packed message),
        then checksum what it holds. ``special``: boxes of a delta refit that are not in the
        messages, by id: None -- unchanged, the sink keeps what it holds (``Sink.keep``);
        (positions, values) -- the sink patches what it holds (``Sink.patch``)."""
        in_place = special or {}
        for peer, ts in bucket.items():
            msg = msgs.get(peer)
            if not self.verify and not any(id(t) in self.direct for t in ts):
                t0 = time.perf_counter()
                self._write_boxes(ts, msg, in_place)
                self.tally.timed("unpack", t0)
            elif self.bulk_cpu:
                self._deliver_tensors(peer, ts, msg, in_place)
            else:
                self._deliver_boxes(k, peer, ts, msg, in_place)

    def _deliver_boxes(self, k: int, peer: ChannelKey, ts: list[Transfer], msg: torch.Tensor | None,
                       in_place: Mapping[int, Any]) -> None:
        """Box by box: the sink writes, then hashes what the destination holds at the box (still
        in cache); the hash's own time is split off by timing it separately."""
        sink, phase = self.sink, self.tally.phase
        hashed = sink.write_hashed if self.caps.write_hashed else None
        sums, pos = [], 0
        hash_fn = self._timed_sum if self.verify else None
        for t in ts:
            t0 = time.perf_counter()
            self._last_sum = 0.0
            if id(t) in in_place:
                row = self._keep_or_patch(t, in_place[id(t)], hash_fn)
            elif id(t) in self.direct:
                temp = self.temps.get((k, id(t)))
                if temp is None:  # landed in the sink's own tensor
                    row = sink.landed(t.dst_name, t.dst_view, hash_fn)
                elif hashed is not None and hash_fn is not None:
                    row = hashed(t.dst_name, t.dst_view, temp, hash_fn)
                else:
                    sink.write(t.dst_name, t.dst_view, temp)
                    row = hash_fn(temp) if hash_fn else None
            else:
                n = t.box.numel
                part = msg[pos : pos + n]
                pos += n
                if hashed is not None and hash_fn is not None:
                    row = hashed(t.dst_name, t.dst_view, part.view(t.dst_view.shape), hash_fn)
                else:
                    self._write_boxes((t,), part, {})
                    row = hash_fn(part) if hash_fn else None  # a sink that only writes: what it was given
            t1 = time.perf_counter()
            phase["unpack"] += t1 - t0 - self._last_sum
            phase["verify"] += self._last_sum
            sums.append(row)
        if self.verify:
            self.ledger.received(peer, sums)

    def _deliver_tensors(self, peer: ChannelKey, ts: list[Transfer], msg: torch.Tensor | None,
                         in_place: Mapping[int, Any]) -> None:
        """Into a bulk sink's tensors (CPU): the packed boxes in one batched copy, then each box
        hashed where it now lies (a kept or patched box lies in place)."""
        t0 = time.perf_counter()
        direct, tensors = self.direct, self.sink.tensors
        packed = [t for t in ts if id(t) not in direct and id(t) not in in_place]
        written = iter(unpack(packed, msg, tensors) if packed else ())
        for t in ts:
            if id(t) in in_place:
                self._keep_or_patch(t, in_place[id(t)], None)
        t1 = time.perf_counter()
        if self.verify:
            self.ledger.received(peer, [
                digest(local_view(tensors[t.dst_name], t.dst_view)) if id(t) in direct or id(t) in in_place
                else digest_written(next(written)) for t in ts])
        self.tally.phase["unpack"] += t1 - t0
        self.tally.phase["verify"] += time.perf_counter() - t1

    def _write_boxes(self, ts: Sequence[Transfer], msg: torch.Tensor, in_place: Mapping[int, Any]) -> None:
        if self.caps.bulk:  # a bulk sink's write() is a plain copy: scatter them all at once
            unpack([t for t in ts if id(t) not in in_place] if in_place else ts, msg, self.sink.tensors)
            for t in ts:
                if id(t) in in_place:
                    self._keep_or_patch(t, in_place[id(t)], None)
            return
        pos = 0
        for t in ts:
            if id(t) in in_place:
                self._keep_or_patch(t, in_place[id(t)], None)
                continue
            n = t.box.numel
            self.sink.write(t.dst_name, t.dst_view, msg[pos : pos + n].view(t.dst_view.shape))
            pos += n

    def _keep_or_patch(self, t: Transfer, change: Any, hash_fn: Callable | None) -> Any:
        """A delta's box that is not in the message: kept (``change`` None) or patched."""
        if change is None:
            return self.sink.keep(t.dst_name, t.dst_view, hash_fn)
        return self.sink.patch(t.dst_name, t.dst_view, change[0], change[1], hash_fn)

    def _timed_sum(self, x: torch.Tensor) -> Any:
        """``box_sum`` for a sink's ``write_hashed``/``landed``, remembering how long it took."""
        t0 = time.perf_counter()
        out = self.box_sum(x)
        self._last_sum = time.perf_counter() - t0
        return out
