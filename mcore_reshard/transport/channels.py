"""How a bucket's messages move between this rank and each peer: one interface, four channels.

Every message of a bucket takes one channel, chosen from the plan slice alone (``Route``), so
both ends agree without asking each other:

* ``LocalChannel`` -- a message a group rank sends to itself (colocated refits) is handed over
  in process, never sent.
* ``ShmChannel`` -- a same-device peer in another process, on CPU: shared
  memory, only small flags over the group.
* ``GroupChannel`` -- everything else: one point-to-point message per (bucket, pair) over the
  refit group; it also posts and waits the group ops of the other channels.
* ``ZeroCopyChannel`` -- the large contiguous boxes of a ``GroupChannel`` peer: sent from the
  source parameter, received straight into the destination tensor (``Sink.target``), in the
  same bucket rounds.

Tags (``plan/tags.py``): data of bucket k uses tag k, the closing checksum message tag
``num_buckets``; a pair exchanges at most one packed message per bucket, so tags are unique per
(bucket, pair) within a refit; relayed messages, zero-copy boxes and consumed flags have bands
of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol, Sequence

import torch

from ..errors import RefitAborted
from .views import local_view
from ..plan.tags import ack_tag, direct_tag, message_tag
from ..plan.types import PlanError, RankPlan, Transfer
from .dataplane import backend_failure, error_class
from .group import RankMap, RefitError, RefitGroup
from .shm import ShmSegment, new_nonce, segment_path
from .sink import Sink
from .stats import Tally

__all__ = ["DIRECT_MIN_BYTES", "BucketPosts", "Channel", "GroupChannel", "LocalChannel", "Op", "Route",
           "ShmChannel", "ZeroCopyChannel"]

#: A receive channel: (source rank, via, relay group). ``via`` is this rank, or -- with fan-out
#: relays (``plan.placed``) -- the member of the relay group that receives the message from
#: the source and forwards it to the others; the group is -1 for a message that is not relayed.
ChannelKey = tuple[int, int, int]
#: A sent message: (destination rank, relay group).
MsgKey = tuple[int, int]
#: A group op still to post: (side, peer, tensor, peer's group rank, tag).
Spec = tuple[str, Any, torch.Tensor, int, int]


class Op(NamedTuple):
    """A posted op. ``side``: "src" (receive from ``peer``) | "dst" (send to it); same-device:
    "shm_src" (``tensor``: the ready flag received) | "shm_dst" (the message) | "ack" (a
    consumed flag, either way); zero-copy: "dsrc" | "ddst" (``peer``: (channel, transfer) on
    the receiving end)."""

    side: str
    peer: Any
    tensor: torch.Tensor
    work: Any


@dataclass(frozen=True)
class Route:
    """Who this rank is in one refit and which channel each of its messages takes."""

    me: int
    rank_map: RankMap
    src_rank: int | None
    dst_rank: int | None
    num_buckets: int
    groups: tuple[tuple[int, ...], ...]
    #: Same-device peers in other processes (CPU only): shared memory instead of the group.
    shm_dst: frozenset[int] = frozenset()
    shm_src: frozenset[int] = frozenset()

    @classmethod
    def of(cls, src: RankPlan | None, dst: RankPlan | None, me: int, rank_map: RankMap, cpu: bool) -> "Route":
        either = src or dst
        gr = rank_map.group_rank
        shm_dst = (d for d in (src.same_device if src is not None and cpu else ()) if gr("dst", d) != me)
        shm_src = (s for s in (dst.same_device if dst is not None and cpu else ()) if gr("src", s) != me)
        return cls(me, rank_map, src.rank if src is not None else None, dst.rank if dst is not None else None,
                   either.num_buckets if either is not None else 0, either.relay_groups if either is not None else (),
                   frozenset(shm_dst), frozenset(shm_src))

    def is_me(self, side: str, rank: int) -> bool:
        return self.rank_map.group_rank(side, rank) == self.me

    def local(self, channel: ChannelKey) -> bool:
        """A message from this process to itself (a colocated source and destination)."""
        src, via, _ = channel
        return via == self.dst_rank and self.is_me("src", src)

    def shm(self, channel: ChannelKey) -> bool:
        """A message from a same-device source in another process (through shared memory)."""
        src, via, _ = channel
        return via == self.dst_rank and src in self.shm_src

    def relayed(self, op: Op) -> bool:
        """A receive of a message another member of its relay group forwards."""
        return op.side == "src" and op.peer[1] != self.dst_rank

    def tag(self, k: int, g: int, forwarded_from: int | None = None) -> int:
        """Tag of a message in bucket ``k`` (``num_buckets``: its checksums) of relay group
        ``g`` (-1: none), sent by its source or (``forwarded_from`` = the source) forwarded."""
        try:
            return message_tag(self.num_buckets, len(self.groups), k, g, forwarded_from)
        except PlanError as e:
            raise RefitError(str(e)) from None

    def ack_tag(self, k: int, g: int) -> int:
        """Tag of the consumed flag of a same-device message in bucket ``k`` of relay group ``g``."""
        return ack_tag(len(self.groups), k, g)

    def recv_from(self, k: int, channel: ChannelKey) -> tuple[int, int]:
        """(group rank, tag) of the receive of ``channel`` in bucket ``k``."""
        src, via, g = channel
        if via == self.dst_rank:
            return self.rank_map.group_rank("src", src), self.tag(k, g)
        return self.rank_map.group_rank("dst", via), self.tag(k, g, forwarded_from=src)

    def peers(self, send_b: Sequence[Mapping[MsgKey, Any]], recv_b: Sequence[Mapping[ChannelKey, Any]]) -> set[int]:
        """Every group rank this rank exchanges a message with (data, forwards or checksums)."""
        gr, groups = self.rank_map.group_rank, self.groups
        peers = {gr("dst", m) for b in send_b for p, g in b
                 for m in (groups[g] if g >= 0 else (p,))}  # relays: every member gets the checksums
        peers |= {self.recv_from(0, c)[0] for b in recv_b for c in b}
        peers |= {gr("src", c[0]) for b in recv_b for c in b}  # checksums
        peers |= {gr("dst", m) for b in recv_b for _, via, g in b
                  if via == self.dst_rank and g >= 0 for m in groups[g]}  # what I forward
        return peers


class BucketPosts:
    """The posts of one bucket as channels add them: group ops to post together, in pair
    order (``GroupChannel.post_all``), and ops a channel already posted itself."""

    __slots__ = ("k", "specs", "ops", "_recv_bufs", "_pos")

    def __init__(self, k: int, recv_bufs: Sequence[torch.Tensor]) -> None:
        self.k, self.specs, self.ops, self._recv_bufs, self._pos = k, [], [], recv_bufs, 0

    def recv_slot(self, n: int) -> torch.Tensor | None:
        """The next ``n`` elements of this bucket's receive buffer (messages lie back to back)."""
        pos = self._pos
        self._pos += n
        return self._recv_bufs[self.k % len(self._recv_bufs)][pos : pos + n] if n else None


