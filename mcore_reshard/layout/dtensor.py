"""The DTensor form of a layout: one canonical tensor's placement as ``torch.distributed.tensor``
placements over a device mesh, where one exists.

Why: a reader who knows DTensor can check a layout at a glance (``mesh (2, 4) [Replicate(),
Shard(1)]``), and tools built on DTensor can consume the side directly. The form is derived
from the pieces, never assumed: a candidate is accepted only when torch's own split rules
(``Shard`` = ``torch.chunk``, ``_StridedShard`` = chunk into ``split_factor`` then chunk each)
reproduce every holder rank's boxes exactly. When nothing does (megatron's fused QKV split
inside a head, a padded vocab whose last shard is short, ...) the answer says why in one line.

Pure metadata (no torch): ``transport.views.torch_placements`` turns a form into torch's
placement objects.
"""

from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

from .descriptor import Box, LayoutError, SideLayout
from .memo import ValueIds

__all__ = [
    "DTensorForm",
    "NotExpressible",
    "Placement",
    "dtensor_form",
    "dtensor_forms",
    "dtensor_report",
    "dtensor_summary",
    "form_boxes",
    "placement_str",
]

#: ``("shard", dim)`` | ``("replicate",)`` | ``("strided_shard", dim, split_factor)``.
Placement = tuple
#: Nested tuple of ranks: the device mesh as a rank array.
Mesh = tuple

_Runs = tuple[tuple[int, int], ...]  # (start, length) runs along one tensor dim


def placement_str(p: Placement) -> str:
    """torch's constructor spelling: ``Shard(0)``, ``Replicate()``, ``_StridedShard(0, split_factor=2)``."""
    if p[0] == "shard":
        return f"Shard({p[1]})"
    if p[0] == "replicate":
        return "Replicate()"
    if p[0] == "strided_shard":
        return f"_StridedShard({p[1]}, split_factor={p[2]})"
    raise ValueError(f"unknown placement {p!r}")


def _mesh_shape(mesh: Mesh) -> tuple[int, ...]:
    shape = []
    while isinstance(mesh, tuple):
        shape.append(len(mesh))
        mesh = mesh[0]
    return tuple(shape)


def _mesh_cells(mesh: Mesh, prefix: tuple[int, ...] = ()) -> Iterable[tuple[tuple[int, ...], int]]:
    """(coordinate, rank) of every mesh cell, row-major."""
    if not isinstance(mesh, tuple):
        yield prefix, mesh
        return
    for i, sub in enumerate(mesh):
        yield from _mesh_cells(sub, prefix + (i,))


