"""Execute one rank's part of a plan over a ``RefitGroup``: bucketed point-to-point messages.

Per bucket (round) every sender packs its boxes for each peer back to back into one slice of a
preallocated send buffer and posts one send per peer; every receiver posts one receive per peer
into one preallocated receive buffer and, once they land, hands each box to a sink. Buffers
come in pairs: bucket k+1 is packed while bucket k is on the wire, and is on the wire while
bucket k is delivered (so the receiver's apply overlaps the transfer); at most two buckets are
in flight, hence a plan's bucket budget is half the memory a rank may spend. All sends and
receives of a bucket are posted before any wait, and every rank walks the buckets in the same
order, so the schedule cannot deadlock; every wait has a timeout and failures name the peer and
the bucket.

Zero-copy boxes: a box of at least ``DIRECT_MIN_BYTES`` that is contiguous in both local
tensors, between two ranks that talk over the group (not relayed, not through shared memory),
skips the buffers: the sender posts the source view itself and the receiver posts a receive
straight into the destination tensor (``Sink.target``: vLLM's staged or model-format tensor),
in the same bucket rounds. Both ends decide from the plan slice alone, so they agree.

Tags: data of bucket k uses tag k, the closing checksum message uses tag ``num_buckets``; a pair
exchanges at most one packed message per bucket, so tags are unique per (bucket, pair) within a
refit; zero-copy boxes have their own tags (``plan.tags.direct_tag``). Messages a group rank sends to
itself (colocated refits) are copied locally, never sent.

Same-device peers (``RankPlan.same_device``: a colocated trainer and vLLM worker in separate
processes) exchange no bytes over the group on CPU: the sender's buffers are then a
``/dev/shm`` segment (``shm.py``) that it packs into as usual, the receiver maps it and
unpacks in place; per message only a 4-int64 ready flag (bucket, offset, elements, nonce)
goes over the group, and a 1-int64 consumed flag comes back before the sender repacks that
buffer (waited just before, so no rank waits on a flag of the bucket it is in). On CUDA they
still take the group (CUDA IPC is not implemented here).

Verification (``verify=True`` on every rank): the sender hashes each transfer's bytes
(``checksum.py``: xxh3 on CPU, integer sums on GPU) right after packing them (or, zero-copy, in
the source tensor) and, after the last bucket, sends the rows to the peer as one ``(n, 2)``
int64 tensor; the receiver hashes what the destination tensor holds at the box right after the
sink wrote it (``write_hashed``/``landed``: before vLLM repacks a completed layer; a sink with
neither is checked on ``read`` or, last, on the received bytes) and raises naming every
mismatching parameter. So a checksum proves source tensor == destination tensor, not only that
a buffer arrived.

The wire dtype is the destination dtype (the planner's byte budget is in it); a source of
another dtype is cast while packing. Tensors the plan carries as their bits
(``RankPlan.reinterpret``, e.g. an fp32 router bias in a bf16 refit) are viewed as the wire
dtype on both ends (``WireTensors``, ``ReinterpretSink``): ``_Run`` only sees wire units, the
sink only real ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch

from ..layout.descriptor import LocalParam, View
from ..layout.torch_views import TORCH_DTYPES, local_view, zero_padding
from ..plan.tags import ack_tag, direct_tag, message_tag
from ..plan.types import PlanError, RankPlan, Transfer
from ..protocol import VerifyMode
from .checksum import _sums, digest, digest_at, digest_bytes
from ..errors import RefitAborted
from .group import RankMap, RefitError, RefitGroup, error_class
from .packing import message_numel, pack, unpack
from .shm import ShmSegment, new_nonce, segment_path

__all__ = [
    "Fault",
    "ReinterpretSink",
    "Sink",
    "TensorSink",
    "TransferStats",
    "WireTensors",
    "execute_plan",
    "raw_send_bandwidth",
    "zero_fill_padding",
]


class Sink(Protocol):
    """Receives every box a destination rank gets (e.g. ``VllmApplier``). ``write`` must copy
    ``tensor`` before returning: it is a slice of the receive buffer, reused next bucket.

    ``write_hashed(local_name, view, tensor, hash_fn)`` is optional: it writes, then returns
    ``hash_fn`` of what the destination now holds at ``view`` (before anything repacks it), so
    verification checks the parameter itself, not only the received bytes. ``read(local_name,
    view)`` is the older form of the same (read back after the write).

    ``target(local_name, view)`` and ``landed(local_name, view, hash_fn)`` are optional too:
    the tensor a large contiguous box is received into directly (zero-copy), and the call once
    its bytes are there (returns ``hash_fn`` of them, like ``write_hashed``). Without them such
    a box is received into a temporary and written."""

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None: ...


class TensorSink:
    """The default sink: writes into a mapping of contiguous local tensors."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        local_view(self.tensors[local_name], view).copy_(tensor)

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any:
        self.write(local_name, view, tensor)  # a subclass's write (tests corrupt there)
        return hash_fn(local_view(self.tensors[local_name], view)) if hash_fn is not None else None

    def read(self, local_name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[local_name], view)

    def target(self, local_name: str, view: View) -> torch.Tensor:
        return local_view(self.tensors[local_name], view)

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        return hash_fn(local_view(self.tensors[local_name], view)) if hash_fn is not None else None


class _CallableSink:
    def __init__(self, fn: Callable[[str, View, torch.Tensor], None]) -> None:
        self.write = fn