class Channel(Protocol):
    """One way a message of a bucket travels between this rank and a peer."""

    def post_send(self, k: int, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, posts: BucketPosts) -> None:
        """Start sending ``msg`` (the packed boxes ``ts`` for ``key``) in bucket ``k``."""

    def post_recv(self, k: int, channel: ChannelKey, ts: Sequence[Transfer], posts: BucketPosts) -> None:
        """Start receiving the boxes ``ts`` of ``channel`` in bucket ``k``."""


class GroupChannel:
    """Point-to-point messages over the refit group; posts and waits every channel's group ops,
    and names the peer and bucket of any that fails."""

    def __init__(self, group: RefitGroup, route: Route, timeout_s: float, zero_copy: "ZeroCopyChannel") -> None:
        self.group, self.route, self.timeout_s, self.zero_copy = group, route, timeout_s, zero_copy
        #: Elements of a channel's buffered message in bucket k: the plan's (a delta refit
        #: sets its headers' sizes, ``delta.HeaderExchange.numel``).
        self.numel: Callable[[int, ChannelKey, Sequence[Transfer]], int] = \
            lambda k, channel, ts: zero_copy.packed_numel(ts)

    def post_send(self, k: int, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, posts: BucketPosts) -> None:
        peer, stream = key
        if msg.numel():
            g = self.route.rank_map.group_rank("dst", peer)
            posts.specs.append(("dst", peer, msg, g, self.route.tag(k, stream)))

    def post_recv(self, k: int, channel: ChannelKey, ts: Sequence[Transfer], posts: BucketPosts) -> None:
        g, tag = self.route.recv_from(k, channel)
        n = self.numel(k, channel, ts)
        if n:
            posts.specs.append(("src", channel, posts.recv_slot(n), g, tag))

    def post_all(self, k: int, specs: list[Spec]) -> list[Op]:
        """Post ops ``(side, peer, tensor, group rank, tag)`` by peer group rank; within a pair
        the lower group rank sends first. Gloo does not care (every op is asynchronous); NCCL
        runs both directions of a pair on one stream, where recv-before-send on both ends
        would deadlock."""
        me = self.route.me

        def key(spec: Spec) -> tuple[int, bool, int]:
            g = spec[3]
            return g, (spec[0] == "dst") != (me < g), spec[4]

        return [Op(side, peer, t, self.post(k, side, peer, t, g, tag))
                for side, peer, t, g, tag in sorted(specs, key=key)]

    def post(self, k: int, side: str, peer: Any, t: torch.Tensor, g: int, tag: int, *,
             send: bool | None = None, recv: bool = False) -> Any:
        """Post one op now; ``send`` defaults to what ``side`` says (``recv``: receive anyway)."""
        send = (side in ("dst", "ddst") and not recv) if send is None else send
        try:
            return self.group.send(t, g, tag) if send else self.group.recv(t, g, tag)
        except RuntimeError as e:
            raise self.error(k, side, peer, send, e) from e

    def wait(self, k: int, op: Op, deadline: float) -> None:
        """Wait for one op of bucket ``k`` until ``deadline`` (or another rank's abort)."""
        try:
            self.group.wait_work(op.work, max(deadline - time.perf_counter(), 1e-3))
        except RefitAborted:
            raise
        except RuntimeError as e:
            send = op.side in ("dst", "shm_dst", "ddst") or (op.side == "ack" and isinstance(op.peer, tuple))
            raise self.error(k, op.side, op.peer, send, e,
                             waited=self.timeout_s - max(deadline - time.perf_counter(), 0.0)) from e

    def error(self, k: int, side: str, peer: Any, send: bool, e: Exception, waited: float | None = None) -> RefitError:
        rm, route = self.route.rank_map, self.route
        what = "send to" if send else "receive from"
        bucket = f"bucket {k} of {route.num_buckets}" if k < route.num_buckets else "checksum message"
        me = rm.name_at(route.me)
        cls = error_class(e)
        side = {"shm_dst": "dst", "shm_src": "src", "ack": "dst", "ddst": "dst", "dsrc": "src"}.get(side, side)
        if isinstance(peer, tuple) and isinstance(peer[1], Transfer):  # a zero-copy box: its channel
            peer = peer[0]
        if isinstance(peer, tuple):  # a receive channel (source, via, relay group)
            src, via, _ = peer
            who = rm.name("src", src) + ("" if via == route.dst_rank else f" relayed by {rm.name('dst', via)}")
        else:
            who = rm.name(side, peer)
        return cls(f"{me}: {what} {who} failed in {bucket}: {backend_failure(e, self.timeout_s, waited)}")


