"""Wire format of one message: the boxes of a (bucket, src, dst) group, packed back to back
in plan order. Both ends derive the same order from the plan, so no header is sent."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..layout.torch_views import local_view
from ..plan.types import Transfer

__all__ = ["message_numel", "pack", "unpack"]


def message_numel(transfers: Sequence[Transfer]) -> int:
    return sum(t.box.numel for t in transfers)


def pack(transfers: Sequence[Transfer], tensors: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy each transfer's source view into ``out`` (1-D, >= message size); returns the used part."""
    pos = 0
    for t in transfers:
        n = t.box.numel
        out[pos : pos + n].view(t.src_view.shape).copy_(local_view(tensors[t.src_name], t.src_view))
        pos += n
    return out[:pos]


def unpack(transfers: Sequence[Transfer], buf: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
    """Scatter a received message into the destination views."""
    pos = 0
    for t in transfers:
        n = t.box.numel
        local_view(tensors[t.dst_name], t.dst_view).copy_(buf[pos : pos + n].view(t.dst_view.shape))
        pos += n