@dataclass(frozen=True)
class Fault:
    """Fault injection (tests, ``scripts/soak.py``; only the testing path sets one).

    ``bitflip`` flips the lowest bit of the first element a sender packs for bucket
    ``bucket``, after its checksum was taken -- a corrupted wire, which the destination's
    checksums must catch. ``exit`` ends the rank's process abruptly at protocol step ``at``;
    ``sleep`` stalls it there for ``seconds``. Steps (``transport/endpoint.py``):
    ``before_vote`` (after its last byte), ``after_vote`` (before the decision is known),
    ``after_decision`` (the decision read, before this rank commits). An ``exit`` with
    ``seconds`` waits that long first (so its peers get that far too)."""

    kind: str = "bitflip"
    bucket: int = 0
    at: str = ""
    seconds: float = 0.0

    STEPS = ("before_vote", "after_vote", "after_decision")

    def __post_init__(self) -> None:
        if self.kind not in ("bitflip", "exit", "sleep"):
            raise ValueError(f"Fault.kind={self.kind!r} is not one of bitflip, exit, sleep")
        if self.kind != "bitflip" and self.at not in self.STEPS:
            raise ValueError(f"Fault.at={self.at!r} is not one of {list(self.STEPS)}")

    def hit(self, step: str) -> None:
        """Act if this fault is set for protocol step ``step``."""
        if self.kind == "bitflip" or self.at != step:
            return
        time.sleep(self.seconds)
        if self.kind == "exit":
            import os

            os._exit(23)

    def to_wire(self) -> dict:
        return {"kind": self.kind, "bucket": self.bucket, "at": self.at, "seconds": self.seconds}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "Fault":
        return Fault(str(d.get("kind", "bitflip")), int(d.get("bucket", 0)), str(d.get("at", "")),
                     float(d.get("seconds", 0.0)))


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

    def summary(self) -> str:
        gb = (self.bytes_sent + self.bytes_received) / 1e9
        return (
            f"{gb:.3f} GB in {self.messages} messages / {self.buckets} buckets, {self.seconds:.3f}s "
            f"(pack {self.pack_s:.3f}, wire {self.wire_s:.3f}, unpack {self.unpack_s:.3f}, "
            f"verify {self.verify_s:.3f}), buffers {self.peak_extra_bytes / 2**20:.1f} MiB, "
            f"verified={self.verified}"
        )


def zero_fill_padding(tensors: Mapping[str, torch.Tensor], params: Sequence[LocalParam]) -> None:
    """Zero every element of ``params``' local tensors that no piece covers (e.g. vLLM's pad
    rows): the plan never sends padding, the receiver fills it itself."""
    for p in params:
        zero_padding(tensors[p.name], p)


