"""Delta refits: after the first refit, move only the elements that changed since the last one.

A refit's boxes are the same every step (the plan is cached), so each rank can remember what
the other end holds. The sender keeps a copy, in the wire dtype, of what it last sent
(``DeltaState.baseline``: every box of its plan slice back to back, on the parameters'
device -- host memory here; ``delta_state_bytes``), updated in place as it encodes; the
receiver's baseline is what its destination holds now (``Sink.baseline``: the live parameter,
or for a layer vLLM repacks, the model-format copy ``VllmSink`` keeps of its last commit).
A delta is against that baseline only if every rank of the refit committed the same refit last
(``DeltaState.offer``: the id of that refit, under this plan digest), checked in the
agreement exchange before any byte moves (``decide``); otherwise the refit is full and its
report says why.

Encoding, per box, decided at run time from the bits (``-0.0 != 0.0``, NaN payloads count):

* unchanged: nothing on the wire (header 0);
* sparse: int32 positions (box-flat, ascending) then the new values: ``h`` changed elements
  cost ``4h + h * itemsize`` bytes, chosen while that is below the dense box;
* dense: the box as a full refit sends it (header ``numel``).

A message is its boxes' encodings back to back in plan order; its header (one int64 per box)
goes ahead of it in the same bucket (``HeaderExchange``), so the receiver posts a receive of
the right size. The receiver writes a changed box as its baseline plus the changes into the
tensor the sink resolves, and commits an unchanged one as kept (``commit_box``), through the
same two calls as a full refit: staging, vLLM's layerwise reload, the two-phase commit and the
checksums are unchanged, and the checksum compares the *whole* new box (the sender hashes its
new weights, not the delta), so a wrong baseline cannot pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..plan.tags import header_tag
from ..plan.types import RankPlan, Transfer
from ..wire.protocol import refit_id
from .channels import ChannelKey, GroupChannel, MsgKey, Op, Route, Spec
from .group import RefitError
from .sink import Sink, baseline_of
from .stats import Tally
from .views import as_bits, local_view

__all__ = ["DeltaDecision", "DeltaEncoder", "DeltaDecoder", "DeltaRun", "DeltaState", "HeaderExchange",
           "decide", "encoded_numel", "refit_id"]


def encoded_numel(h: int, n: int, itemsize: int) -> int:
    """Wire elements of a box of ``n`` elements with header ``h`` (0, changed count, or ``n``)."""
    if h == 0 or h == n:
        return h
    return -(-4 * h // itemsize) + h


def _sparse_pays(changed: int, n: int, itemsize: int) -> bool:
    return 0 < changed and encoded_numel(changed, n, itemsize) < n


def _box_offsets(plan: RankPlan) -> tuple[dict[int, int], int]:
    """Where each box of a sender's slice has its copy in the baseline (by ``id`` of its
    transfer: the boxes back to back, in slice order), and the baseline's elements."""
    at, pos = {}, 0
    for t in plan.transfers:
        at[id(t)] = pos
        pos += t.box.numel
    return at, pos


@dataclass(frozen=True)
class DeltaDecision:
    """Whether this refit sends deltas (``on``), and why not when it does not."""

    on: bool
    reason: str = ""
    #: The refit every rank records if this one commits (``refit_id``).
    refit_id: str = ""


def decide(offers: Sequence[str | None], mode: str, refit: str, names: Sequence[str]) -> DeltaDecision:
    """Delta iff ``mode`` is auto and every rank offers the same committed refit (``names``:
    how to call each rank in the reason). Every rank computes this from the same exchange."""
    if mode == "off":
        return DeltaDecision(False, "refit.delta=off", refit)
    if all(o is None for o in offers):
        return DeltaDecision(False, "no rank holds a committed baseline (first refit under this plan)", refit)
    held = sorted({o for o in offers if o is not None})
    if len(held) == 1 and None not in offers:
        return DeltaDecision(True, "", refit)
    missing = [names[i] for i, o in enumerate(offers) if o is None]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return DeltaDecision(False, f"{', '.join(missing[:3])}{more} hold no committed baseline "
                                    "(new or restarted process, failed or aborted last refit, or a changed plan)",
                             refit)
    return DeltaDecision(False, f"ranks hold {len(held)} different committed refits (an engine or trainer "
                                "missed a refit)", refit)


