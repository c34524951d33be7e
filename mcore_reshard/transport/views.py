"""Descriptors applied to real tensors: cut local tensors out of canonical ones and back.

Used by the transport (it writes local views), by loading HF checkpoints into sharded models
through the descriptors (the oracle direction), by the verification path and the simulated
planner tests. The one place descriptors meet torch: ``layout`` and ``plan`` never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..layout.descriptor import Box, LocalParam, Piece, View
from ..layout.dtensor import DTensorForm

__all__ = ["ReceivedWeights", "BIT_VIEWS", "as_bits", "box_slices", "local_view", "scatter_flat", "canonical_box", "materialize_local", "write_pieces", "zero_padding", "gather_canonical",
           "torch_placements", "TORCH_DTYPES"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}


#: An integer dtype of each element size: the bits of a tensor of any dtype, to flip or compare.
BIT_VIEWS: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))


def local_view(local: torch.Tensor, view: View) -> torch.Tensor:
    """The strided window of ``local`` (contiguous) that ``view`` describes; writes go through."""
    if not local.is_contiguous():
        raise ValueError("local tensors must be contiguous to address them by flat views")
    flat = local.view(-1)
    return flat.as_strided(view.shape, view.stride, flat.storage_offset() + view.offset)


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` unless they are the same memory already (a box written in place)."""
    if dst.data_ptr() != src.data_ptr() or dst.stride() != src.stride():
        dst.copy_(src)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (``BIT_VIEWS``; the same memory, bit for
    bit): for copies torch has no kernel for in ``t``'s dtype (``index_copy_`` of
    ``float8_e4m3fn`` on CPU)."""
    return t.view(BIT_VIEWS[t.element_size()])


def scatter_flat(x: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """``x`` (a view, possibly strided) with ``values`` written at its flat, C-order
    ``positions`` (int64), in place: a delta refit's changes. Bits are copied (``as_bits``),
    so every dtype takes them, FP8 codes included."""
    x, values = as_bits(x), as_bits(values)
    if x.is_contiguous():
        x.view(-1).index_copy_(0, positions, values)
    else:
        x[torch.unravel_index(positions, x.shape)] = values


def canonical_box(tensors: Mapping[str, torch.Tensor], piece: Piece) -> torch.Tensor:
    return tensors[piece.canonical][box_slices(piece.box)]


def write_pieces(local: torch.Tensor, pieces: Sequence[Piece], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy every piece's box from the canonical ``tensors`` into ``local`` at its view."""
    for piece in pieces:
        local_view(local, piece.view).copy_(canonical_box(tensors, piece))


def zero_padding(local: torch.Tensor, param: LocalParam) -> None:
    """Zero the elements of ``local`` that no piece of ``param`` covers (e.g. vLLM's pad64
    vocab rows): a plan never sends padding, the receiver fills it itself."""
    if param.padding == 0:
        return
    covered = torch.zeros(param.shape, dtype=torch.bool, device=local.device)
    for piece in param.pieces:
        local_view(covered, piece.view).fill_(True)
    local.masked_fill_(~covered, 0)


def gather_canonical(params: Sequence[LocalParam], tensors: Mapping[str, tuple], locals_: Sequence[Mapping[str, torch.Tensor]],
                     only: Any = None) -> dict[str, torch.Tensor]:
    """The canonical tensors a side's ranks hold, assembled from every rank's local tensors
    (``locals_[rank][name]``; NaN where no piece covers). ``only(canonical) -> bool`` limits it."""
    out: dict[str, torch.Tensor] = {}
    for p in params:
        for q in p.pieces:
            if only is not None and not only(q.canonical):
                continue
            t = out.get(q.canonical)
            if t is None:
                shape, _ = tensors[q.canonical]
                t = out[q.canonical] = torch.full(tuple(shape), float("nan"), dtype=locals_[p.rank][p.name].dtype)
            t[box_slices(q.box)] = local_view(locals_[p.rank][p.name].contiguous(), q.view)
    return out


def materialize_local(param: LocalParam, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The local tensor ``param`` describes, built from canonical tensors (padding = 0)."""
    dtype = TORCH_DTYPES[param.dtype]
    out = torch.zeros(param.shape, dtype=dtype)
    write_pieces(out, param.pieces, tensors)
    return out


def torch_placements(form: DTensorForm) -> tuple:
    """``form``'s placements as ``torch.distributed.tensor.placement_types`` objects (what a
    ``DTensor`` of that layout would carry)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    out = []
    for p in form.placements:
        if p[0] == "shard":
            out.append(Shard(p[1]))
        elif p[0] == "replicate":
            out.append(Replicate())
        else:
            out.append(_StridedShard(p[1], split_factor=p[2]))
    return tuple(out)


@dataclass(frozen=True)
class ReceivedWeights:
    """``verify=full``: one worker's model-format parameters after the last refit (torch
    tensors by local name), each read ``live`` (the kernel keeps model format) or from the
    copy the engine ``received``. On the wire a tensor is its dtype, shape and raw bytes."""

    tensors: Mapping[str, Any]
    where: Mapping[str, str]

    def to_wire(self) -> dict:
        def raw(t: Any) -> dict:
            t = t.detach().contiguous().cpu()
            return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                    "data": t.view(-1).view(torch.uint8).numpy().tobytes()}

        return {"tensors": {n: raw(t) for n, t in self.tensors.items()}, "where": dict(self.where)}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "ReceivedWeights":
        def tensor(w: Mapping[str, Any]) -> Any:
            dtype, shape = getattr(torch, str(w["dtype"])), tuple(int(n) for n in w["shape"])
            if not w["data"]:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(bytearray(w["data"]), dtype=torch.uint8).view(dtype).reshape(shape)

        return ReceivedWeights({n: tensor(w) for n, w in d["tensors"].items()}, dict(d["where"]))