def execute_plan(
    plan_slice_src: RankPlan | None,
    plan_slice_dst: RankPlan | None,
    src_tensors: Mapping[str, torch.Tensor],
    dst_tensors_or_sink: Mapping[str, torch.Tensor] | Sink | Callable[[str, View, torch.Tensor], None] | None,
    group: RefitGroup,
    rank_map: RankMap | None = None,
    *,
    timeout_s: float,
    verify: VerifyMode | bool = VerifyMode.CHECKSUM,
    progress: bool = False,
    plan_digest: str | None = None,
    wire_dtype: torch.dtype | None = None,
    fault: "Fault | None" = None,
    begin: bool = True,
) -> TransferStats:
    """Run this group rank's sends (``plan_slice_src``) and receives (``plan_slice_dst``).

    ``verify``: a ``VerifyMode`` (``checksum`` and ``full`` both run the exact checksums here;
    ``full``'s element-wise comparison is the driver's, ``verify.py``); a bool means on/off.
    ``plan_digest``: when given, every rank's (digest, verify) must agree before a byte moves.
    ``progress``: show a progress bar on this rank if the refit runs longer than a second.
    ``fault``: fault injection for tests and soak runs (see :class:`Fault`).
    ``begin``: this call starts a new refit on the group (a caller that already did, e.g. an
    endpoint that checks its slice first, passes False).
    Raises ``RefitTimeout``/``RefitError`` naming the peer and bucket (and posts the group's
    abort signal, so every other rank stops too); the group is then broken.
    """
    t_start = time.perf_counter()
    mode = verify if isinstance(verify, VerifyMode) else (VerifyMode.CHECKSUM if verify else VerifyMode.OFF)
    verify = mode.checksums
    rank_map = rank_map or group.rank_map
    if begin:
        group.begin_refit()
    _check_roles(plan_slice_src, plan_slice_dst, group.rank, rank_map)
    if plan_digest is not None:
        group.check_agreement([plan_digest, mode.value], what="(plan digest, verify)", timeout_s=timeout_s)
    sink = _as_sink(dst_tensors_or_sink) if plan_slice_dst is not None else None
    dtype = wire_dtype or _wire_dtype(plan_slice_src, plan_slice_dst, src_tensors, dst_tensors_or_sink, sink)
    if plan_slice_src is not None and plan_slice_src.reinterpret:
        src_tensors = WireTensors(src_tensors, dict(plan_slice_src.reinterpret), dtype)
    if sink is not None and plan_slice_dst.reinterpret:
        sink = ReinterpretSink(sink, dict(plan_slice_dst.reinterpret), dtype)
    run = None
    try:
        run = _Run(plan_slice_src, plan_slice_dst, src_tensors, sink, group, rank_map, dtype, timeout_s, verify)
        run.fault = fault
        run.execute(progress)
    except RefitAborted:
        if run is not None:
            run.close(failed=True)
        raise
    except BaseException as exc:
        # Every other rank of the refit stops at this signal instead of its own timeout.
        group.post_abort(f"{rank_map.describe_group_rank(group.rank)}: {type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        if run is not None:
            run.close(failed=True)
        raise
    run.close(failed=False)
    p = run.phase
    return TransferStats(
        bytes_sent=run.bytes_sent,
        bytes_received=run.bytes_received,
        messages=run.messages,
        buckets=run.num_buckets,
        seconds=time.perf_counter() - t_start,
        pack_s=p["pack"],
        wire_s=p["wire"],
        unpack_s=p["unpack"],
        verify_s=p["verify"],
        peak_extra_bytes=run.extra_bytes,
        verified=run.verified,
        bytes_same_device=run.bytes_same_device,
        bytes_zero_copy=run.bytes_zero_copy,
    )


def _check_roles(src: RankPlan | None, dst: RankPlan | None, me: int, rank_map: RankMap) -> None:
    for plan, side in ((src, "src"), (dst, "dst")):
        if plan is None:
            continue
        if plan.side != side:
            raise ValueError(f"expected a {side!r} plan slice, got side {plan.side!r}")
        if rank_map.group_rank(side, plan.rank) != me:
            raise ValueError(f"{rank_map.describe(side, plan.rank)} is not this process (group rank {me})")
    if src is not None and dst is not None and src.num_buckets != dst.num_buckets:
        raise ValueError(f"plan slices of different plans: {src.num_buckets} vs {dst.num_buckets} buckets")


def _as_sink(dst: Any) -> Any:
    if isinstance(dst, Mapping):
        return TensorSink(dst)
    if hasattr(dst, "write"):
        return dst
    if callable(dst):
        return _CallableSink(dst)
    raise TypeError(f"destination must be a mapping of tensors, a sink with write(), or a callable; got {type(dst)}")


def _wire_dtype(src: RankPlan | None, dst: RankPlan | None, src_tensors: Mapping[str, torch.Tensor],
                dst_obj: Any, sink: Any) -> torch.dtype:
    """The plan's element type (the destination's; sources cast while packing). Slices built
    by hand without one fall back to what this rank can see."""
    plan_slice = dst if dst is not None else src
    if plan_slice is not None and plan_slice.dtype in TORCH_DTYPES and plan_slice.transfers:
        return TORCH_DTYPES[plan_slice.dtype]
    if dst is not None and dst.transfers:
        bits = dict(dst.reinterpret)  # carried as wire elements: not this rank's wire dtype
        ts = [t for t in dst.transfers if t.dst_name not in bits] or dst.transfers
        if isinstance(sink, TensorSink):
            dtypes = {sink.tensors[t.dst_name].dtype for t in ts}
        elif getattr(sink, "params", None) is not None:  # e.g. VllmApplier: name -> LocalParam
            dtypes = {TORCH_DTYPES[sink.params[t.dst_name].dtype] for t in ts}
        else:
            raise ValueError("cannot tell the wire dtype from this sink: pass wire_dtype=")
    elif src is not None and src.transfers:
        bits = dict(src.reinterpret)
        dtypes = {src_tensors[t.src_name].dtype for t in src.transfers if t.src_name not in bits} or \
            {src_tensors[t.src_name].dtype for t in src.transfers}
    else:
        return torch.float32  # nothing moves on this rank
    if len(dtypes) != 1:
        raise ValueError(f"one refit carries one element type; this rank's tensors have {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _real_view(view: View, r: int, name: str) -> View:
    """A view in wire units (``r`` wire elements per real one, last stride 1) in real units."""
    if view.offset % r or view.shape[-1] % r or any(st % r for st in view.stride[:-1]) or view.stride[-1] != 1:
        raise ValueError(f"{name}: box {view} does not hold whole elements of its own dtype")
    return View(view.offset // r, (*view.shape[:-1], view.shape[-1] // r), (*(st // r for st in view.stride[:-1]), 1))


class WireTensors(Mapping):
    """``tensors`` with the reinterpreted ones (name -> real dtype name) viewed as ``wire``:
    the same memory, so packing copies their bits and a write lands in the real tensor."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], real: Mapping[str, str], wire: torch.dtype) -> None:
        self.tensors, self.real, self.wire = tensors, real, wire

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        if name not in self.real:
            return t
        if t.dtype != TORCH_DTYPES[self.real[name]]:
            raise ValueError(f"{name} is {t.dtype}, the plan carries it as {self.real[name]} bits")
        return t.view(self.wire)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class ReinterpretSink:
    """A sink in wire units over ``inner`` (real units): a box of a reinterpreted tensor
    (name -> real dtype name), addressed in wire elements, is handed to ``inner`` as the same
    bytes in its real dtype at the real view; what ``inner`` holds is hashed as wire elements,
    so both ends hash the same bytes. Other names pass through. Only the optional methods
    ``inner`` has are offered."""

    def __init__(self, inner: Any, real: Mapping[str, str], wire: torch.dtype) -> None:
        self.inner, self.wire = inner, wire
        w = torch.empty((), dtype=wire).element_size()
        self.real = {n: (TORCH_DTYPES[d], TORCH_DTYPES[d].itemsize // w) for n, d in real.items()}
        for method in ("write_hashed", "read", "target", "landed"):
            if getattr(inner, method, None) is None:
                setattr(self, method, None)  # getattr(sink, method, None) is None, as for inner

    def _wire_hash(self, hash_fn: Callable | None) -> Callable | None:
        return None if hash_fn is None else (lambda x: hash_fn(x.view(self.wire)))

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.write(local_name, view, tensor)
        self.inner.write(local_name, _real_view(view, real[1], local_name), tensor.contiguous().view(real[0]))

    def write_hashed(self, local_name: str, view: View, tensor: torch.Tensor, hash_fn: Callable) -> Any:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.write_hashed(local_name, view, tensor, hash_fn)
        return self.inner.write_hashed(local_name, _real_view(view, real[1], local_name),
                                       tensor.contiguous().view(real[0]), self._wire_hash(hash_fn))

    def read(self, local_name: str, view: View) -> torch.Tensor:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.read(local_name, view)
        return self.inner.read(local_name, _real_view(view, real[1], local_name)).view(self.wire)

    def target(self, local_name: str, view: View) -> torch.Tensor | None:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.target(local_name, view)
        x = self.inner.target(local_name, _real_view(view, real[1], local_name))
        return None if x is None or x.dtype != real[0] else x.view(self.wire)

    def landed(self, local_name: str, view: View, hash_fn: Callable | None) -> Any:
        real = self.real.get(local_name)
        if real is None:
            return self.inner.landed(local_name, view, hash_fn)
        return self.inner.landed(local_name, _real_view(view, real[1], local_name), self._wire_hash(hash_fn))


# A posted op: (peer side "src" = receive from it | "dst" = send to it, peer rank, tensor, work);
# same-device messages: "shm_src" (tensor: the ready flag received) | "shm_dst" (the message).
_Op = tuple[str, int, torch.Tensor, Any]
#: Tags of the consumed flags: above the connect tag, one per bucket.


class _Run:
    """State of one refit on one rank (buffers, counters, collected checksums)."""

    def __init__(self, src: RankPlan | None, dst: RankPlan | None, src_tensors: Mapping[str, torch.Tensor],
                 sink: Any, group: RefitGroup, rank_map: RankMap, dtype: torch.dtype, timeout_s: float,
                 verify: bool) -> None:
        self.group, self.rank_map, self.dtype = group, rank_map, dtype
        self.src_tensors, self.sink, self.timeout_s, self.verify = src_tensors, sink, timeout_s, verify
        self.me = group.rank
        # CPU: xxh3 of the bytes (memory speed); GPU: integer sums on the device (checksum.py).
        cpu_sum = group.device.type == "cpu"
        self.box_sum: Callable[[torch.Tensor], Any] = (
            (lambda x: digest(_as_dtype(x, dtype))) if cpu_sum else (lambda x: _sums(_as_dtype(x, dtype))))
        self._last_sum = 0.0
        self.src_rank = src.rank if src is not None else None
        self.dst_rank = dst.rank if dst is not None else None
        self.num_buckets = (src or dst).num_buckets if (src or dst) is not None else 0
        # Sends by message (destination rank, relay group); receives by channel (source rank,
        # via, relay group): ``via`` is this rank, or -- with fan-out relays (``plan.topology``)
        # -- the member of the group that receives the message from the source and forwards it
        # to the others; the group is -1 for a message that is not relayed.
        self.send_b = src.messages() if src is not None else [{} for _ in range(self.num_buckets)]
        self.recv_b = dst.channels() if dst is not None else [{} for _ in range(self.num_buckets)]
        self.groups: tuple[tuple[int, ...], ...] = (src or dst).relay_groups if (src or dst) is not None else ()
        self.forwards: list[_Op] = []
        self.phase = {"pack": 0.0, "wire": 0.0, "unpack": 0.0, "verify": 0.0}
        self.bytes_sent = self.bytes_received = self.messages = 0
        self.verified = False
        self.expected: dict[tuple[int, int], list[torch.Tensor]] = {}  # message key -> per-bucket (n, 2) sums
        self.pending_sums: list[tuple[tuple[int, int], list[Any]]] = []  # packed bucket: (key, rows or Transfer)
        self.actual: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # channel -> per-bucket (n, 2) sums
        self.local_msgs: dict[tuple[int, tuple[int, int, int]], torch.Tensor] = {}  # (bucket, channel) -> to myself
        # Same-device peers in other processes (CPU only): shared memory instead of the group.
        cpu = group.device.type == "cpu"
        self.shm_dst = {d for d in (src.same_device if src is not None and cpu else ()) if not self._is_me("dst", d)}
        self.shm_src = {s for s in (dst.same_device if dst is not None and cpu else ()) if not self._is_me("src", s)}
        self.bytes_same_device = self.bytes_zero_copy = 0
        self.segment: ShmSegment | None = None  # mine (sender): the send buffers
        self.attached: dict[int, ShmSegment] = {}  # source rank -> its segment (receiver)
        self.nonce = 0
        self.acks: dict[int, list[_Op]] = {}  # send buffer -> consumed flags to wait for
        self.ack_sends: list[_Op] = []
        self.flags: list[torch.Tensor] = []  # ready flags in flight (kept alive until waited)
        self.shm_msgs: dict[tuple[int, tuple[int, int, int]], torch.Tensor] = {}  # (bucket, channel) -> message
        # Zero-copy boxes: sent from the parameter and received into the destination, no
        # buffer between (see ``_is_direct``); everything else is packed into messages.
        self.direct: set[int] = set()  # id() of this rank's direct transfers
        for b in self.send_b:
            for key, ts in b.items():
                if self._direct_peer_ok("dst", key):
                    self.direct.update(id(t) for t in ts if _is_direct(t, dtype.itemsize))
        for b in self.recv_b:
            for c, ts in b.items():
                if self._direct_peer_ok("src", c):
                    self.direct.update(id(t) for t in ts if _is_direct(t, dtype.itemsize))
        self.temps: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, id) -> landing / cast copy
        send_numel = max((sum(self._packed_numel(ts) for ts in b.values()) for b in self.send_b), default=0)
        recv_numel = max(
            (sum(self._packed_numel(ts) for c, ts in b.items() if not self._local(c) and not self._shm(c))
             for b in self.recv_b),
            default=0,
        )
        # Two of each: bucket k+1 is packed and on the wire while bucket k is delivered.
        n_send_bufs = min(2, sum(1 for b in self.send_b if b))
        n_recv_bufs = min(2, sum(1 for b in self.recv_b if any(not self._local(c) and not self._shm(c) for c in b)))
        self.itemsize = dtype.itemsize
        if any(p in self.shm_dst for b in self.send_b for p, _ in b):
            # The send buffers live in one shared segment: the same bytes as private ones.
            self.nonce = new_nonce()
            path = segment_path(group.derived_key("shm"), self.me, self.nonce)
            self.segment = ShmSegment.create(path, n_send_bufs * send_numel * self.itemsize)
            flat = self.segment.elements(dtype)
            self.send_bufs = [flat[i * send_numel : (i + 1) * send_numel] for i in range(n_send_bufs)]
        else:
            self.send_bufs = [group.buffer(f"send{i}", send_numel, dtype) for i in range(n_send_bufs)]
        self.recv_bufs = [group.buffer(f"recv{i}", recv_numel, dtype) for i in range(n_recv_bufs)]
        self.buffer_bytes = self.extra_bytes = (n_send_bufs * send_numel + n_recv_bufs * recv_numel) * self.itemsize
        self.temp_bytes = 0

    def _direct_peer_ok(self, side: str, key: Any) -> bool:
        """Zero-copy boxes only go over plain group messages: not to myself, not through shared
        memory, not relayed (members forward whole messages). Both ends decide from the plan
        alone, so they agree."""
        if side == "dst":
            peer, g = key
            return g < 0 and not self._is_me("dst", peer) and peer not in self.shm_dst
        return key[2] < 0 and key[1] == self.dst_rank and not self._local(key) and not self._shm(key)

    def _packed_numel(self, ts: Sequence[Transfer]) -> int:
        return sum(t.box.numel for t in ts if id(t) not in self.direct)

    def _shm(self, channel: tuple[int, int, int]) -> bool:
        """A message from a same-device source in another process (through shared memory)."""
        src, via, _ = channel
        return via == self.dst_rank and src in self.shm_src

    def close(self, failed: bool) -> None:
        """Remove this rank's segment (and, after a failure, any it mapped: its sender may be
        gone); drop the mappings."""
        if self.segment is not None:
            self.segment.unlink()
        if failed:
            for seg in self.attached.values():
                seg.unlink()
        self.segment, self.attached, self.shm_msgs, self.send_bufs = None, {}, {}, []

    def _is_me(self, side: str, rank: int) -> bool:
        return self.rank_map.group_rank(side, rank) == self.me

    def _local(self, channel: tuple[int, int, int]) -> bool:
        """A message from this process to itself (a colocated source and destination)."""
        src, via, _ = channel
        return via == self.dst_rank and self._is_me("src", src)

    def _recv_from(self, k: int, channel: tuple[int, int, int]) -> tuple[int, int]:
        """(group rank, tag) of the receive of ``channel`` in bucket ``k``."""
        src, via, g = channel
        if via == self.dst_rank:
            return self.rank_map.group_rank("src", src), self._tag(k, g)
        return self.rank_map.group_rank("dst", via), self._tag(k, g, forwarded_from=src)

    def _tag(self, k: int, g: int, forwarded_from: int | None = None) -> int:
        """Tag of a message in bucket ``k`` (``num_buckets``: its checksums) of relay group
        ``g`` (-1: none), sent by its source or (``forwarded_from`` = the source) forwarded."""
        try:
            return message_tag(self.num_buckets, len(self.groups), k, g, forwarded_from)
        except PlanError as e:
            raise RefitError(str(e)) from None

    def _ack_tag(self, k: int, g: int) -> int:
        """Tag of the consumed flag of a same-device message in bucket ``k`` of relay group ``g``."""
        return ack_tag(len(self.groups), k, g)

    def _timed_sum(self, x: torch.Tensor) -> Any:
        """``box_sum`` for a sink's ``write_hashed``, remembering how long it took."""
        t0 = time.perf_counter()
        out = self.box_sum(x)
        self._last_sum = time.perf_counter() - t0
        return out

    def _timed(self, name: str, t0: float) -> None:
        self.phase[name] += time.perf_counter() - t0

    # -- phases --------------------------------------------------------------------------

    def execute(self, progress: bool) -> None:
        total = sum(message_numel(ts) for b in self.send_b + self.recv_b for ts in b.values())
        bar = _progress_bar(progress, total * self.itemsize)
        try:
            peers = {self.rank_map.group_rank("dst", m) for b in self.send_b for p, g in b
                     for m in (self.groups[g] if g >= 0 else (p,))}  # relays: every member gets the checksums
            peers |= {self._recv_from(0, c)[0] for b in self.recv_b for c in b}
            peers |= {self.rank_map.group_rank("src", c[0]) for b in self.recv_b for c in b}  # checksums
            peers |= {self.rank_map.group_rank("dst", m) for b in self.recv_b for _, via, g in b
                      if via == self.dst_rank and g >= 0 for m in self.groups[g]}  # what I forward
            self.group.connect(peers, self.timeout_s)
            ops = self._post_bucket(0, self._pack(0)) if self.num_buckets else []
            self._finish_sums()
            for k in range(self.num_buckets):
                last = k + 1 == self.num_buckets
                nxt = {} if last else self._pack(k + 1)  # while bucket k is on the wire
                # Relayed messages come from a peer that forwards only once its own direct
                # ones arrived: wait for the direct ones and forward first.
                relayed = [op for op in ops if op[0] == "src" and op[1][1] != self.dst_rank]
                self._wait(k, [op for op in ops if not (op[0] == "src" and op[1][1] != self.dst_rank)])
                self._forward(k, ops)
                self._wait(k, relayed)
                nxt_ops = [] if last else self._post_bucket(k + 1, nxt)
                self._finish_sums()
                self._deliver(k, [op for op in ops if op[0] in ("src", "shm_src", "dsrc")])  # while k+1 is on the wire
                if self.forwards:
                    self._wait(k, self.forwards)  # before its receive buffer is reused
                    self.forwards = []
                self._drop_temps(k)
                self._consumed(k)
                ops = nxt_ops
                if bar is not None:
                    bar.update(sum(message_numel(ts) for b in (self.send_b[k], self.recv_b[k]) for ts in b.values())
                               * self.itemsize)
            for buf in list(self.acks):  # every receiver is done with my segment
                self._wait(self.num_buckets, self.acks.pop(buf))
            self._wait(self.num_buckets, self.ack_sends)
            self.ack_sends, self.flags = [], []
            if self.verify:
                self._exchange_checksums()
                self.verified = True
        finally:
            if bar is not None:
                bar.close()

    def _pack(self, k: int) -> dict[int, torch.Tensor]:
        """Pack bucket ``k`` into send buffer ``k % 2``: peer -> message (a slice of it)."""
        peers = self.send_b[k]
        if not peers:
            return {}
        i = k % len(self.send_bufs)
        if i in self.acks:  # same-device receivers still reading this buffer's last bucket
            self._wait(k, self.acks.pop(i))
        buf = self.send_bufs[i] if self.send_bufs else None
        out, pos = {}, 0
        for key, ts in peers.items():
            t0 = time.perf_counter()
            msg = pack([t for t in ts if id(t) not in self.direct], self.src_tensors, buf[pos:])
            t1 = time.perf_counter()
            self.phase["pack"] += t1 - t0
            if self.verify:
                # One byte view of the message; each box's hash is a slice of it (no tensor per
                # box). Zero-copy boxes are hashed in the parameter once their send is posted
                # (``_finish_sums``).
                raw = _bytes(msg)
                sums, off = [], 0
                for t in ts:
                    if id(t) in self.direct:
                        sums.append(t)
                        continue
                    nb = t.box.numel * self.itemsize
                    sums.append(digest_bytes(raw[off : off + nb]) if raw is not None else
                                self.box_sum(msg[off // self.itemsize : (off + nb) // self.itemsize]))
                    off += nb
                self.pending_sums.append((key, sums))
                self.phase["verify"] += time.perf_counter() - t1
            out[key] = msg
            pos += msg.numel()
        fault = getattr(self, "fault", None)
        if fault is not None and fault.kind == "bitflip" and fault.bucket == k and out:
            first = next((m for m in out.values() if m.numel()), None)
            if first is None:  # only zero-copy boxes: corrupt a copy of the first one
                t = next(t for ts in peers.values() for t in ts)
                first = self._temp(k, t, local_view(self.src_tensors[t.src_name], t.src_view).clone()).view(-1)
            bits = first[:1].view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[first.element_size()])
            bits ^= 1
        return out

    def _finish_sums(self) -> None:
        """The expected rows of the bucket just posted: zero-copy boxes are hashed in the
        source tensor now, while their sends are on the wire, not before posting them."""
        t0 = time.perf_counter()
        for key, sums in self.pending_sums:
            rows = [self.box_sum(local_view(self.src_tensors[x.src_name], x.src_view)) if isinstance(x, Transfer)
                    else x for x in sums]
            self.expected.setdefault(key, []).append(_rows(rows))
        self.pending_sums = []
        self._timed("verify", t0)

    def _post_bucket(self, k: int, packed: dict[int, torch.Tensor]) -> list[_Op]:
        """Post every receive and send of bucket ``k``; messages to myself go to ``local_msgs``."""
        specs, pos = [], 0
        shm_ops: list[_Op] = []
        for channel, ts in self.recv_b[k].items():
            if self._local(channel):
                continue
            if self._shm(channel):  # only the ready flag comes over the group
                flag = torch.empty(4, dtype=torch.int64)
                g, tag = self._recv_from(k, channel)
                shm_ops.append(("shm_src", channel, flag, self._post(k, "src", channel, flag, g, tag)))
                continue
            n = self._packed_numel(ts)
            g, tag = self._recv_from(k, channel)
            if n:
                specs.append(("src", channel, self.recv_bufs[k % len(self.recv_bufs)][pos : pos + n], g, tag))
            pos += n
            direct = [t for t in ts if id(t) in self.direct]
            for i, t in enumerate(direct):
                specs.append(("dsrc", (channel, t), self._landing(k, t), g, direct_tag(k, i)))
        for (peer, stream), msg in packed.items():
            if self._is_me("dst", peer):
                self.local_msgs[(k, (self.src_rank, peer, stream))] = msg
            elif peer in self.shm_dst:
                shm_ops.append(self._post_ready(k, peer, stream, msg))
            else:
                g = self.rank_map.group_rank("dst", peer)
                if msg.numel():
                    specs.append(("dst", peer, msg, g, self._tag(k, stream)))
                direct = [t for t in self.send_b[k][(peer, stream)] if id(t) in self.direct]
                for i, t in enumerate(direct):
                    specs.append(("ddst", peer, self._direct_source(k, t, i), g, direct_tag(k, i)))
        return self._post_all(k, specs) + shm_ops

    def _direct_source(self, k: int, t: Transfer, i: int) -> torch.Tensor:
        """What a zero-copy send posts: the source view itself (cast into a temporary when
        the wire dtype differs; a fault's corrupted copy for the first box)."""
        fake = self.temps.pop((k, id(t)), None)
        if fake is not None and i == 0:
            return fake.view(t.src_view.shape)
        x = local_view(self.src_tensors[t.src_name], t.src_view)
        if x.dtype != self.dtype:
            x = self._temp(k, t, x.to(self.dtype))
        return x

    def _landing(self, k: int, t: Transfer) -> torch.Tensor:
        """Where a zero-copy box is received: straight into the sink's tensor when it offers
        one (``target``), else into a temporary that ``_deliver`` writes through the sink."""
        target = getattr(self.sink, "target", None)
        x = target(t.dst_name, t.dst_view) if target is not None else None
        if x is None or x.dtype != self.dtype or x.device != self.group.device or not x.is_contiguous():
            x = self._temp(k, t, torch.empty(t.dst_view.shape, dtype=self.dtype, device=self.group.device))
        return x

    def _temp(self, k: int, t: Transfer, x: torch.Tensor) -> torch.Tensor:
        """Keep a zero-copy box's temporary until bucket ``k`` is done; count it as extra memory."""
        self.temps[(k, id(t))] = x
        self.temp_bytes += x.numel() * x.element_size()
        self.extra_bytes = max(self.extra_bytes, self.buffer_bytes + self.temp_bytes)
        return x

    def _drop_temps(self, k: int) -> None:
        for key in [key for key in self.temps if key[0] == k]:
            x = self.temps.pop(key)
            self.temp_bytes -= x.numel() * x.element_size()

    def _post_ready(self, k: int, peer: int, stream: int, msg: torch.Tensor) -> _Op:
        """Tell same-device ``peer`` where its bucket-``k`` message (of relay group ``stream``)
        lies in my segment, and post the receive of its consumed flag (waited before the
        buffer is packed again)."""
        g = self.rank_map.group_rank("dst", peer)
        base = self.segment.data.data_ptr()
        offset = (msg.data_ptr() - base) // self.itemsize
        flag = torch.tensor([k, offset, msg.numel(), self.nonce], dtype=torch.int64)
        self.flags.append(flag)
        ack = torch.empty(1, dtype=torch.int64)
        i = k % len(self.send_bufs)
        self.acks.setdefault(i, []).append(("ack", peer, ack, self._post(k, "dst", peer, ack, g, self._ack_tag(k, stream),
                                                                         recv=True)))
        return ("shm_dst", peer, msg, self._post(k, "dst", peer, flag, g, self._tag(k, stream)))

    def _consumed(self, k: int) -> None:
        """Bucket ``k`` is delivered (and forwarded): free each same-device sender's buffer."""
        for channel in self.recv_b[k]:
            if self._shm(channel):
                flag = torch.tensor([k], dtype=torch.int64)
                g = self.rank_map.group_rank("src", channel[0])
                self.ack_sends.append(("ack", channel, flag, self._post(k, "src", channel, flag, g,
                                                                        self._ack_tag(k, channel[2]), send=True)))

    def _forward(self, k: int, ops: list[_Op]) -> None:
        """Fan-out relay: pass every relayed message this rank received from a source in bucket
        ``k`` (over the group, through shared memory or from itself) on to the other members of
        its relay group (the same bytes: no packing); waited for after delivery, before the
        buffer is reused."""
        got = {channel: self.shm_msgs.get((k, channel), t) for side, channel, t, _ in ops
               if side in ("src", "shm_src") and channel[1] == self.dst_rank and channel[2] >= 0}
        got.update({c: m for (b, c), m in self.local_msgs.items() if b == k and c[2] >= 0})
        specs = [("dst", m, msg, self.rank_map.group_rank("dst", m), self._tag(k, g, forwarded_from=src))
                 for (src, _, g), msg in sorted(got.items()) for m in self.groups[g] if m != self.dst_rank]
        self.forwards = self._post_all(k, specs)

    def _post_all(self, k: int, specs: list[tuple[str, Any, torch.Tensor, int, int]]) -> list[_Op]:
        """Post ops ``(side, peer, tensor, group rank, tag)`` by peer group rank; within a pair
        the lower group rank sends first. Gloo does not care (every op is asynchronous); NCCL
        runs both directions of a pair on one stream, where recv-before-send on both ends
        would deadlock."""

        def key(spec: tuple[str, Any, torch.Tensor, int, int]) -> tuple[int, bool, int]:
            g = spec[3]
            sends_first = self.me < g
            return g, (spec[0] == "dst") != sends_first, spec[4]

        return [(side, peer, t, self._post(k, side, peer, t, g, tag))
                for side, peer, t, g, tag in sorted(specs, key=key)]

    def _post(self, k: int, side: str, peer: Any, t: torch.Tensor, g: int, tag: int, *,
              send: bool | None = None, recv: bool = False) -> Any:
        send = (side in ("dst", "ddst") and not recv) if send is None else send
        try:
            return self.group.send(t, g, tag) if send else self.group.recv(t, g, tag)
        except RuntimeError as e:
            raise self._error(k, side, peer, send, e) from e

    def _wait(self, k: int, ops: list[_Op]) -> None:
        """Wait for every op of bucket ``k``; all share one ``timeout_s`` deadline."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        for side, peer, t, work in ops:
            left = max(deadline - time.perf_counter(), 1e-3)
            try:
                self.group.wait_work(work, left)
            except RefitAborted:
                raise
            except RuntimeError as e:
                send = side in ("dst", "shm_dst", "ddst") or (side == "ack" and isinstance(peer, tuple))
                raise self._error(k, side, peer, send, e) from e
            if side == "ack":
                continue
            if side == "shm_src":
                t = self._attach(k, peer, t)
                self.bytes_same_device += t.numel() * t.element_size()
            elif side == "shm_dst":
                self.bytes_same_device += t.numel() * t.element_size()
            nbytes = t.numel() * t.element_size()
            if side in ("ddst", "dsrc"):
                self.bytes_zero_copy += nbytes
            if side in ("dst", "shm_dst", "ddst"):
                self.bytes_sent += nbytes
            else:
                self.bytes_received += nbytes
            self.messages += 1
        self._timed("wire", t0)

    def _attach(self, k: int, channel: tuple[int, int], flag: torch.Tensor) -> torch.Tensor:
        """The message a ready flag points at, inside the sender's segment (mapped once)."""
        src = channel[0]
        bucket, offset, numel, nonce = (int(v) for v in flag.tolist())
        want = message_numel(self.recv_b[k][channel])
        if bucket != k or numel != want or offset < 0:
            raise RefitError(f"{self.rank_map.describe_group_rank(self.me)}: bad ready flag from "
                             f"{self.rank_map.describe('src', src)} in bucket {k}: {flag.tolist()} "
                             f"(expected bucket {k}, {want} elements)")
        seg = self.attached.get(src)
        g = self.rank_map.group_rank("src", src)
        path = segment_path(self.group.derived_key("shm"), g, nonce)
        if seg is None or seg.path != path:
            seg = self.attached[src] = ShmSegment.attach(path)
        flat = seg.elements(self.dtype)
        if offset + numel > flat.numel():
            raise RefitError(f"ready flag from {self.rank_map.describe('src', src)} points past its segment")
        msg = flat[offset : offset + numel]
        self.shm_msgs[(k, channel)] = msg
        return msg

    def _error(self, k: int, side: str, peer: Any, send: bool, e: Exception) -> RefitError:
        what = "send to" if send else "receive from"
        bucket = f"bucket {k} of {self.num_buckets}" if k < self.num_buckets else "checksum message"
        me = self.rank_map.describe_group_rank(self.me)
        cls = error_class(e)
        side = {"shm_dst": "dst", "shm_src": "src", "ack": "dst", "ddst": "dst", "dsrc": "src"}.get(side, side)
        if isinstance(peer, tuple) and isinstance(peer[1], Transfer):  # a zero-copy box: its channel
            peer = peer[0]
        if isinstance(peer, tuple):  # a receive channel (source, via, relay group)
            src, via, _ = peer
            who = self.rank_map.describe("src", src) + (
                "" if via == self.dst_rank else f" relayed by {self.rank_map.describe('dst', via)}")
        else:
            who = self.rank_map.describe(side, peer)
        return cls(f"{me}: {what} {who} failed in {bucket} "
                   f"(timeout {self.timeout_s}s): {str(e).splitlines()[0] if str(e) else type(e).__name__}")

    def _deliver(self, k: int, recvs: list[_Op]) -> None:
        """Hand every box of bucket ``k`` to the sink, then checksum what it holds."""
        msgs = {channel: self.shm_msgs.pop((k, channel), slot) for side, channel, slot, _ in recvs if side != "dsrc"}
        for key in [key for key in self.local_msgs if key[0] == k]:
            msgs[key[1]] = self.local_msgs.pop(key)
        hashed = getattr(self.sink, "write_hashed", None)
        for peer, ts in self.recv_b[k].items():
            msg = msgs.get(peer)
            if not self.verify and not any(id(t) in self.direct for t in ts):
                t0 = time.perf_counter()
                if type(self.sink) is TensorSink:  # fast path; subclasses go through write()
                    unpack(ts, msg, self.sink.tensors)
                else:
                    self._write_boxes(ts, msg)
                self._timed("unpack", t0)
                continue
            if type(self.sink) is TensorSink and self.group.device.type == "cpu":
                self._deliver_tensors(k, peer, ts, msg)
                continue
            # Box by box: the sink writes, then hashes what the destination holds at the box
            # (still in cache); the hash's own time is split off by timing it separately.
            sums, pos = [], 0
            hash_fn = self._timed_sum if self.verify else None
            for t in ts:
                t0 = time.perf_counter()
                self._last_sum = 0.0
                if id(t) in self.direct:
                    temp = self.temps.get((k, id(t)))
                    if temp is None:  # landed in the sink's own tensor
                        row = self.sink.landed(t.dst_name, t.dst_view, hash_fn)
                    elif hashed is not None and hash_fn is not None:
                        row = hashed(t.dst_name, t.dst_view, temp, hash_fn)
                    else:
                        self.sink.write(t.dst_name, t.dst_view, temp)
                        row = hash_fn(temp) if hash_fn else None
                else:
                    n = t.box.numel
                    part = msg[pos : pos + n]
                    pos += n
                    if hashed is not None and hash_fn is not None:
                        row = hashed(t.dst_name, t.dst_view, part.view(t.dst_view.shape), hash_fn)
                    else:
                        self._write_boxes((t,), part)
                        row = hash_fn(self._written([t], part)[0]) if hash_fn else None
                t1 = time.perf_counter()
                self.phase["unpack"] += t1 - t0 - self._last_sum
                self.phase["verify"] += self._last_sum
                sums.append(row)
            if self.verify:
                self.actual.setdefault(peer, []).append(_rows(sums))

    def _deliver_tensors(self, k: int, peer: tuple[int, int, int], ts: list[Transfer], msg: torch.Tensor | None) -> None:
        """``_deliver`` into plain tensors (``TensorSink``, CPU): the packed boxes in one
        batched copy, then each box hashed where it now lies."""
        t0 = time.perf_counter()
        packed = [t for t in ts if id(t) not in self.direct]
        written = iter(unpack(packed, msg, self.sink.tensors) if packed else ())
        t1 = time.perf_counter()
        if self.verify:
            tensors = self.sink.tensors
            self.actual.setdefault(peer, []).append(_rows([
                digest(local_view(tensors[t.dst_name], t.dst_view)) if id(t) in self.direct else _digest_written(next(written))
                for t in ts]))
        self.phase["unpack"] += t1 - t0
        self.phase["verify"] += time.perf_counter() - t1

    def _write_boxes(self, ts: Sequence[Transfer], msg: torch.Tensor) -> None:
        if type(self.sink) is TensorSink:
            unpack(ts, msg, self.sink.tensors)
            return
        pos = 0
        for t in ts:
            n = t.box.numel
            self.sink.write(t.dst_name, t.dst_view, msg[pos : pos + n].view(t.dst_view.shape))
            pos += n

    def _written(self, ts: list[Transfer], msg: torch.Tensor) -> list[torch.Tensor]:
        read = getattr(self.sink, "read", None)
        if read is not None:
            return [_as_dtype(read(t.dst_name, t.dst_view), self.dtype) for t in ts]
        out, pos = [], 0
        for t in ts:
            out.append(msg[pos : pos + t.box.numel])
            pos += t.box.numel
        return out

    def _exchange_checksums(self) -> None:
        """Senders ship expected sums per peer (and to the peer's relay group, whose members
        got the same messages forwarded); receivers compare and name every mismatch."""
        t0 = time.perf_counter()
        B = self.num_buckets
        expected = {p: torch.cat(v).to(self.group.device) for p, v in self.expected.items()}
        specs = []
        for channel in sorted(self.actual):
            src, via, g = channel
            if self._is_me("src", src):
                continue  # my own expected rows
            n = sum(len(ts) for b in self.recv_b for c, ts in b.items() if c == channel)
            specs.append(("src", channel, torch.empty((n, 2), dtype=torch.int64, device=self.group.device),
                          self.rank_map.group_rank("src", src), self._tag(B, g, via if g >= 0 else None)))
        for (peer, g), t in sorted(expected.items()):
            for m in (self.groups[g] if g >= 0 else (peer,)):  # relayed: every member checks
                if not self._is_me("dst", m):
                    specs.append(("dst", m, t, self.rank_map.group_rank("dst", m), self._tag(B, g, peer if g >= 0 else None)))
        ops = self._post_all(B, specs)
        deadline = time.perf_counter() + self.timeout_s
        got: dict[tuple[int, int, int], torch.Tensor] = {}
        for side, peer, t, work in ops:
            try:
                self.group.wait_work(work, max(deadline - time.perf_counter(), 1e-3))
            except RefitAborted:
                raise
            except RuntimeError as e:
                raise self._error(B, side, peer, side == "dst", e) from e
            if side == "src":
                got[peer] = t.cpu()
        for channel in self.actual:
            if self._is_me("src", channel[0]):
                got[channel] = expected[(channel[1], channel[2])].cpu()
        self._timed("verify", t0)
        bad = []
        for channel in sorted(self.actual):
            actual = torch.cat(self.actual[channel]).cpu()
            ts = [t for b in self.recv_b for c, tl in b.items() if c == channel for t in tl]
            diff = (actual != got[channel]).any(dim=1).nonzero().flatten().tolist()
            bad += [ts[i] for i in diff]
        if bad:
            # One line (it travels in votes and error summaries), naming each parameter.
            lines = [f"{t.dst_name} ({t.canonical} box offsets={t.box.offsets} sizes={t.box.sizes}) "
                     f"from {self.rank_map.describe('src', t.src)} to {self.rank_map.describe('dst', t.dst)}, "
                     f"bucket {t.bucket}" for t in bad[:5]]
            more = f"; ... and {len(bad) - 5} more" if len(bad) > 5 else ""
            raise RefitError(f"checksum mismatch in {len(bad)} transfer(s): " + "; ".join(lines) + more)


def _digest_written(x: Any) -> tuple[int, int]:
    """``digest`` of what ``unpack`` wrote: a view, or (address, nbytes) of a ``memmove``d box."""
    return digest_at(x) if isinstance(x, tuple) else digest(x)


#: Boxes of at least this many bytes, contiguous in both local tensors, skip the buffers: sent
#: from the parameter and received straight into the destination (``Sink.target``). Smaller
#: ones are packed: one message per peer beats one message per box there.
DIRECT_MIN_BYTES = 256 << 10


def _is_direct(t: Transfer, itemsize: int) -> bool:
    return t.box.numel * itemsize >= DIRECT_MIN_BYTES and t.src_view.is_contiguous() and t.dst_view.is_contiguous()


def _bytes(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes as a numpy uint8 array (slices of it are hashed without a tensor
    each); None on a device (its boxes are hashed with torch ops there)."""
    if t.device.type != "cpu":
        return None
    return t.view(torch.uint8).numpy() if t.numel() else memoryview(b"")


def _rows(sums: list[Any]) -> torch.Tensor:
    """Per-box checksum rows (``digest`` tuples or ``_sums`` tensors) as one (n, 2) tensor."""
    if not sums:
        return torch.empty((0, 2), dtype=torch.int64)
    if isinstance(sums[0], torch.Tensor):
        return torch.stack(sums)
    return torch.tensor(sums, dtype=torch.int64)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


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
        raise cls(f"raw bandwidth probe with {group.rank_map.describe_group_rank(peer)} failed: "
                  f"{str(e).splitlines()[0]}") from e
    return nbytes / dt if dt > 0 else float("inf")
