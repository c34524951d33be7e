"""A DTensor policy's layout from metadata alone (dry runs and plans; pure, no torch).

What ``source.dtensor_params`` reads from a live rank -- each parameter's local shard as the box
torch's placement arithmetic gives it -- predicted from the HF names, the mesh sizes and NeMo
RL's tensor-parallel plan (``parallel.TP_PLAN``): a ``colwise`` projection is ``Shard(0)`` over
"tp" (its bias too), a ``rowwise`` one ``Shard(1)`` (its bias replicated); FSDP2 then shards
dimension 0 over "dp" as ``torch.chunk`` does (ceil-sized chunks, the last ones short or
empty), inside TP's block where TP cut dimension 0 too (``_StridedShard``). Everything not in
the plan is replicated over "tp". The live test compares the two.
"""

from __future__ import annotations

from ...layout import Box, LocalParam, ModelSpec, Piece, SideLayout, View, contiguous_strides
from .parallel import TP_PLAN, DTensorParallel

__all__ = ["dtensor_rank_params", "dtensor_layout"]

def _tp_dim(name: str, ndim: int) -> int | None:
    """The dimension TP shards ``name`` on under ``TP_PLAN``, or None (replicated over "tp")."""
    module, _, leaf = name.rpartition(".")
    style = next((v for m, v in TP_PLAN.items() if module.endswith("." + m)), None)
    if style == "colwise":
        return 0
    if style == "rowwise" and leaf == "weight" and ndim == 2:
        return 1
    return None


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``torch.chunk``'s part ``i`` of ``n``: (start, size), ceil-sized, possibly empty."""
    size = -(-n // parts)
    start = min(i * size, n)
    return start, min(size, n - start)


def dtensor_rank_params(spec: ModelSpec, par: DTensorParallel, rank: int) -> list[LocalParam]:
    """Every parameter rank ``rank`` holds a non-empty shard of, named by its HF name."""
    dp_r, tp_r = divmod(rank, par.tp)
    out: list[LocalParam] = []
    for name, (shape, _) in spec.tensor_table().items():
        offsets, sizes = [0] * len(shape), list(shape)
        dim = _tp_dim(name, len(shape)) if par.tp > 1 else None
        if dim is not None:  # TP's block first
            offsets[dim], sizes[dim] = _chunk(shape[dim], par.tp, tp_r)
        if shape:  # then FSDP2's chunk of dimension 0 (of TP's block where TP cut it)
            start, size = _chunk(sizes[0], par.dp, dp_r)
            offsets[0] += start
            sizes[0] = size
        box = Box(tuple(offsets), tuple(sizes))
        if box.numel == 0:
            continue
        view = View(0, box.sizes, contiguous_strides(box.sizes))
        out.append(LocalParam(rank, name, box.sizes, spec.dtype, (Piece(rank, name, name, box, view),)))
    return out


def dtensor_layout(spec: ModelSpec, par: DTensorParallel) -> SideLayout:
    """All ranks of a DTensor policy (replicas over "tp" listed on every rank holding them)."""
    params = tuple(p for r in range(par.world_size) for p in dtensor_rank_params(spec, par, r))
    return SideLayout(name=f"dtensor(dp={par.dp},tp={par.tp})", world_size=par.world_size, params=params,
                      tensors=spec.tensor_table())
