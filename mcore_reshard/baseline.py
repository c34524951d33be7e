"""The HF-conversion broadcast path: the baseline every benchmark compares with.

What RL stacks ship today, in its reasonably efficient form: the training ranks gather every
tensor whole in HF names and layout on training rank 0 (here through a gather plan, which is
cheaper than the per-tensor all-gathers of an HF export, so the baseline is not handicapped),
rank 0 broadcasts bucket after bucket of full tensors to every vLLM worker, and each worker
lets vLLM's own loaders cut out its part inside vLLM's layerwise reload. Every inference rank
receives the whole model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import torch

from .layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from .layout.torch_views import TORCH_DTYPES

__all__ = ["gather_layout", "hf_buckets", "BroadcastStats", "broadcast_send", "broadcast_receive"]


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
    (a tensor larger than that travels alone). Both ends derive the same buckets."""
    buckets: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype) in tensors.items():
        n = _nbytes(shape, dtype)
        if buckets[-1] and used + n > buffer_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += n
    return [b for b in buckets if b]


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class BroadcastStats:
    bytes_sent: int  # by the root, counted once per receiver (what the wire carries)
    bytes_received: int
    buckets: int
    seconds: float
    peak_extra_bytes: int


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