class LocalChannel:
    """Messages this process sends to itself: kept until it delivers them."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.msgs: dict[tuple[int, ChannelKey], torch.Tensor] = {}  # (bucket, channel) -> message

    def post_send(self, k: int, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, posts: BucketPosts) -> None:
        peer, stream = key
        self.msgs[(k, (self.route.src_rank, peer, stream))] = msg

    def post_recv(self, k: int, channel: ChannelKey, ts: Sequence[Transfer], posts: BucketPosts) -> None:
        pass  # the sending end (this process) left it in ``msgs``

    def relayed(self, k: int) -> dict[ChannelKey, torch.Tensor]:
        """Bucket ``k``'s messages to myself that this rank forwards to its relay group."""
        return {c: m for (b, c), m in self.msgs.items() if b == k and c[2] >= 0}

    def take(self, k: int) -> dict[ChannelKey, torch.Tensor]:
        """Bucket ``k``'s messages to myself, forgotten here."""
        return {key[1]: self.msgs.pop(key) for key in [key for key in self.msgs if key[0] == k]}


#: Boxes of at least this many bytes, contiguous in both local tensors, skip the buffers: sent
#: from the parameter and received straight into the destination (``Sink.target``). Smaller
#: ones are packed: one message per peer beats one message per box there.
DIRECT_MIN_BYTES = 256 << 10


