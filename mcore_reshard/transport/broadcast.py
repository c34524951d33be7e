"""The HF-conversion broadcast's data path: the baseline every benchmark compares with.

Training rank 0 holds every tensor whole in HF names and layout (gathered through a gather
plan, ``gather_layout``) and broadcasts them bucket after bucket to every vLLM worker of a
broadcast group; each worker hands the stream to vLLM's own loaders. Both ends derive the same
buckets (``hf_buckets``). The driver end and the trainer end are ``refit.transports.hf_broadcast``;
the engine end is ``adapters.vllm.hf_baseline``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from .views import TORCH_DTYPES

__all__ = ["HF_PREFIX", "gather_layout", "hf_buckets", "BroadcastStats", "broadcast_send", "broadcast_receive",
           "BroadcastJoin"]

#: The broadcast group's key prefix in its store.
HF_PREFIX = "mcore_reshard/hf"


def gather_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> SideLayout:
    """Destination layout "rank 0 holds every canonical tensor whole" (the HF export target)."""
    params = []
    for name, (shape, dtype) in tensors.items():
        shape = tuple(shape)
        piece = Piece(0, name, name, Box.full(shape), View(0, shape, contiguous_strides(shape)))
        params.append(LocalParam(0, name, shape, dtype, (piece,)))
    return SideLayout("hf-gather", 1, tuple(params), dict(tensors))


def hf_buckets(tensors: Mapping[str, tuple[tuple[int, ...], str]], buffer_bytes: int) -> list[list[str]]:
    """Canonical names in model order, grouped into buckets of at most ``buffer_bytes``
    (a tensor larger than that travels alone) and of one dtype (a bucket is one flat tensor:
    DeepSeek's fp32 router bias in a bf16 model starts a bucket of its own). Both ends derive
    the same buckets."""
    buckets: list[list[str]] = [[]]
    used, current = 0, None
    for name, (shape, dtype) in tensors.items():
        n = _nbytes(shape, dtype)
        if buckets[-1] and (used + n > buffer_bytes or dtype != current):
            buckets.append([])
            used = 0
        current = dtype
        buckets[-1].append(name)
        used += n
    return [b for b in buckets if b]


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class BroadcastStats:
    """One end's share of a broadcast (a vLLM worker's reply to ``mr_hf_receive``)."""

    bytes_sent: int  # by the root, counted once per receiver (what the wire carries)
    bytes_received: int
    buckets: int
    seconds: float
    peak_extra_bytes: int

    def to_wire(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "BroadcastStats":
        return BroadcastStats(int(d["bytes_sent"]), int(d["bytes_received"]), int(d["buckets"]), float(d["seconds"]),
                              int(d["peak_extra_bytes"]))


def broadcast_send(full: Mapping[str, torch.Tensor], tensors: Mapping[str, tuple[tuple[int, ...], str]], group,
                   *, buffer_bytes: int, timeout_s: float) -> BroadcastStats:
    """Root side: broadcast every full tensor, bucket by bucket, to every other group rank."""
    t0 = time.perf_counter()
    sent = peak = 0
    buckets = hf_buckets(tensors, buffer_bytes)
    for names in buckets:
        flat = torch.cat([full[n].reshape(-1) for n in names])
        peak = max(peak, flat.numel() * flat.element_size())
        group.broadcast(flat, root=group.rank, timeout_s=timeout_s)
        sent += flat.numel() * flat.element_size() * (group.world_size - 1)
    return BroadcastStats(sent, 0, len(buckets), time.perf_counter() - t0, peak)


def broadcast_receive(tensors: Mapping[str, tuple[tuple[int, ...], str]], group, root: int,
                      consume: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                      *, buffer_bytes: int, timeout_s: float) -> BroadcastStats:
    """Receiver side: hand ``consume`` a stream of (HF name, full tensor) as buckets land.

    Each bucket gets a fresh buffer: vLLM's layerwise reload keeps references to loaded
    tensors until their layer is complete.
    """
    t0 = time.perf_counter()
    stats = {"bytes": 0, "buckets": 0, "peak": 0}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for names in hf_buckets(tensors, buffer_bytes):
            dtype = TORCH_DTYPES[tensors[names[0]][1]]
            numel = sum(math.prod(tensors[n][0]) for n in names)
            flat = torch.empty(numel, dtype=dtype)
            group.broadcast(flat, root=root, timeout_s=timeout_s)
            stats["bytes"] += flat.numel() * flat.element_size()
            stats["buckets"] += 1
            stats["peak"] = max(stats["peak"], flat.numel() * flat.element_size())
            pos = 0
            for n in names:
                shape = tuple(tensors[n][0])
                k = math.prod(shape)
                yield n, flat[pos : pos + k].view(shape)
                pos += k

    consume(stream())
    return BroadcastStats(0, stats["bytes"], stats["buckets"], time.perf_counter() - t0, stats["peak"])


@dataclass(frozen=True)
class BroadcastJoin:
    """Where a vLLM worker joins the broadcast group: training rank 0 is group rank 0, engine
    ``e``'s workers follow from ``dst_offset`` (its first destination rank)."""

    host: str
    port: int
    world: int
    timeout_s: float
    dst_offset: int = 0
    secret: str = ""

    def to_wire(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "BroadcastJoin":
        return BroadcastJoin(str(d["host"]), int(d["port"]), int(d["world"]), float(d["timeout_s"]),
                             int(d.get("dst_offset", 0)), str(d.get("secret", "")))
