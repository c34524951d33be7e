"""Descriptors applied to real tensors: cut local tensors out of canonical ones and back.

Used by the simulated planner tests, by loading HF checkpoints into sharded models through
the descriptors (the oracle direction), and by the verification path. Imports torch only.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .descriptor import Box, LocalParam, Piece, View

__all__ = ["box_slices", "local_view", "canonical_box", "materialize_local", "write_pieces", "zero_padding",
           "TORCH_DTYPES"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))


def local_view(local: torch.Tensor, view: View) -> torch.Tensor:
    """The strided window of ``local`` (contiguous) that ``view`` describes; writes go through."""
    if not local.is_contiguous():
        raise ValueError("local tensors must be contiguous to address them by flat views")
    flat = local.view(-1)
    return flat.as_strided(view.shape, view.stride, flat.storage_offset() + view.offset)


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


def materialize_local(param: LocalParam, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The local tensor ``param`` describes, built from canonical tensors (padding = 0)."""
    dtype = TORCH_DTYPES[param.dtype]
    out = torch.zeros(param.shape, dtype=dtype)
    write_pieces(out, param.pieces, tensors)
    return out