def _is_direct(t: Transfer, itemsize: int) -> bool:
    return t.box.numel * itemsize >= DIRECT_MIN_BYTES and t.src_view.is_contiguous() and t.dst_view.is_contiguous()


class ZeroCopyChannel:
    """Large contiguous boxes between two ranks that talk over the group (not relayed, not
    through shared memory): the sender posts the source view itself, the receiver a receive
    straight into the destination tensor, so they skip the buffers. Both ends decide from
    the plan slice alone, so they agree; each such box has its own tag (``direct_tag``)."""

    def __init__(self, route: Route, send_b: Sequence[Mapping[MsgKey, list[Transfer]]],
                 recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]], src_tensors: Mapping[str, torch.Tensor],
                 sink: Sink | None, dtype: torch.dtype, device: torch.device, tally: Tally,
                 enabled: bool = True) -> None:
        self.route, self.src_tensors, self.sink = route, src_tensors, sink
        self.dtype, self.device, self.tally = dtype, device, tally
        self.direct: set[int] = set()  # id() of this rank's zero-copy transfers
        if not enabled:  # a delta refit: every box is encoded into a message
            send_b = recv_b = ()
        for b in send_b:
            for (peer, g), ts in b.items():
                if g < 0 and not route.is_me("dst", peer) and peer not in route.shm_dst:
                    self.direct.update(id(t) for t in ts if _is_direct(t, dtype.itemsize))
        for b in recv_b:
            for c, ts in b.items():
                if c[2] < 0 and c[1] == route.dst_rank and not route.local(c) and not route.shm(c):
                    self.direct.update(id(t) for t in ts if _is_direct(t, dtype.itemsize))
        self.temps: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, id) -> landing / cast copy
        self.landed: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, id) -> received into the sink's tensor

    def packed_numel(self, ts: Sequence[Transfer]) -> int:
        """Elements of ``ts`` that go through a buffer (all but the zero-copy boxes)."""
        return sum(t.box.numel for t in ts if id(t) not in self.direct)

    def post_send(self, k: int, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, posts: BucketPosts) -> None:
        direct = [t for t in ts if id(t) in self.direct]
        if direct:
            g = self.route.rank_map.group_rank("dst", key[0])
            posts.specs.extend(("ddst", key[0], self._source(k, t, i), g, direct_tag(k, i))
                               for i, t in enumerate(direct))

    def post_recv(self, k: int, channel: ChannelKey, ts: Sequence[Transfer], posts: BucketPosts) -> None:
        direct = [t for t in ts if id(t) in self.direct]
        if direct:
            g = self.route.recv_from(k, channel)[0]
            posts.specs.extend(("dsrc", (channel, t), self._landing(k, t), g, direct_tag(k, i))
                               for i, t in enumerate(direct))

    def _source(self, k: int, t: Transfer, i: int) -> torch.Tensor:
        """What a zero-copy send posts: the source view itself (cast into a temporary when
        the wire dtype differs; a fault's corrupted copy for the first box)."""
        fake = self.temps.pop((k, id(t)), None)
        if fake is not None and i == 0:
            return fake.view(t.src_view.shape)
        x = local_view(self.src_tensors[t.src_name], t.src_view)
        if x.dtype != self.dtype:
            x = self.temp(k, t, x.to(self.dtype))
        return x

    def _landing(self, k: int, t: Transfer) -> torch.Tensor:
        """Where a zero-copy box is received: straight into the tensor the sink resolves it to
        when that is contiguous, on this device and of the wire dtype, else into a temporary
        that delivery copies there."""
        x = self.sink.resolve(t.dst_name, t.dst_view)
        if x.dtype != self.dtype or x.device != self.device or not x.is_contiguous():
            return self.temp(k, t, torch.empty(t.dst_view.shape, dtype=self.dtype, device=self.device))
        self.landed[(k, id(t))] = x
        return x

    def temp(self, k: int, t: Transfer, x: torch.Tensor) -> torch.Tensor:
        """Keep a zero-copy box's temporary until bucket ``k`` is done; count it as extra memory."""
        self.temps[(k, id(t))] = x
        self.tally.hold(x.numel() * x.element_size())
        return x

    def drop(self, k: int) -> None:
        """Bucket ``k`` is delivered: free its temporaries."""
        for key in [key for key in self.temps if key[0] == k]:
            x = self.temps.pop(key)
            self.tally.hold(-x.numel() * x.element_size())
        for key in [key for key in self.landed if key[0] == k]:
            del self.landed[key]