@dataclass
class DeltaState:
    """What one rank keeps between refits: the id of the last refit it committed and, on a
    sender, a wire-dtype copy of every box it sends (``baseline``: its plan slice's boxes back
    to back, in slice order, so each box's copy is its own and updated in place). Lives as long
    as the rank's endpoint; a new process starts without it (its first refit is full)."""

    version: str | None = None
    #: This refit's id once this rank finished its part; becomes ``version`` at the commit.
    pending: str | None = None
    baseline: torch.Tensor | None = None
    #: Why this rank keeps no baseline (over ``delta_state_limit_bytes``), for the report.
    note: str = ""

    def offer(self, plan_digest: str) -> str | None:
        """The committed refit this rank can take a delta against under ``plan_digest``."""
        v = self.version
        return v if v is not None and v.startswith(plan_digest[:16] + ":") else None

    @property
    def nbytes(self) -> int:
        return 0 if self.baseline is None else self.baseline.numel() * self.baseline.element_size()

    def clear(self) -> None:
        self.baseline = None

    def begin(self) -> None:
        """A refit starts: until it commits, this rank's baseline is in flux."""
        self.pending = None

    def finished(self, refit: str | None) -> None:
        """This rank's part of refit ``refit`` succeeded (None: but it keeps no baseline)."""
        self.pending = refit

    def settle(self, commit: bool) -> None:
        """The refit's decision: the baseline is the refit just committed, or none."""
        self.version = self.pending if commit else None
        self.pending = None

    def reset(self) -> None:
        """Forget the baseline's version (the weights changed outside a refit): the next refit is full."""
        self.settle(False)

    def keep_sent(self, plan: RankPlan, src_tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                  limit_bytes: int) -> int:
        """After a successful full send: every box this rank sent, as sent (the wire dtype),
        into the baseline. Over ``limit_bytes`` (0: no limit) none is kept and this rank's
        refits stay full (``note`` says why). Returns the bytes kept."""
        at, n = _box_offsets(plan)
        if limit_bytes and n * dtype.itemsize > limit_bytes:
            self.baseline = None
            self.note = (f"training rank {plan.rank}: a baseline of {n * dtype.itemsize} bytes exceeds "
                         f"refit.delta_state_limit_bytes={limit_bytes}")
            return 0
        self.note = ""
        device = next((src_tensors[t.src_name].device for t in plan.transfers), torch.device("cpu"))
        base = self.baseline
        if base is None or base.numel() != n or base.dtype != dtype or base.device != device:
            base = self.baseline = torch.empty(n, dtype=dtype, device=device)
        for t in plan.transfers:
            pos = at[id(t)]
            base[pos : pos + t.box.numel].view(t.src_view.shape).copy_(local_view(src_tensors[t.src_name], t.src_view))
        return n * dtype.itemsize


@dataclass(frozen=True)
class DeltaRun:
    """One refit's delta part on one rank: the agreed decision, this rank's state (kept
    across refits by its endpoint) and the most bytes of baseline it may keep."""

    decision: DeltaDecision
    state: DeltaState
    limit_bytes: int = 0


def _changed(new: torch.Tensor, base: torch.Tensor) -> Any:
    """Box-flat (C-order) positions where the bits of ``new`` and ``base`` differ: a numpy
    array on CPU (numpy's compare and ``flatnonzero`` run about 5x torch's there, on strided
    views too), a tensor on a device."""
    if new.device.type == "cpu":
        return np.flatnonzero(as_bits(new).numpy() != as_bits(base).numpy())
    return (as_bits(new) != as_bits(base)).reshape(-1).nonzero().squeeze(1)