@dataclass(frozen=True)
class DTensorForm:
    """Placements over a device mesh that reproduce a tensor's pieces on one side."""

    mesh: Mesh
    placements: tuple[Placement, ...]
    mesh_dim_names: tuple[str, ...] | None = None

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return _mesh_shape(self.mesh)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Mesh ranks in row-major order."""
        return tuple(r for _, r in _mesh_cells(self.mesh))

    def coordinates(self) -> dict[int, tuple[int, ...]]:
        """rank -> mesh coordinate (what ``DeviceMesh.get_coordinate`` returns on that rank)."""
        return {r: c for c, r in _mesh_cells(self.mesh)}

    def __str__(self) -> str:
        return f"mesh {self.mesh_shape} [{', '.join(placement_str(p) for p in self.placements)}]"


@dataclass(frozen=True)
class NotExpressible:
    """No DTensor form reproduces the pieces; ``reason`` says why, in one line."""

    reason: str

    def __str__(self) -> str:
        return f"not expressible: {self.reason}"


Form = Union[DTensorForm, NotExpressible]


# --------------------------------------------------------------------------- torch's split rules


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of chunk ``i`` of ``n`` of a dim of ``size`` (``Shard.local_shard_size_and_offset``)."""
    c = -(-size // n)
    start = min(c * i, size)
    return start, max(0, min(size, start + c) - start)


def _take(runs: _Runs, lo: int, n: int) -> list[tuple[int, int]]:
    """Positions ``[lo, lo+n)`` of the index sequence ``runs`` spells, as runs."""
    out: list[tuple[int, int]] = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(lo + n, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
    return out


def _merge_runs(runs: Iterable[tuple[int, int]]) -> _Runs:
    out: list[list[int]] = []
    for start, length in runs:
        if length <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


def _split(runs: _Runs, p: Placement, n: int, i: int) -> _Runs:
    """What mesh coordinate ``i`` of a mesh dim of size ``n`` keeps of ``runs`` under ``p``."""
    size = sum(length for _, length in runs)
    if p[0] == "replicate":
        return runs
    if p[0] == "shard":
        return _merge_runs(_take(runs, *_chunk(size, n, i)))
    sf = p[2]  # _StridedShard: chunk into sf pieces, then piece j's chunk i, concatenated over j
    picked: list[tuple[int, int]] = []
    for j in range(sf):
        s0, l0 = _chunk(size, sf, j)
        s1, l1 = _chunk(l0, n, i)
        picked.extend(_take(runs, s0 + s1, l1))
    return _merge_runs(picked)


def _runs_to_boxes(per_dim: Sequence[_Runs]) -> tuple[Box, ...]:
    boxes = [((), ())]
    for runs in per_dim:
        boxes = [(o + (s,), z + (n,)) for o, z in boxes for s, n in runs]
    return tuple(sorted((Box(o, z) for o, z in boxes), key=_box_key))


def form_boxes(form: DTensorForm, shape: Sequence[int]) -> dict[int, tuple[Box, ...]]:
    """Each mesh rank's boxes under torch's split rules (mesh dims applied left to right);
    empty for a rank whose shard is empty. Several boxes only under ``_StridedShard``."""
    mshape = form.mesh_shape
    out: dict[int, tuple[Box, ...]] = {}
    for coord, rank in _mesh_cells(form.mesh):
        per_dim: list[_Runs] = [((0, s),) for s in shape]
        for mdim, p in enumerate(form.placements):
            if p[0] != "replicate":
                per_dim[p[1]] = _split(per_dim[p[1]], p, mshape[mdim], coord[mdim])
        out[rank] = () if any(not r for r in per_dim) else _runs_to_boxes(per_dim)
    return out


# --------------------------------------------------------------------------- what each rank holds


def _box_key(b: Box) -> tuple:
    return (b.offsets, b.sizes)


def _cov_key(cov: tuple[Box, ...]) -> tuple:
    return tuple(_box_key(b) for b in cov)


def _merge_boxes(boxes: set[Box]) -> list[Box]:
    """Union of one rank's boxes as few boxes as adjacency allows (megatron's per-group q pieces
    of one rank are adjacent rows; a DTensor shard is their union)."""
    out = sorted(boxes, key=_box_key)
    merged = True
    while merged:
        merged = False
        for i in range(len(out)):
            for j in range(len(out)):
                a, b = out[i], out[j]
                if i == j:
                    continue
                diff = [d for d in range(len(a.sizes)) if (a.offsets[d], a.sizes[d]) != (b.offsets[d], b.sizes[d])]
                if len(diff) == 1 and a.offsets[diff[0]] + a.sizes[diff[0]] == b.offsets[diff[0]]:
                    d = diff[0]
                    sizes = a.sizes[:d] + (a.sizes[d] + b.sizes[d],) + a.sizes[d + 1:]
                    out = [x for k, x in enumerate(out) if k not in (i, j)] + [Box(a.offsets, sizes)]
                    out.sort(key=_box_key)
                    merged = True
                    break
            if merged:
                break
    return out


def _holdings(side: SideLayout, names: set[str] | None = None) -> dict[str, dict[int, set[Box]]]:
    """canonical -> rank -> boxes held (identical copies on one rank, e.g. EPLB duplicates, once)."""
    out: dict[str, dict[int, set[Box]]] = defaultdict(lambda: defaultdict(set))
    for piece in side.pieces():
        if names is None or piece.canonical in names:
            out[piece.canonical][piece.rank].add(piece.box)
    return out


# --------------------------------------------------------------------------- the search


def _dim_word(d: int) -> str:
    return {0: "rows", 1: "columns"}.get(d, f"dim {d}")


def _uneven_reason(groups: Sequence[tuple[Box, ...]], d: int, size: int) -> str:
    """Why a 1-D ``Shard(d)`` over the distinct shards fails, naming the sizes torch would give."""
    shards = sorted(groups, key=lambda cov: cov[0].offsets[d])
    k = len(shards)
    got = tuple(cov[0].sizes[d] for cov in shards)
    want = tuple(_chunk(size, k, i)[1] for i in range(k))
    if got != want:
        return (f"uneven {_dim_word(d)}: {k} shards of dim {d} hold {got} of {size}, "
                f"torch.chunk over {k} gives {want}")
    starts = tuple(cov[0].offsets[d] for cov in shards)
    return f"{_dim_word(d)} start at {starts}, torch.chunk over {k} starts them at " \
           f"{tuple(_chunk(size, k, i)[0] for i in range(k))}"


def _shard_structures(groups: list[tuple[Box, ...]], shape: tuple[int, ...]):
    """Candidate shard layouts ``(shard mesh shape, placements, coverage -> shard coordinate)``,
    or a reason string when the distinct shards fit no pattern searched (1-D, 2-D, strided)."""
    if len(groups) == 1:
        return [((), (), {groups[0]: ()})]
    nd = len(shape)
    if all(len(cov) == 1 for cov in groups):
        vary = [d for d in range(nd) if len({(c[0].offsets[d], c[0].sizes[d]) for c in groups}) > 1]
        if len(vary) == 1:
            d = vary[0]
            order = sorted(groups, key=lambda cov: cov[0].offsets[d])
            return [((len(order),), (("shard", d),), {cov: (j,) for j, cov in enumerate(order)})]
        if len(vary) == 2:
            out = []
            for d0, d1 in (vary, vary[::-1]):
                s0 = sorted({c[0].offsets[d0] for c in groups})
                s1 = sorted({c[0].offsets[d1] for c in groups})
                if len(s0) * len(s1) != len(groups):
                    return f"{len(groups)} shards over dims {vary} do not form a {len(s0)}x{len(s1)} grid"
                coord = {c: (s0.index(c[0].offsets[d0]), s1.index(c[0].offsets[d1])) for c in groups}
                out.append(((len(s0), len(s1)), (("shard", d0), ("shard", d1)), coord))
            return out
        return f"shards differ along dims {vary}; only 1-D and 2-D sharding are searched"
    # some rank holds disjoint boxes: only a _StridedShard along one dim can say that
    vary = {d for cov in groups for b in cov for d in range(nd) if b.sizes[d] != shape[d]}
    n_boxes = max(len(cov) for cov in groups)
    if len(vary) != 1:
        return f"a rank holds {n_boxes} disjoint boxes that are not strided along one dim"
    d = vary.pop()
    order = sorted(groups, key=lambda cov: cov[0].offsets[d])
    return [((len(order),), (("strided_shard", d, n_boxes),), {cov: (j,) for j, cov in enumerate(order)})]


def _divisor_pairs(m: int) -> list[tuple[int, int]]:
    """(outer, inner) replica splits: plain outer first, then inner, then the mixed ones."""
    pairs = [(m, 1), (1, m)] + [(a, m // a) for a in range(2, m) if m % a == 0]
    return list(dict.fromkeys(pairs))


def _build(shard_shape, shard_pl, coord_of, replicas: dict[tuple[Box, ...], list[int]],
           outer: int, inner: int) -> DTensorForm:
    """Mesh ``(outer?, *shard_shape, inner?)``: cell (o, c, i) is replica ``o*inner+i`` of shard c."""
    by_coord = {coord_of[cov]: ranks for cov, ranks in replicas.items()}
    dims: list[tuple[str, int]] = ([("outer", outer)] if outer > 1 else []) + \
        [("shard", n) for n in shard_shape] + ([("inner", inner)] if inner > 1 else [])
    placements = (([("replicate",)] if outer > 1 else []) + list(shard_pl)
                  + ([("replicate",)] if inner > 1 else []))
    if not dims:  # one rank holding the whole tensor
        dims, placements = [("outer", 1)], [("replicate",)]

    def cell(coord: tuple[int, ...]) -> int:
        o = i = 0
        c: list[int] = []
        for (kind, _), x in zip(dims, coord):
            if kind == "outer":
                o = x
            elif kind == "inner":
                i = x
            else:
                c.append(x)
        return by_coord[tuple(c)][o * inner + i]

    def nest(prefix: tuple[int, ...]):
        if len(prefix) == len(dims):
            return cell(prefix)
        return tuple(nest(prefix + (x,)) for x in range(dims[len(prefix)][1]))

    return DTensorForm(nest(()), tuple(placements))


def _form_from_holdings(held: Mapping[int, set[Box]], shape: tuple[int, ...]) -> Form:
    if not held:
        return NotExpressible("held by no rank")
    coverage: dict[int, tuple[Box, ...]] = {}
    for rank in sorted(held):
        boxes = _merge_boxes(held[rank])
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                if a.intersect(b) is not None:
                    return NotExpressible(f"rank {rank} holds overlapping pieces {a} and {b}")
        coverage[rank] = tuple(boxes)
    replicas: dict[tuple[Box, ...], list[int]] = defaultdict(list)
    for rank, cov in coverage.items():
        replicas[cov].append(rank)
    counts = sorted({len(r) for r in replicas.values()})
    if len(counts) > 1:
        return NotExpressible(f"uneven replication: distinct shards are held by {counts} ranks each")
    total = math.prod(shape)
    held_numel = sum(b.numel for cov in replicas for b in cov)
    if held_numel != total:
        what = "overlap" if held_numel > total else "leave elements uncovered"
        return NotExpressible(f"distinct shards {what} ({held_numel} of {total} elements)")
    groups = sorted(replicas, key=_cov_key)
    structures = _shard_structures(groups, shape)
    if isinstance(structures, str):
        return NotExpressible(structures)
    m = counts[0]
    holders = sorted(coverage)
    first_valid: DTensorForm | None = None
    for shard_shape, shard_pl, coord_of in structures:
        for outer, inner in _divisor_pairs(m):
            form = _build(shard_shape, shard_pl, coord_of, replicas, outer, inner)
            got = form_boxes(form, shape)
            if any(got[r] != coverage[r] for r in holders):
                break  # the replica split never changes which shard a rank gets
            if list(form.ranks) == holders:
                return form  # the mesh lists ranks in order: the process-group reading
            first_valid = first_valid or form
    if first_valid is not None:
        return first_valid
    if not structures[0][1]:
        return NotExpressible(f"rank {holders[0]} holds the whole tensor as {len(groups[0])} boxes")
    first = structures[0][1][0]
    if len(structures) == 1 and first[0] == "shard":
        return NotExpressible(_uneven_reason(groups, first[1], shape[first[1]]))
    if first[0] == "strided_shard":
        rank = next(r for r in holders if len(coverage[r]) > 1)
        return NotExpressible(f"rank {rank} holds {len(coverage[rank])} disjoint boxes along dim {first[1]} "
                              f"that {placement_str(first)} over {len(groups)} ranks does not give")
    pl = ", ".join(f"[{', '.join(placement_str(p) for p in s[1])}]" for s in structures)
    return NotExpressible(f"{len(groups)} distinct shards; torch's split rules for {pl} give other boxes")


# --------------------------------------------------------------------------- public API


def dtensor_form(side: SideLayout, canonical: str) -> Form:
    """The DTensor form of ``canonical`` on ``side``, or why there is none.

    The mesh holds exactly the ranks with a piece of the tensor; distinct shards are laid out
    by torch's rules, replicas become ``Replicate()`` mesh dims (outer, or inner when that lists
    the ranks in order, e.g. vLLM KV heads shared by neighbouring TP ranks).
    """
    if canonical not in side.tensors:
        raise LayoutError(f"{canonical!r} is not a tensor of side {side.name!r}")
    held = _holdings(side, {canonical}).get(canonical, {})
    return _form_from_holdings(held, tuple(side.tensors[canonical][0]))


def dtensor_forms(side: SideLayout) -> dict[str, Form]:
    """Every canonical tensor's form, in ``side.tensors`` order (one pass over the pieces)."""
    held, values = _box_ids_held(side)
    # A form depends on the holdings and the shape only: the layers of a model repeat a few of
    # them thousands of times (experts x layers), so each distinct one is worked out once.
    seen: dict[tuple, Form] = {}
    out = {}
    for name, (shape, _) in side.tensors.items():
        key = (tuple(shape), frozenset(held.get(name, ())))
        form = seen.get(key)
        if form is None:
            boxes: dict[int, set[Box]] = {}
            for code in key[1]:
                r, i = divmod(code, _RANK_CODE)
                boxes.setdefault(r, set()).add(values[i])
            form = seen[key] = _form_from_holdings(boxes, tuple(shape))
        out[name] = form
    return out


#: ``rank * _RANK_CODE + box index``: one int per (rank, box) held (box indices stay below it).
_RANK_CODE = 1 << 40
_CANONICAL, _BOX = operator.attrgetter("canonical"), operator.attrgetter("box")


def _box_ids_held(side: SideLayout) -> tuple[dict[str, list[int]], list[Box]]:
    """``_holdings`` as ints: per tensor, ``rank * _RANK_CODE + box index`` of every piece,
    each box the index of its value in the list returned (``memo.ValueIds``: a value is
    hashed once per Box object, not once per piece). A full-size side has ~300k pieces: one
    append each, the rest C-level per local tensor."""
    ids = ValueIds()
    held: dict[str, list[int]] = {}
    get = held.get
    for p in side.params:
        pieces, base = p.pieces, p.rank * _RANK_CODE
        for name, i in zip(map(_CANONICAL, pieces), ids.many(map(_BOX, pieces))):
            codes = get(name)
            if codes is None:
                codes = held[name] = []
            codes.append(base + i)
    return held, ids.values


def dtensor_report(side: SideLayout) -> dict[str, str]:
    """canonical -> ``mesh (2, 4) [Replicate(), Shard(0)]`` or ``not expressible: <reason>``."""
    text: dict[int, str] = {}  # by form: the layers share a few forms (``dtensor_forms``)
    out = {}
    for name, form in dtensor_forms(side).items():
        s = text.get(id(form))
        if s is None:
            s = text[id(form)] = str(form)
        out[name] = s
    return out


def dtensor_summary(report: Mapping[str, str]) -> str:
    """One line for the plan report: how many tensors have a DTensor form."""
    bad = [name for name, s in report.items() if s.startswith("not expressible")]
    line = f"dtensor form: {len(report) - len(bad)} of {len(report)} tensors expressible"
    if bad:
        line += f"; {len(bad)} not (first: {bad[0]}: {report[bad[0]][len('not expressible: '):]})"
    return line