class ShmChannel:
    """Same-device peers in other processes (``RankPlan.same_device``: a colocated trainer and
    vLLM worker), on CPU: no bytes over the group. The sender's buffers are a ``/dev/shm``
    segment (``shm.py``) that it packs into as usual; the receiver maps it and unpacks in place.
    Per message only a 4-int64 ready flag (bucket, offset, elements, nonce) goes over the group,
    and a 1-int64 consumed flag comes back before the sender repacks that buffer (waited just
    before, so no rank waits on a flag of the bucket it is in). On CUDA such peers still take
    the group (CUDA IPC is not implemented here)."""

    def __init__(self, group: RefitGroup, route: Route, wire: GroupChannel,
                 recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]], dtype: torch.dtype) -> None:
        self.group, self.route, self.wire, self.recv_b, self.dtype = group, route, wire, recv_b, dtype
        self.segment: ShmSegment | None = None  # mine (sender): the send buffers
        self.n_bufs = 0
        self.nonce = 0
        self.attached: dict[int, ShmSegment] = {}  # source rank -> its segment (receiver)
        self.acks: dict[int, list[Op]] = {}  # send buffer -> consumed flags to wait for
        self.ack_sends: list[Op] = []
        self.flags: list[torch.Tensor] = []  # ready flags in flight (kept alive until waited)
        self.msgs: dict[tuple[int, ChannelKey], torch.Tensor] = {}  # (bucket, channel) -> message

    def send_buffers(self, n: int, numel: int) -> list[torch.Tensor]:
        """``n`` send buffers of ``numel`` elements in one new shared segment: the same bytes as
        private ones."""
        self.nonce = new_nonce()
        path = segment_path(self.group.control.derived_key("shm"), self.route.me, self.nonce)
        self.segment = ShmSegment.create(path, n * numel * self.dtype.itemsize)
        flat = self.segment.elements(self.dtype)
        self.n_bufs = n
        return [flat[i * numel : (i + 1) * numel] for i in range(n)]

    def post_send(self, k: int, key: MsgKey, ts: Sequence[Transfer], msg: torch.Tensor, posts: BucketPosts) -> None:
        """Tell the peer where its bucket-``k`` message lies in my segment, and post the receive
        of its consumed flag (waited before the buffer is packed again)."""
        peer, stream = key
        g = self.route.rank_map.group_rank("dst", peer)
        # (an empty message -- a delta refit's unchanged boxes -- has no address of its own)
        offset = (msg.data_ptr() - self.segment.data.data_ptr()) // self.dtype.itemsize if msg.numel() else 0
        flag = torch.tensor([k, offset, msg.numel(), self.nonce], dtype=torch.int64)
        self.flags.append(flag)
        ack = torch.empty(1, dtype=torch.int64)
        work = self.wire.post(k, "dst", peer, ack, g, self.route.ack_tag(k, stream), recv=True)
        self.acks.setdefault(k % self.n_bufs, []).append(Op("ack", peer, ack, work))
        posts.ops.append(Op("shm_dst", peer, msg, self.wire.post(k, "dst", peer, flag, g, self.route.tag(k, stream))))

    def post_recv(self, k: int, channel: ChannelKey, ts: Sequence[Transfer], posts: BucketPosts) -> None:
        """Only the ready flag comes over the group."""
        flag = torch.empty(4, dtype=torch.int64)
        g, tag = self.route.recv_from(k, channel)
        posts.ops.append(Op("shm_src", channel, flag, self.wire.post(k, "src", channel, flag, g, tag)))

    def attach(self, k: int, channel: ChannelKey, flag: torch.Tensor) -> torch.Tensor:
        """The message a ready flag points at, inside the sender's segment (mapped once)."""
        rm, src = self.route.rank_map, channel[0]
        bucket, offset, numel, nonce = (int(v) for v in flag.tolist())
        want = self.wire.numel(k, channel, self.recv_b[k][channel])
        if bucket != k or numel != want or offset < 0:
            raise RefitError(f"{rm.name_at(self.route.me)}: bad ready flag from "
                             f"{rm.name('src', src)} in bucket {k}: {flag.tolist()} "
                             f"(expected bucket {k}, {want} elements)")
        seg = self.attached.get(src)
        path = segment_path(self.group.control.derived_key("shm"), rm.group_rank("src", src), nonce)
        if seg is None or seg.path != path:
            seg = self.attached[src] = ShmSegment.attach(path)
        flat = seg.elements(self.dtype)
        if offset + numel > flat.numel():
            raise RefitError(f"ready flag from {rm.name('src', src)} points past its segment")
        msg = self.msgs[(k, channel)] = flat[offset : offset + numel]
        return msg

    def reuse(self, i: int) -> list[Op]:
        """The consumed flags to wait for before send buffer ``i`` is packed again."""
        return self.acks.pop(i, [])

    def consumed(self, k: int) -> None:
        """Bucket ``k`` is delivered (and forwarded): free each same-device sender's buffer."""
        for channel in self.recv_b[k]:
            if self.route.shm(channel):
                flag = torch.tensor([k], dtype=torch.int64)
                g = self.route.rank_map.group_rank("src", channel[0])
                work = self.wire.post(k, "src", channel, flag, g, self.route.ack_tag(k, channel[2]), send=True)
                self.ack_sends.append(Op("ack", channel, flag, work))

    def close(self, failed: bool) -> None:
        """Remove this rank's segment (and, after a failure, any it mapped: its sender may be
        gone); drop the mappings."""
        if self.segment is not None:
            self.segment.unlink()
        if failed:
            for seg in self.attached.values():
                seg.unlink()
        self.segment, self.attached, self.msgs = None, {}, {}

    def pending(self) -> Iterator[list[Op]]:
        """What is left after the last bucket, to wait for in turn: every receiver's consumed
        flags for my segment, then the flags I sent."""
        for i in list(self.acks):
            yield self.acks.pop(i)
        yield self.ack_sends
        self.ack_sends, self.flags = [], []