def _positions_values(new: torch.Tensor, idx: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 positions, the new values there) for a sparse box."""
    if isinstance(idx, np.ndarray):
        bits = as_bits(new).numpy()
        picked = bits.reshape(-1)[idx] if bits.flags.c_contiguous else bits[np.unravel_index(idx, bits.shape)]
        return torch.from_numpy(idx.astype(np.int32)), torch.from_numpy(picked).view(new.dtype)
    return idx.to(torch.int32), new.reshape(-1)[idx]


class DeltaEncoder:
    """The sender's part of a delta refit: encodes each box against its copy in the baseline,
    and updates that copy in place (the refit fails as a whole, or the copy is what was sent;
    a failed refit drops the baseline's version, ``DeltaState.settle``)."""

    def __init__(self, state: DeltaState, plan: RankPlan, dtype: torch.dtype, tally: Tally) -> None:
        self.dtype, self.isz, self.tally = dtype, dtype.itemsize, tally
        self.baseline = state.baseline
        self.at, n = _box_offsets(plan)  # id(transfer) -> its copy's offset in the baseline
        if self.baseline is not None and (self.baseline.numel() != n or self.baseline.dtype != dtype):
            self.baseline = None  # not this plan's: every box goes dense
        self.headers: dict[MsgKey, torch.Tensor] = {}

    def encode(self, key: MsgKey, ts: Sequence[Transfer], src_tensors: Mapping[str, torch.Tensor],
               out: torch.Tensor, dense_first: bool = False) -> torch.Tensor:
        """Encode the boxes ``ts`` into ``out``; returns the used part, keeps the header.
        ``dense_first``: send the first box whole (fault injection: a flipped bit then lands
        in a value, whatever changed)."""
        isz, dtype, tally = self.isz, self.dtype, self.tally
        hdr = torch.empty(len(ts), dtype=torch.int64)
        pos = 0
        for i, t in enumerate(ts):
            new = local_view(src_tensors[t.src_name], t.src_view)
            if new.dtype != dtype:
                new = new.to(dtype)
            n = t.box.numel
            base = None
            if self.baseline is not None:
                at = self.at[id(t)]
                base = self.baseline[at : at + n].view(new.shape)
            idx = None
            if base is None or (dense_first and i == 0):
                h = changed = n
            else:
                idx = _changed(new, base)
                changed = idx.size if isinstance(idx, np.ndarray) else idx.numel()
                h = changed if changed == 0 or _sparse_pays(changed, n, isz) else n
            tally.delta_elements += n
            tally.delta_changed += changed
            tally.delta_boxes[0 if h == 0 else (1 if h < n else 2)] += 1
            hdr[i] = h
            if h == n:
                out[pos : pos + n].view(new.shape).copy_(new)
                if base is not None:
                    base.copy_(new)
            elif h:
                npos = encoded_numel(h, n, isz) - h
                where, values = _positions_values(new, idx)
                out[pos : pos + npos].view(torch.uint8)[: 4 * h].copy_(where.view(torch.uint8))
                out[pos + npos : pos + npos + h].copy_(values)
                as_bits(base).view(-1).index_copy_(0, where.to(device=base.device, dtype=torch.int64),
                                                     as_bits(values).to(base.device))
            pos += encoded_numel(h, n, isz)
        self.headers[key] = hdr
        return out[:pos]

    def take(self) -> dict[MsgKey, torch.Tensor]:
        """The headers of the bucket just encoded, forgotten here."""
        headers, self.headers = self.headers, {}
        return headers


class HeaderExchange:
    """The headers of a delta refit's messages: in each bucket the sender posts one per
    message (to every member of a relay group, whose forwarded copy it describes too), and a
    receiver waits for its headers before it posts the data receives they size."""

    def __init__(self, wire: GroupChannel, route: Route, recv_b: Sequence[Mapping[ChannelKey, list[Transfer]]],
                 itemsize: int, tally: Tally) -> None:
        self.wire, self.route, self.recv_b, self.isz, self.tally = wire, route, recv_b, itemsize, tally
        self.got: dict[tuple[int, ChannelKey], torch.Tensor] = {}
        self._mine: dict[tuple[int, int], torch.Tensor] = {}  # (bucket, relay group) -> header to myself

    def post(self, k: int, headers: Mapping[MsgKey, torch.Tensor], wait: Any) -> list[Op]:
        """Post bucket ``k``'s header sends (``headers``: this rank's messages of bucket ``k``),
        receive its own headers (``wait(k, ops)``); returns the sends, for the caller to wait
        with the bucket's data."""
        route, gr = self.route, self.route.rank_map.group_rank
        specs: list[Spec] = []
        for (peer, g), hdr in headers.items():
            for m in (route.groups[g] if g >= 0 else (peer,)):
                if route.is_me("dst", m):
                    self._mine[(k, g)] = hdr
                else:
                    specs.append(("dst", m, hdr, gr("dst", m), header_tag(k, g)))
        recv: dict[ChannelKey, torch.Tensor] = {}
        for channel, ts in self.recv_b[k].items() if k < len(self.recv_b) else ():
            src, _, g = channel
            if route.is_me("src", src):
                self.got[(k, channel)] = self._mine.pop((k, g))
                continue
            recv[channel] = torch.empty(len(ts), dtype=torch.int64)
            specs.append(("src", channel, recv[channel], gr("src", src), header_tag(k, g)))
        ops = self.wire.post_all(k, specs)
        wait(k, [op for op in ops if op.side == "src"])
        for channel, hdr in recv.items():
            self.got[(k, channel)] = hdr
            self.tally.bytes_headers += hdr.numel() * hdr.element_size()
        return [op for op in ops if op.side == "dst"]

    def header(self, k: int, channel: ChannelKey) -> torch.Tensor:
        return self.got[(k, channel)]

    def numel(self, k: int, channel: ChannelKey, ts: Sequence[Transfer]) -> int:
        """Wire elements of ``channel``'s message in bucket ``k``, from its header (checked)."""
        hdr = self.got[(k, channel)].tolist()
        if len(hdr) != len(ts) or any(not 0 <= h <= t.box.numel for h, t in zip(hdr, ts)):
            raise RefitError(f"{self.route.rank_map.name_at(self.route.me)}: bad delta header from "
                             f"{self.route.rank_map.name('src', channel[0])} in bucket {k}")
        return sum(encoded_numel(h, t.box.numel, self.isz) for h, t in zip(hdr, ts))

    def drop(self, k: int) -> None:
        for key in [key for key in self.got if key[0] == k]:
            del self.got[key]


class DeltaDecoder:
    """The receiver's part. Each box becomes what delivery hands the sink: a dense box as
    received (in a dense message of them); a sparse one as its changes, which delivery writes
    over the baseline in the box's tensor; an unchanged one kept where the destination holds
    it. Patching costs one copy of the box where the sink stages, none where it writes in
    place; keeping costs nothing."""

    def __init__(self, sink: Sink, headers: HeaderExchange, dtype: torch.dtype, device: torch.device,
                 tally: Tally) -> None:
        if baseline_of(sink) is None:
            raise RefitError(f"a delta refit needs a sink with baseline(); {type(sink).__name__} has none")
        self.headers, self.dtype, self.device, self.tally = headers, dtype, device, tally
        self.isz = dtype.itemsize

    def decode(self, k: int, channel: ChannelKey, ts: Sequence[Transfer],
               msg: torch.Tensor | None) -> tuple[torch.Tensor, dict[int, Any]]:
        """(the dense message of the boxes sent whole, the others by id: None to keep,
        (positions, values) to patch)."""
        t0 = time.perf_counter()
        hdr = self.headers.header(k, channel).tolist()
        special: dict[int, Any] = {}
        pos_in = 0
        whole: list[tuple[int, int]] = []  # (position in msg, elements)
        for h, t in zip(hdr, ts):
            n = t.box.numel
            if h == 0:
                special[id(t)] = None
            elif h < n:
                special[id(t)] = self._changes(k, t, h, msg, pos_in)
            else:
                whole.append((pos_in, n))
            pos_in += encoded_numel(h, n, self.isz)
        dense = torch.empty(sum(n for _, n in whole), dtype=self.dtype, device=self.device)
        self.tally.hold(dense.numel() * self.isz)
        pos_out = 0
        for at, n in whole:
            dense[pos_out : pos_out + n].copy_(msg[at : at + n])
            pos_out += n
        self.tally.timed("unpack", t0)
        return dense, special

    def _changes(self, k: int, t: Transfer, h: int, msg: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 box-flat positions, values) of a sparse box at ``at`` in ``msg``, checked."""
        npos = encoded_numel(h, t.box.numel, self.isz) - h
        pos = torch.empty(h, dtype=torch.int32)
        pos.view(torch.uint8).copy_(msg[at : at + npos].view(torch.uint8)[: 4 * h])
        idx = pos.to(device=self.device, dtype=torch.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= t.box.numel:
            raise RefitError(f"delta for {t.dst_name} in bucket {k}: positions outside its box")
        return idx, msg[at + npos : at + npos + h]

    def release(self, dense: torch.Tensor) -> None:
        self.tally.hold(-dense.numel() * self.isz)
