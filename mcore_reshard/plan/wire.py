"""Plan slices as plain JSON-able values, for the control plane (never pickled).

A slice is shipped once per layout from the driver to the rank that runs it; refits then
name it by digest. The receiving rank decodes it and re-hashes it: what it runs is provably
the slice the driver cut from the plan every rank agreed on.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..layout.descriptor import Box, View
from .extensions import SLICE_RECORDS
from .types import PlanError, RankPlan, Transfer

__all__ = ["slice_to_wire", "slice_from_wire"]


def _view(v: View) -> list:
    return [v.offset, list(v.shape), list(v.stride)]


def _unview(d: list) -> View:
    return View(int(d[0]), tuple(d[1]), tuple(d[2]))


def slice_to_wire(s: RankPlan) -> dict[str, Any]:
    """``RankPlan`` -> JSON-able dict; tensor names are interned in a table (slices repeat
    the same few hundred names thousands of times)."""
    names: dict[str, int] = {}

    def nid(n: str) -> int:
        return names.setdefault(n, len(names))

    rows = [[t.src, t.dst, nid(t.canonical), list(t.box.offsets), list(t.box.sizes), nid(t.src_name),
             _view(t.src_view), nid(t.dst_name), _view(t.dst_view), t.nbytes, t.bucket] for t in s.transfers]
    out = {"side": s.side, "rank": s.rank, "num_buckets": s.num_buckets, "dtype": s.dtype,
           "names": list(names), "transfers": rows, "digest": s.digest()}
    if s.extensions:  # each pass's record under its name
        out["extensions"] = {record.name: record.to_wire() for record in s.extensions}
    return out


def slice_from_wire(d: Mapping[str, Any]) -> RankPlan:
    """Decode and check: the slice must hash to the digest it was sent with."""
    names = d["names"]
    transfers = tuple(
        Transfer(int(r[0]), int(r[1]), names[r[2]], Box(tuple(r[3]), tuple(r[4])), names[r[5]], _unview(r[6]),
                 names[r[7]], _unview(r[8]), int(r[9]), int(r[10]))
        for r in d["transfers"])
    records = d.get("extensions") or {}
    unknown = sorted(set(records) - set(SLICE_RECORDS))
    if unknown:
        raise PlanError(f"{d['side']} rank {d['rank']}: the plan slice carries records of unknown passes {unknown}")
    s = RankPlan(str(d["side"]), int(d["rank"]), int(d["num_buckets"]), transfers, str(d["dtype"]),
                 tuple(SLICE_RECORDS[name].from_wire(value) for name, value in records.items()))
    if s.digest() != d["digest"]:
        raise PlanError(f"{s.side} rank {s.rank}: the plan slice received does not hash to its digest "
                        f"({s.digest()} != {d['digest']})")
    return s
