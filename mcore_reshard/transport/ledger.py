"""The checksum ledger of one refit on one rank (``verify=True`` on every rank).

The sender hashes each transfer's bytes (``checksum.py``: xxh3 on CPU, integer sums on GPU)
right after packing them (or, zero-copy, in the source tensor) and, after the last bucket, sends
the rows to the peer as one ``(n, 2)`` int64 tensor; the receiver hashes what the destination
tensor holds at the box right after the transport wrote it (into what ``Sink.resolve`` gave: before vLLM
repacks a completed layer; a sink with neither is checked on ``read`` or, last, on the received
bytes) and raises naming every mismatching parameter. So a checksum proves source tensor ==
destination tensor, not only that a buffer arrived.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch

from .views import local_view
from ..plan.types import Transfer
from .channels import ChannelKey, GroupChannel, MsgKey, Route, Spec
from .checksum import _sums, digest, digest_at, digest_bytes
from .group import RefitError
from .stats import Tally

__all__ = ["ChecksumLedger", "as_dtype", "box_hasher", "digest_written", "rows"]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def box_hasher(device: torch.device, dtype: torch.dtype) -> Callable[[torch.Tensor], Any]:
    """The hash of one box in wire units. CPU: xxh3 of the bytes (memory speed); GPU: integer
    sums on the device (``checksum.py``)."""
    if device.type == "cpu":
        return lambda x: digest(as_dtype(x, dtype))
    return lambda x: _sums(as_dtype(x, dtype))


def rows(sums: list[Any]) -> torch.Tensor:
    """Per-box checksum rows (``digest`` tuples or ``_sums`` tensors) as one (n, 2) tensor."""
    if not sums:
        return torch.empty((0, 2), dtype=torch.int64)
    if isinstance(sums[0], torch.Tensor):
        return torch.stack(sums)
    return torch.tensor(sums, dtype=torch.int64)


def digest_written(x: Any) -> tuple[int, int]:
    """``digest`` of what ``unpack`` wrote: a view, or (address, nbytes) of a ``memmove``d box."""
    return digest_at(x) if isinstance(x, tuple) else digest(x)


def _bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes as a numpy uint8 array (slices of it are hashed without a tensor
    each); None on a device (its boxes are hashed with torch ops there)."""
    if t.device.type != "cpu":
        return None
    return t.view(torch.uint8).numpy() if t.numel() else memoryview(b"")


class ChecksumLedger:
    """Expected rows (sender: per message, per bucket) and actual rows (receiver: per channel,
    per bucket), their exchange after the last bucket and the comparison."""

    def __init__(self, box_sum: Callable[[torch.Tensor], Any], itemsize: int, tally: Tally) -> None:
        self.box_sum, self.itemsize, self.tally = box_sum, itemsize, tally
        self.expected: dict[MsgKey, list[torch.Tensor]] = {}  # message key -> per-bucket (n, 2) sums
        self.pending: list[tuple[MsgKey, list[Any]]] = []  # packed bucket: (key, rows or Transfer)
        self.actual: dict[ChannelKey, list[torch.Tensor]] = {}  # channel -> per-bucket (n, 2) sums

    def packed(self, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, direct: set[int]) -> None:
        """Hash a message just packed: one byte view of it, each box's hash a slice of it (no
        tensor per box). Zero-copy boxes are hashed in the source once posted (``posted``)."""
        raw, itemsize, box_sum = _bytes(msg), self.itemsize, self.box_sum
        sums: list[Any] = []
        off = 0
        for t in ts:
            if id(t) in direct:
                sums.append(t)
                continue
            nb = t.box.numel * itemsize
            sums.append(digest_bytes(raw[off : off + nb]) if raw is not None else
                        box_sum(msg[off // itemsize : (off + nb) // itemsize]))
            off += nb
        self.pending.append((key, sums))

    def posted(self, src_tensors: Mapping[str, torch.Tensor]) -> None:
        """The expected rows of the bucket just posted: zero-copy boxes are hashed in the
        source tensor now, while their sends are on the wire, not before posting them."""
        t0 = time.perf_counter()
        for key, sums in self.pending:
            self.expected.setdefault(key, []).append(rows([
                self.box_sum(local_view(src_tensors[x.src_name], x.src_view)) if isinstance(x, Transfer) else x
                for x in sums]))
        self.pending = []
        self.tally.timed("verify", t0)

    def received(self, channel: ChannelKey, sums: list[Any]) -> None:
        """The rows of what the destination holds after one bucket of ``channel``."""
        self.actual.setdefault(channel, []).append(rows(sums))

    def exchange(self, wire: GroupChannel, recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]],
                 device: torch.device, timeout_s: float) -> None:
        """Senders ship expected sums per peer (and to the peer's relay group, whose members
        got the same messages forwarded); receivers compare and name every mismatch."""
        t0 = time.perf_counter()
        route, B = wire.route, wire.route.num_buckets
        expected = {p: torch.cat(v).to(device) for p, v in self.expected.items()}
        ops = wire.post_all(B, self._specs(route, recv_b, expected, device))
        deadline = time.perf_counter() + timeout_s
        got: dict[ChannelKey, torch.Tensor] = {}
        for op in ops:
            wire.wait(B, op, deadline)
            if op.side == "src":
                got[op.peer] = op.tensor.cpu()
        for channel in self.actual:
            if route.is_me("src", channel[0]):
                got[channel] = expected[(channel[1], channel[2])].cpu()
        self.tally.timed("verify", t0)
        self._compare(route, recv_b, got)

    def _specs(self, route: Route, recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]],
               expected: dict[MsgKey, torch.Tensor], device: torch.device) -> list[Spec]:
        B, gr = route.num_buckets, route.rank_map.group_rank
        specs: list[Spec] = []
        for channel in sorted(self.actual):
            src, via, g = channel
            if route.is_me("src", src):
                continue  # my own expected rows
            n = sum(len(ts) for b in recv_b for c, ts in b.items() if c == channel)
            specs.append(("src", channel, torch.empty((n, 2), dtype=torch.int64, device=device),
                          gr("src", src), route.tag(B, g, via if g >= 0 else None)))
        for (peer, g), t in sorted(expected.items()):
            for m in (route.groups[g] if g >= 0 else (peer,)):  # relayed: every member checks
                if not route.is_me("dst", m):
                    specs.append(("dst", m, t, gr("dst", m), route.tag(B, g, peer if g >= 0 else None)))
        return specs

    def _compare(self, route: Route, recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]],
                 got: dict[ChannelKey, torch.Tensor]) -> None:
        bad: list[Transfer] = []
        for channel in sorted(self.actual):
            actual = torch.cat(self.actual[channel]).cpu()
            ts = [t for b in recv_b for c, tl in b.items() if c == channel for t in tl]
            diff = (actual != got[channel]).any(dim=1).nonzero().flatten().tolist()
            bad += [ts[i] for i in diff]
        if bad:
            # One line (it travels in votes and error summaries), naming each parameter.
            rm = route.rank_map
            lines = [f"{t.dst_name} ({t.canonical} box offsets={t.box.offsets} sizes={t.box.sizes}) "
                     f"from {rm.name('src', t.src)} to {rm.name('dst', t.dst)}, "
                     f"bucket {t.bucket}" for t in bad[:5]]
            more = f"; ... and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise RefitError(f"checksum mismatch in {len(bad)} transfer(s): " + "; ".join(lines) + more)
