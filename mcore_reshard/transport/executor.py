"""Execute one rank's part of a plan over a ``RefitGroup``: bucketed point-to-point messages.

This module is the orchestrator; each concern lives in a part of its own:

* ``schedule.py`` -- the bucket schedule: two buffers of each kind, two buckets in flight, the
  order of a round (pack k+1 while k is on the wire; deliver k while k+1 is).
* ``channels.py`` -- how each message travels: over the group, through shared memory (a
  same-device peer), in process (to myself) or zero-copy (large contiguous boxes); tags come
  from ``plan/tags.py``, the one tag space the planner asks too.
* ``relay.py`` -- fan-out relays: forwarding what a relay group's member received.
* ``deliver.py`` and ``sink.py`` -- handing boxes to the destination's ``Sink`` through its
  two calls (``resolve``, ``commit_box``; ``baseline`` for deltas): one path for every box.
* ``ledger.py`` -- the checksums that prove source tensor == destination tensor.
* ``reinterpret.py`` -- tensors the plan carries as their bits, seen in wire units.
* ``delta.py`` -- delta refits: each message encoded against what the receiver holds
  (headers ahead of the data; a changed box written as its baseline plus the changes).
* ``injection.py`` -- fault injection, which only tests and soak runs set.

Every wait has a timeout and failures name the peer and the bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Mapping, Sequence

import torch

from ..errors import RefitAborted
from ..layout.descriptor import LocalParam
from .views import TORCH_DTYPES, local_view, zero_padding
from ..plan.types import RankPlan
from ..wire.protocol import VerifyMode
from .channels import BucketPosts, Channel, GroupChannel, LocalChannel, Op, Route, ShmChannel, ZeroCopyChannel
from .dataplane import error_class
from .deliver import Delivery
from .delta import DeltaDecoder, DeltaEncoder, DeltaRun, HeaderExchange
from ..wire.faults import Fault
from .injection import corrupt
from .group import RankMap, RefitGroup
from .ledger import ChecksumLedger, box_hasher
from .packing import message_numel, pack
from .quantize import QuantizedSources
from .reinterpret import ReinterpretSink, WireTensors
from .scale import ScaledSources
from .relay import RelayForwarder
from .schedule import BufferSizes, run_rounds
from .sink import Sink, TensorSink, as_sink, sink_dtypes
from .stats import Tally, TransferStats

# ``Fault``, the sinks, ``WireTensors`` and ``TransferStats`` live in their own modules; they are
# re-exported here because callers (tests, ``scripts/soak.py``) import them from this one.
__all__ = [
    "Fault",
    "ReinterpretSink",
    "Sink",
    "TensorSink",
    "TransferOptions",
    "TransferStats",
    "WireTensors",
    "execute_plan",
    "raw_send_bandwidth",
    "zero_fill_padding",
]


def zero_fill_padding(tensors: Mapping[str, torch.Tensor], params: Sequence[LocalParam]) -> None:
    """Zero every element of ``params``' local tensors that no piece covers (e.g. vLLM's pad
    rows): the plan never sends padding, the receiver fills it itself."""
    for p in params:
        zero_padding(tensors[p.name], p)


@dataclass(frozen=True)
class TransferOptions:
    """How one rank runs its part of a plan: everything ``execute_plan`` takes besides the
    plan slices, the tensors, the sink and the group.

    ``timeout_s``: one deadline per wait. ``verify``: a ``VerifyMode`` (``checksum`` and
    ``full`` both run the exact checksums here; ``full``'s element-wise comparison is the
    driver's, ``verify.py``); a bool means on/off. ``progress``: a progress bar on this rank
    once the refit has run for a second. ``fault``: fault injection (tests and soak runs
    only). ``delta``: this rank's part of delta refits (``delta.py``; the endpoint agreed on it
    with every rank): encode against the baselines when the decision is on, and (sender) keep
    what was sent as the next baseline once this rank's part succeeded. ``begin``: this call
    starts a new refit on the group (an endpoint that already did passes False).
    ``plan_digest``: when given, every rank's (digest, verify) must agree before a byte moves.
    ``wire_dtype``: the element type on the wire (default: the plan's). ``rank_map``: the
    group's ranks by role (default: the group's own)."""

    timeout_s: float
    verify: VerifyMode | bool = VerifyMode.CHECKSUM
    progress: bool = False
    fault: Fault | None = None
    delta: DeltaRun | None = None
    begin: bool = True
    plan_digest: str | None = None
    wire_dtype: torch.dtype | None = None
    rank_map: RankMap | None = None


def execute_plan(
    plan_slice_src: RankPlan | None,
    plan_slice_dst: RankPlan | None,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors_or_sink: Mapping[str, torch.Tensor] | Sink | None,
    group: RefitGroup,
    options: TransferOptions,
) -> TransferStats:
    """Run this group rank's sends (``plan_slice_src``) and receives (``plan_slice_dst``) of
    one refit, as ``options`` say (:class:`TransferOptions`).

    Raises ``RefitTimeout``/``RefitError`` naming the peer and bucket (and posts the group's
    abort signal, so every other rank stops too); the group is then broken.
    """
    o, delta = options, options.delta
    t_start = time.perf_counter()
    mode = o.verify if isinstance(o.verify, VerifyMode) else (VerifyMode.CHECKSUM if o.verify else VerifyMode.OFF)
    rank_map = o.rank_map or group.rank_map
    if o.begin:
        group.control.begin_refit()
    _check_roles(plan_slice_src, plan_slice_dst, group.rank, rank_map)
    if o.plan_digest is not None:
        group.control.check_agreement([o.plan_digest, mode.value], what="(plan digest, verify)", timeout_s=o.timeout_s)
    sink = as_sink(dst_tensors_or_sink) if plan_slice_dst is not None else None
    dtype = o.wire_dtype or _wire_dtype(plan_slice_src, plan_slice_dst, src_tensors, sink)
    quantized = None
    if plan_slice_src is not None and plan_slice_src.quantize:  # block FP8 at the sender: codes + scales
        src_tensors = quantized = QuantizedSources(src_tensors, plan_slice_src.quantize)
    if plan_slice_src is not None and plan_slice_src.scale:  # a LoRA B the engine holds scaled
        src_tensors = ScaledSources(src_tensors, dict(plan_slice_src.scale), dtype)
    if plan_slice_src is not None and plan_slice_src.reinterpret:
        src_tensors = WireTensors(src_tensors, dict(plan_slice_src.reinterpret), dtype)
    if sink is not None and plan_slice_dst.reinterpret:
        sink = ReinterpretSink(sink, dict(plan_slice_dst.reinterpret), dtype)
    run = None
    try:
        run = _Run(plan_slice_src, plan_slice_dst, src_tensors, sink, group, rank_map, dtype, o.timeout_s,
                   mode.checksums, o.fault, delta)
        run.execute(o.progress)
        if delta is not None:
            _keep_baseline(delta, plan_slice_src, src_tensors, dtype, run.tally)
    except RefitAborted:
        if run is not None:
            run.close(failed=True)
        raise
    except BaseException as exc:
        # Every other rank of the refit stops at this signal instead of its own timeout.
        group.control.post_abort(f"{rank_map.name_at(group.rank)}: {type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        if run is not None:
            run.close(failed=True)
        raise
    run.close(failed=False)
    stats = run.tally.report(run.num_buckets, time.perf_counter() - t_start, run.verified)
    if quantized is not None:  # the codes and scales are held for the whole refit
        stats = replace(stats, quantize_s=quantized.seconds, peak_extra_bytes=stats.peak_extra_bytes + quantized.nbytes)
    if delta is not None:
        stats = replace(stats, delta=replace(stats.delta, on=delta.decision.on, state_bytes=delta.state.nbytes,
                                             reason=delta.decision.reason or delta.state.note))
    return stats


def _keep_baseline(delta: DeltaRun, src: RankPlan | None, src_tensors: Mapping[str, torch.Tensor],
                   dtype: torch.dtype, tally: Tally) -> None:
    """This rank's part succeeded: a sender keeps what it sent as its next baseline (the
    commit makes it the version every rank holds, ``DeltaState.settle``)."""
    t0 = time.perf_counter()
    if src is not None and not delta.decision.on:  # a delta updated the baseline as it encoded
        delta.state.keep_sent(src, src_tensors, dtype, delta.limit_bytes)
    delta.state.finished(None if delta.state.note else delta.decision.refit_id)  # note: over the limit
    tally.timed("pack", t0)


def _check_roles(src: RankPlan | None, dst: RankPlan | None, me: int, rank_map: RankMap) -> None:
    for plan, side in ((src, "src"), (dst, "dst")):
        if plan is None:
            continue
        if plan.side != side:
            raise ValueError(f"expected a {side!r} plan slice, got side {plan.side!r}")
        if rank_map.group_rank(side, plan.rank) != me:
            raise ValueError(f"{rank_map.name(side, plan.rank)} is not this process (group rank {me})")
    if src is not None and dst is not None and src.num_buckets != dst.num_buckets:
        raise ValueError(f"plan slices of different plans: {src.num_buckets} vs {dst.num_buckets} buckets")


def _wire_dtype(src: RankPlan | None, dst: RankPlan | None, src_tensors: Mapping[str, torch.Tensor],
                sink: Sink | None) -> torch.dtype:
    """The plan's element type (the destination's; sources cast while packing). Slices built
    by hand without one fall back to what this rank can see."""
    plan_slice = dst if dst is not None else src
    if plan_slice is not None and plan_slice.dtype in TORCH_DTYPES and plan_slice.transfers:
        return TORCH_DTYPES[plan_slice.dtype]
    if dst is not None and dst.transfers:
        bits = dict(dst.reinterpret)  # carried as wire elements: not this rank's wire dtype
        ts = [t for t in dst.transfers if t.dst_name not in bits] or dst.transfers
        dtypes = sink_dtypes(sink, [t.dst_name for t in ts])
    elif src is not None and src.transfers:
        bits = dict(src.reinterpret)
        dtypes = {src_tensors[t.src_name].dtype for t in src.transfers if t.src_name not in bits} or \
            {src_tensors[t.src_name].dtype for t in src.transfers}
    else:
        return torch.float32  # nothing moves on this rank
    if len(dtypes) != 1:
        raise ValueError(f"one refit carries one element type; this rank's tensors have {sorted(map(str, dtypes))}")
    return dtypes.pop()


class _Run:
    """One refit on one rank: its parts (channels, buffers, ledger, delivery, relays), run in
    the rounds of ``schedule.run_rounds`` (this class is its ``Rounds``)."""

    def __init__(self, src: RankPlan | None, dst: RankPlan | None, src_tensors: Mapping[str, torch.Tensor],
                 sink: Sink | None, group: RefitGroup, rank_map: RankMap, dtype: torch.dtype, timeout_s: float,
                 verify: bool, fault: Fault | None = None, delta: DeltaRun | None = None) -> None:
        self.group, self.dtype, self.itemsize = group, dtype, dtype.itemsize
        self.src_tensors, self.timeout_s, self.verify = src_tensors, timeout_s, verify
        #: Fault injection: set only by tests and soak runs.
        self.fault: Fault | None = fault
        self.route = route = Route.of(src, dst, group.rank, rank_map, group.device.type == "cpu")
        self.num_buckets = route.num_buckets
        # Sends by message (destination rank, relay group); receives by channel (source rank,
        # via, relay group): see ``channels.ChannelKey``.
        self.send_b = src.messages() if src is not None else [{} for _ in range(self.num_buckets)]
        self.recv_b = dst.channels() if dst is not None else [{} for _ in range(self.num_buckets)]
        self.tally = Tally()
        self.tally.bytes_full = self.itemsize * sum(
            message_numel(ts) for b in self.recv_b for c, ts in b.items() if not route.local(c))
        self.verified = False
        self.bar: Any = None
        on = delta is not None and delta.decision.on
        self.zero_copy = ZeroCopyChannel(route, self.send_b, self.recv_b, src_tensors, sink, dtype, group.device,
                                         self.tally, enabled=not on)
        self.wire = GroupChannel(group, route, timeout_s, self.zero_copy)
        # A delta refit (``delta.py``): messages encoded against the baselines, sized by headers.
        self.encoder = DeltaEncoder(delta.state, src, dtype, self.tally) if on and src is not None else None
        self.headers = HeaderExchange(self.wire, route, self.recv_b, self.itemsize, self.tally) if on else None
        self.decoder = None
        if on and sink is not None:
            self.wire.numel = self.headers.numel
            self.decoder = DeltaDecoder(sink, self.headers, dtype, group.device, self.tally)
        self.local = LocalChannel(route)
        self.shm = ShmChannel(group, route, self.wire, self.recv_b, dtype)
        self.relay = RelayForwarder(self.wire, self.shm, self.local)
        box_sum = box_hasher(group.device, dtype)
        self.ledger = ChecksumLedger(box_sum, self.itemsize, self.tally)
        self.delivery = None if sink is None else Delivery(
            sink, verify, box_sum, self.zero_copy.direct, self.zero_copy.landed, self.zero_copy.temps, self.ledger,
            self.tally, fault)
        self._allocate()

    def _allocate(self) -> None:
        """The wire buffers (``schedule.BufferSizes``); the send buffers are a shared segment
        when a same-device peer reads them."""
        route = self.route
        sizes = BufferSizes.of(self.send_b, self.recv_b, self.zero_copy.packed_numel,
                               lambda c: not route.local(c) and not route.shm(c))
        if any(p in route.shm_dst for b in self.send_b for p, _ in b):
            self.send_bufs = self.shm.send_buffers(sizes.n_send, sizes.send_numel)
        else:
            self.send_bufs = [self.group.buffer(f"send{i}", sizes.send_numel, self.dtype) for i in range(sizes.n_send)]
        self.recv_bufs = [self.group.buffer(f"recv{i}", sizes.recv_numel, self.dtype) for i in range(sizes.n_recv)]
        self.tally.buffer_bytes = self.tally.extra_bytes = sizes.nbytes(self.itemsize)

    def _recv_channels(self, channel: tuple[int, int, int]) -> tuple[Channel, ...]:
        if self.route.local(channel):
            return (self.local,)
        if self.route.shm(channel):
            return (self.shm,)
        return (self.wire, self.zero_copy)

    def _send_channels(self, peer: int) -> tuple[Channel, ...]:
        if self.route.is_me("dst", peer):
            return (self.local,)
        if peer in self.route.shm_dst:
            return (self.shm,)
        return (self.wire, self.zero_copy)

    def close(self, failed: bool) -> None:
        """Remove shared segments (``ShmChannel.close``); drop the buffers."""
        self.shm.close(failed)
        self.send_bufs = []

    def execute(self, progress: bool) -> None:
        total = sum(message_numel(ts) for b in self.send_b + self.recv_b for ts in b.values())
        self.bar = _progress_bar(progress, total * self.itemsize)
        try:
            self.group.connect(self.route.peers(self.send_b, self.recv_b), self.timeout_s)
            run_rounds(self.num_buckets, self)
            for ops in self.shm.pending():  # every receiver is done with my segment, and I with theirs
                self._wait(self.num_buckets, ops)
            if self.verify:
                self.ledger.exchange(self.wire, self.recv_b, self.group.device, self.timeout_s)
                self.verified = True
        finally:
            if self.bar is not None:
                self.bar.close()

    # -- the steps of a round (``schedule.Rounds``) ---------------------------------------------

    def pack(self, k: int) -> dict[tuple[int, int], torch.Tensor]:
        """Pack bucket ``k`` into send buffer ``k % 2``: message key -> message (a slice of it)."""
        peers = self.send_b[k]
        if not peers:
            return {}
        i = k % len(self.send_bufs)
        acks = self.shm.reuse(i)  # same-device receivers still reading this buffer's last bucket
        if acks:
            self._wait(k, acks)
        buf = self.send_bufs[i] if self.send_bufs else None
        direct, phase, verify = self.zero_copy.direct, self.tally.phase, self.verify
        out, pos = {}, 0
        encoder = self.encoder
        flip = self.fault is not None and self.fault.kind == "bitflip" and not self.fault.tensor and \
            self.fault.bucket == k
        for key, ts in peers.items():
            t0 = time.perf_counter()
            if encoder is not None:
                msg = encoder.encode(key, ts, self.src_tensors, buf[pos:], dense_first=flip and not out)
            else:
                msg = pack([t for t in ts if id(t) not in direct], self.src_tensors, buf[pos:])
            t1 = time.perf_counter()
            phase["pack"] += t1 - t0
            if verify:  # a delta's boxes are hashed whole, in the source (as zero-copy ones)
                self.ledger.packed(key, ts, msg, direct if encoder is None else {id(t) for t in ts})
                phase["verify"] += time.perf_counter() - t1
            out[key] = msg
            pos += msg.numel()
        if self.fault is not None:
            corrupt(self.fault, k, out, lambda: self._copy_first(k, peers))
        return out

    def _copy_first(self, k: int, peers: Mapping[Any, list]) -> torch.Tensor:
        """A copy of bucket ``k``'s first box, sent in its place (``Fault.corrupt``)."""
        t = next(t for ts in peers.values() for t in ts)
        return self.zero_copy.temp(k, t, local_view(self.src_tensors[t.src_name], t.src_view).clone()).view(-1)

    def post(self, k: int, packed: dict[tuple[int, int], torch.Tensor]) -> list[Op]:
        """Post every receive and send of bucket ``k``, each through its channel (a delta
        refit first exchanges the bucket's headers, which size its messages)."""
        header_sends = []
        if self.headers is not None:
            header_sends = self.headers.post(k, self.encoder.take() if self.encoder is not None else {}, self._wait)
        posts = BucketPosts(k, self.recv_bufs)
        for channel, ts in self.recv_b[k].items():
            for ch in self._recv_channels(channel):
                ch.post_recv(k, channel, ts, posts)
        sends = self.send_b[k]
        for key, msg in packed.items():
            for ch in self._send_channels(key[0]):
                ch.post_send(k, key, sends[key], msg, posts)
        return header_sends + self.wire.post_all(k, posts.specs) + posts.ops

    def posted(self) -> None:
        self.ledger.posted(self.src_tensors)

    def land(self, k: int, ops: list[Op]) -> None:
        first, relayed = self.relay.split(ops)
        self._wait(k, first)
        self.relay.forward(k, ops)
        self._wait(k, relayed)

    def deliver(self, k: int, ops: list[Op]) -> None:
        msgs = {op.peer: self.shm.msgs.pop((k, op.peer), op.tensor) for op in ops if op.side in ("src", "shm_src")}
        msgs.update(self.local.take(k))
        if self.delivery is None:
            return
        if self.decoder is None:
            self.delivery.deliver(k, msgs, self.recv_b[k])
            return
        decoded = {c: self.decoder.decode(k, c, ts, msgs.get(c)) for c, ts in self.recv_b[k].items()}
        special = {i: change for _, s in decoded.values() for i, change in s.items()}
        self.delivery.deliver(k, {c: x for c, (x, _) in decoded.items()}, self.recv_b[k], special)
        for x, _ in decoded.values():
            self.decoder.release(x)
        self.headers.drop(k)

    def release(self, k: int) -> None:
        forwards = self.relay.take()
        if forwards:
            self._wait(k, forwards)  # before its receive buffer is reused
        self.zero_copy.drop(k)
        self.shm.consumed(k)
        if self.bar is not None:
            self.bar.update(sum(message_numel(ts) for b in (self.send_b[k], self.recv_b[k]) for ts in b.values())
                            * self.itemsize)

    def _wait(self, k: int, ops: list[Op]) -> None:
        """Wait for every op of bucket ``k``; all share one ``timeout_s`` deadline."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        for op in ops:
            self.wire.wait(k, op, deadline)
            if op.side == "ack":
                continue
            t = self.shm.attach(k, op.peer, op.tensor) if op.side == "shm_src" else op.tensor
            self.tally.count(op.side, t.numel() * t.element_size())
        self.tally.timed("wire", t0)


def _progress_bar(show: bool, total_bytes: int) -> Any:
    """A tqdm bar that appears only once the refit has run for a second."""
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total_bytes, desc="refit", unit="B", unit_scale=True, delay=1.0, leave=False)


def raw_send_bandwidth(group: RefitGroup, src_rank: int, dst_rank: int, nbytes: int, timeout_s: float) -> float | None:
    """Bytes/s of one ``nbytes`` message from group rank ``src_rank`` to ``dst_rank`` (the
    floor a refit of the same bytes is compared with). Call on both ranks; others get None.

    A 1-byte handshake first, so the clock starts when both ends are ready.
    """
    me = group.rank
    if me not in (src_rank, dst_rank):
        return None
    peer = dst_rank if me == src_rank else src_rank
    wait = timedelta(seconds=timeout_s)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    ping = torch.zeros(1, dtype=torch.uint8, device=group.device)
    try:
        # handshake: receiver says "ready"
        (group.recv(ping, peer, 0) if me == src_rank else group.send(ping, peer, 0)).wait(wait)
        t0 = time.perf_counter()
        (group.send(buf, peer, 1) if me == src_rank else group.recv(buf, peer, 1)).wait(wait)
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)
        dt = time.perf_counter() - t0
    except RuntimeError as e:
        cls = error_class(e)
        raise cls(f"raw bandwidth probe with {group.rank_map.name_at(peer)} failed: "
                  f"{str(e).splitlines()[0]}") from e
    return nbytes / dt if dt > 0 else float("inf")
