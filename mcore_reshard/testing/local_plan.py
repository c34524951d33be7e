"""Execute a plan inside one process (tests, debugging): the same packing as the wire path."""

from __future__ import annotations

from typing import Mapping

import torch

from ..transport.views import TORCH_DTYPES
from ..plan.types import TransferPlan
from ..transport.packing import message_numel, pack, unpack
from ..transport.quantize import QuantizedSources
from ..transport.reinterpret import WireTensors
from ..transport.scale import ScaledSources

__all__ = ["run_plan_locally"]


def run_plan_locally(
    plan: TransferPlan,
    src_tensors: Mapping[int, Mapping[str, torch.Tensor]],
    dst_tensors: Mapping[int, Mapping[str, torch.Tensor]],
) -> int:
    """Move every message of ``plan`` from ``src_tensors[rank][name]`` into
    ``dst_tensors[rank][name]`` (a relayed one into every member of its group); returns the
    bytes every destination received."""
    moved = 0
    wire = TORCH_DTYPES[plan.dtype]
    if plan.quantized:  # block FP8 at the sender (``RankPlan.quantize``), as the executor does
        src_tensors = {r: QuantizedSources(src_tensors.get(r, {}), plan.for_rank("src", r).quantize)
                       for r in range(plan.num_src)}
    if plan.scaled:  # tensors the destination holds scaled (a LoRA B), as the executor does
        src_tensors = {r: ScaledSources(src_tensors.get(r, {}), dict(plan.for_rank("src", r).scale), wire)
                       for r in range(plan.num_src)}
    if plan.reinterpret:  # tensors carried as their bits: viewed as the wire dtype on both ends
        src_tensors = {r: WireTensors(src_tensors.get(r, {}), dict(plan.for_rank("src", r).reinterpret), wire)
                       for r in range(plan.num_src)}
        dst_tensors = {r: WireTensors(dst_tensors.get(r, {}), dict(plan.for_rank("dst", r).reinterpret), wire)
                       for r in range(plan.num_dst)}
    for rank in range(plan.num_src):
        for messages in plan.for_rank("src", rank).messages():
            for (dst, g), transfers in messages.items():
                buf = torch.empty(message_numel(transfers), dtype=wire)
                msg = pack(transfers, src_tensors[rank], buf)
                # a relayed message: every member of its group holds its boxes in the same place
                for member in plan.relay_groups[g] if g >= 0 else (dst,):
                    unpack(transfers, msg, dst_tensors[member])
                    moved += msg.numel() * msg.element_size()
    return moved
