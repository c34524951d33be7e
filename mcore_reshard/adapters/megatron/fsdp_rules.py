"""Megatron-FSDP's shards as rules: which rows of each TP-local parameter a rank holds, from the
parameter shapes alone (the dry run of a full-size recipe; pure, no torch or megatron).

Megatron-FSDP (``megatron_fsdp/param_and_grad_buffer.py``) lays a chunk's parameters out as:

1. **Groups** (``_get_parameter_groups``): parameters, in module order, grouped by (expert or
   not, FSDP unit): each ``TransformerLayer`` is a unit, the embedding, final norm and output
   layer share the one group outside any unit. A tied embedding shared across pipeline stages
   (``shared_embedding``) gets a bucket of its own.
2. **Chunk size** (its step 3): the group's parameters sorted by row length, longest first
   (stable); the chunk size grows to the least common multiple of the row lengths that do not
   divide it.
3. **Packing** (``build_data_parallel_buffer_index``): each parameter at the running offset,
   a parameter that is not whole chunks padded to the next chunk, whose gap another's
   remainder or small parameters fill; the bucket padded to ``dp * chunk``.
4. **Shards** (``_get_dp_buffer_shard_bucket_index``): data-parallel rank ``r`` of the shard
   group holds ``[r, r + 1) * size / dp`` of the bucket; a parameter's slice is its overlap.

The slices are whole rows wherever megatron can view them as ``(-1, *shape[1:])``; one that is
not (a bucket the planner cannot cut) is refused in one line naming the parameter. The live
adapter reads the real slices (``live.describe``); the tests compare the two.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from itertools import groupby
from typing import Mapping

from ...layout import LayoutError, LocalParam
from ...layout.rows import rows_of

__all__ = ["fsdp_slices", "fsdp_cut"]


@dataclass(frozen=True)
class _Item:
    name: str
    shape: tuple[int, ...]
    shared: bool = False  # a tied embedding shared across pipeline stages (a bucket of its own)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        return math.prod(self.shape[1:])


_UNIT = re.compile(r"^(chunk\d+\.)?(decoder\.layers\.\d+|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer))\.")


def _unit(name: str) -> str | None:
    """The FSDP unit (a ``TransformerLayer``) a parameter is in, or None."""
    m = _UNIT.match(name)
    return m.group(0) if m else None


def _module_order(name: str) -> int:
    """megatron registers an attention's output projection (base ``Attention``) before its input
    projections: the one place the rules list a layer's parameters in another order."""
    return 0 if name.endswith(".self_attention.linear_proj.weight") else 1


def _groups(items: list[_Item]) -> list[list[_Item]]:
    """Steps 1-2: the buckets, each its parameters in module order."""
    groups: dict[tuple, list[_Item]] = {}
    for it in items:
        groups.setdefault((".experts." in it.name, _unit(it.name)), []).append(it)
    out = []
    for members in groups.values():
        bucket: list[_Item] = []
        for it in members:
            if it.shared:
                if bucket:
                    out.append(bucket)
                out.append([it])
                bucket = []
            else:
                bucket.append(it)
        if bucket:
            out.append(bucket)
    return out


def _chunk_size(params: list[_Item]) -> tuple[list[_Item], int]:
    """Step 3: the parameters sorted by row length (longest first) and the chunk size."""
    params = sorted(params, key=lambda p: -p.row)
    csf = params[0].row
    for p in params:
        if not (p.row == csf or (csf % p.row == 0 and p.numel % csf == 0) or p.numel < csf):
            csf = math.lcm(csf, p.row)
    return params, csf


def _offsets(params: list[_Item], csf: int) -> tuple[dict[str, int], int]:
    """Step 3, packing: each parameter's offset in the bucket, and the bucket's unpadded size."""
    fragments = [p for p in params if p.numel < csf]
    regular = [p for p in params if p.numel >= csf]
    at: dict[str, int] = {}
    index = 0
    while regular:
        it = regular.pop(0)
        at[it.name] = index
        if it.numel % csf == 0:
            index += it.numel
            continue
        gap = index + it.numel
        index += (it.numel // csf + 1) * csf
        remain = it.numel % csf
        space = csf - remain
        rhs = next((r for r in regular if r.numel % csf and remain + r.numel % csf <= csf), None)
        if rhs is not None:
            regular.remove(rhs)
            at[rhs.name] = index - rhs.numel % csf
            space -= rhs.numel % csf
            index += rhs.numel // csf * csf
        for frag in fragments[:]:
            if frag.numel <= space:
                at[frag.name] = gap
                space -= frag.numel
                gap += frag.numel
                fragments.remove(frag)
    for frag in fragments:
        at[frag.name] = index
        index += frag.numel
    return at, index


def fsdp_slices(params: list[LocalParam], groups: Mapping[bool, tuple[int, int]],
                shared: frozenset[str] = frozenset(),
                extra: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> dict[str, tuple[int, int]]:
    """(first row, rows) of each of a rank's parameters (``params``, the rules' whole TP-local
    ones) that Megatron-FSDP leaves it. ``groups[expert]``: the rank's (index, size) in the
    data-parallel shard group of dense (data x context parallel) and expert (expert data
    parallel) parameters; ``shared``: names in a bucket of their own; ``extra``: parameters the
    chunk holds that the rules do not list (a tied output-layer copy)."""
    items = [_Item(p.name, tuple(p.shape), p.name in shared) for p in params]
    items += [_Item(n, s, True) for n, s in extra]
    chunks: dict[str, list[_Item]] = {}  # one FSDP wrapper per virtual-pipeline chunk
    for it in items:
        chunks.setdefault(it.name.split(".", 1)[0] if it.name.startswith("chunk") else "", []).append(it)
    out: dict[str, tuple[int, int]] = {}
    for members in chunks.values():
        for bucket in _groups(_in_module_order(members)):
            ordered, csf = _chunk_size(bucket)
            at, used = _offsets(ordered, csf)
            index, size = groups[".experts." in bucket[0].name]
            shard = -(-used // (size * csf)) * csf  # the bucket padded to size * csf, split evenly
            lo, hi = index * shard, (index + 1) * shard
            for it in ordered:
                a, b = max(at[it.name], lo) - at[it.name], min(at[it.name] + it.numel, hi) - at[it.name]
                if b <= a:  # none of it here
                    out[it.name] = (0, 0)
                    continue
                if a % it.row or b % it.row:
                    raise LayoutError(f"{it.name}: Megatron-FSDP's bucket gives data-parallel rank {index} its "
                                      f"elements [{a}, {b}) of {it.shape}, not whole rows of {it.row}: a bucket "
                                      f"the planner cannot cut")
                out[it.name] = (a // it.row, (b - a) // it.row)
    return out


def _in_module_order(items: list[_Item]) -> list[_Item]:
    """The rules' order, each layer's input norm and attention output projection first: the
    order megatron registers them in (``_module_order``)."""
    def key(it: _Item) -> int:
        if _unit(it.name) is None:
            return 0
        return 0 if it.name.endswith(".input_layernorm.weight") else _module_order(it.name) + 1

    out: list[_Item] = []
    for _, block in groupby(items, key=lambda it: _unit(it.name)):
        out.extend(sorted(block, key=key))
    return out


def fsdp_cut(params: list[LocalParam], slices: dict[str, tuple[int, int]]) -> list[LocalParam]:
    """Each parameter cut to its rows (``layout.rows``)."""
    return [rows_of(p, *slices[p.name]) if p.name in slices else p for p in params]
