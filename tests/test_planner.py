"""Planner unit tests on library-free layouts: coverage, minimal bytes, balance, buckets, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_reshard.layout import Box, LocalParam, Piece, SideLayout, View
from mcore_reshard.transport.views import materialize_local
from mcore_reshard.plan import PlanError, build_plan, get_plan, layout_digest, plan_report
from mcore_reshard.testing.local_plan import run_plan_locally
from toy_layouts import split_layout

TENSORS = {
    "a.weight": ((12, 8), "float32"),
    "b.weight": ((8,), "float32"),
    "c.weight": ((6, 4, 4), "float32"),
}


def simulate(src: SideLayout, dst: SideLayout, plan, seed: int = 0) -> None:
    """Materialise sources, run the plan in-process, compare every destination bit for bit."""
    g = torch.Generator().manual_seed(seed)
    canon = {n: torch.randn(s, generator=g) for n, (s, _) in src.tensors.items()}
    src_t = {r: {} for r in range(src.world_size)}
    for p in src.params:
        src_t[p.rank][p.name] = materialize_local(p, canon)
    dst_t = {r: {} for r in range(dst.world_size)}
    for p in dst.params:
        dst_t[p.rank][p.name] = torch.zeros(p.shape)  # padding is zero-filled locally
    moved = run_plan_locally(plan, src_t, dst_t)
    assert moved == plan.bytes_planned == plan.bytes_min
    for p in dst.params:
        assert torch.equal(dst_t[p.rank][p.name], materialize_local(p, canon)), (p.rank, p.name)


def test_reshard_rows_to_columns_with_replicas_and_padding():
    src = split_layout(TENSORS, parts=2, dim=0, replicas=3)
    dst = split_layout(TENSORS, parts=4, dim=1, replicas=2, pad_rows=1)
    plan = build_plan(src, dst, bucket_bytes=64)
    simulate(src, dst, plan)
    rep = plan_report(plan)
    assert rep.bytes_planned == rep.bytes_min == 2 * (96 + 8 + 96) * 4
    assert rep.bytes_hf_broadcast == 8 * (96 + 8 + 96) * 4
    assert rep.padding_elements == sum(p.padding for p in dst.params) > 0
    # every bucket respects the budget on both ends
    for b in range(plan.num_buckets):
        sent, recv = {}, {}
        for t in plan.transfers:
            if t.bucket == b:
                sent[t.src] = sent.get(t.src, 0) + t.nbytes
                recv[t.dst] = recv.get(t.dst, 0) + t.nbytes
        assert max(sent.values()) <= 64 and max(recv.values()) <= 64


def test_senders_balanced_across_replicas():
    src = split_layout(TENSORS, parts=1, dim=0, replicas=4)
    dst = split_layout(TENSORS, parts=2, dim=0, replicas=4)
    plan = build_plan(src, dst, bucket_bytes=1 << 20)
    send = plan.send_bytes()
    assert all(b > 0 for b in send), send
    assert max(send) <= 1.5 * (sum(send) / len(send))


def test_identical_layouts_are_one_transfer_per_piece():
    # Identical row splits on both sides: each destination piece is one whole transfer from
    # the source rank holding the same rows.
    src = split_layout({"w": ((16, 4), "float32")}, parts=4, dim=0)
    dst = split_layout({"w": ((16, 4), "float32")}, parts=4, dim=0)
    plan = build_plan(src, dst, bucket_bytes=1 << 20)
    assert len(plan.transfers) == 4
    assert all(t.src == t.dst for t in plan.transfers)


def test_merge_adjacent_boxes_from_same_sender():
    # One source rank holds the tensor as two pieces (like [gate; up] halves) in one local tensor.
    shape = (8, 4)
    view_a = View(0, (4, 4), (4, 1))
    view_b = View(16, (4, 4), (4, 1))
    pieces = (Piece(0, "fused", "w", Box((0, 0), (4, 4)), view_a), Piece(0, "fused", "w", Box((4, 0), (4, 4)), view_b))
    src = SideLayout("s", 1, (LocalParam(0, "fused", shape, "float32", pieces),), {"w": (shape, "float32")})
    dst = split_layout({"w": (shape, "float32")}, parts=1, dim=0)
    plan = build_plan(src, dst, bucket_bytes=1 << 20)
    assert len(plan.transfers) == 1
    assert plan.transfers[0].box == Box((0, 0), (8, 4))
    simulate(src, dst, plan)


def test_oversize_transfer_is_split_to_budget():
    src = split_layout({"w": ((64, 16), "float32")}, parts=1, dim=0)
    dst = split_layout({"w": ((64, 16), "float32")}, parts=1, dim=0)
    plan = build_plan(src, dst, bucket_bytes=1024)
    assert all(t.nbytes <= 1024 for t in plan.transfers)
    assert plan.num_buckets == 4
    simulate(src, dst, plan)


def test_deterministic_and_cached():
    src = split_layout(TENSORS, parts=2, dim=0, replicas=2)
    dst = split_layout(TENSORS, parts=2, dim=1, replicas=3)
    a = build_plan(src, dst, bucket_bytes=128)
    b = build_plan(src, dst, bucket_bytes=128)
    assert a.transfers == b.transfers and a.digest() == b.digest()
    c1 = get_plan(src, dst, bucket_bytes=128)
    c2 = get_plan(src, dst, bucket_bytes=128)
    assert c1 is c2
    other = split_layout(TENSORS, parts=2, dim=0, replicas=3)
    assert layout_digest(other) != layout_digest(src)
    assert get_plan(other, dst, bucket_bytes=128) is not c1


def test_rank_slice_matches_global_plan():
    src = split_layout(TENSORS, parts=2, dim=0, replicas=2)
    dst = split_layout(TENSORS, parts=4, dim=1)
    plan = build_plan(src, dst, bucket_bytes=96)
    for r in range(dst.world_size):
        mine = plan.for_rank("dst", r)
        assert mine.transfers == tuple(t for t in plan.transfers if t.dst == r)
        assert sum(len(v) for b in mine.buckets() for v in b.values()) == len(mine.transfers)


def test_gap_in_sources_is_named():
    src = split_layout(TENSORS, parts=2, dim=0)
    params = tuple(p for p in src.params if not (p.rank == 1 and p.name == "local.a.weight"))
    src = dataclasses.replace(src, params=params)
    dst = split_layout(TENSORS, parts=1, dim=0)
    with pytest.raises(PlanError, match=r"a\.weight.*held by no rank"):
        build_plan(src, dst)


def test_overlapping_sources_are_named():
    shape = (8, 4)
    p0 = Piece(0, "x", "w", Box((0, 0), (6, 4)), View(0, (6, 4), (4, 1)))
    p1 = Piece(1, "x", "w", Box((4, 0), (4, 4)), View(0, (4, 4), (4, 1)))
    src = SideLayout("s", 2, (LocalParam(0, "x", (6, 4), "float32", (p0,)), LocalParam(1, "x", (4, 4), "float32", (p1,))),
                     {"w": (shape, "float32")})
    dst = split_layout({"w": (shape, "float32")}, parts=1, dim=0)
    with pytest.raises(PlanError, match="w: source boxes do not tile"):
        build_plan(src, dst)


def test_destination_overlap_is_named():
    shape = (4, 4)
    a = Piece(0, "d", "w", Box((0, 0), (4, 4)), View(0, (4, 4), (4, 1)))
    b = Piece(0, "d", "w", Box((0, 0), (2, 4)), View(4, (2, 4), (4, 1)))
    dst = SideLayout("d", 1, (LocalParam(0, "d", (4, 4), "float32", (a, b)),), {"w": (shape, "float32")})
    src = split_layout({"w": (shape, "float32")}, parts=1, dim=0)
    with pytest.raises(PlanError, match="d \\(rank 0\\)"):
        build_plan(src, dst)


def test_shape_and_dtype_mismatch_named_before_planning():
    src = split_layout({"w": ((8, 4), "float32")}, parts=1, dim=0)
    dst = split_layout({"w": ((8, 8), "float32")}, parts=1, dim=0)
    with pytest.raises(PlanError, match=r"w: source shape \(8, 4\) != destination shape \(8, 8\)"):
        build_plan(src, dst)
    dst16 = split_layout({"w": ((8, 4), "bfloat16")}, parts=1, dim=0)
    with pytest.raises(PlanError, match="no explicit cast"):
        build_plan(src, dst16)


@pytest.mark.slow  # a subprocess
def test_planning_imports_neither_megatron_nor_vllm_nor_torch():
    """Full-size plans are computed from metadata anywhere: the whole metadata path (specs,
    both rule sets, planner, report, DTensor forms) must not pull in the heavy libraries."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from mcore_reshard.settings.config import resolve_model\n"
        "from mcore_reshard.adapters.megatron import MegatronParallel, megatron_layout\n"
        "from mcore_reshard.adapters.vllm import VllmParallel, vllm_layout\n"
        "from mcore_reshard.layout import dtensor_report\n"
        "from mcore_reshard.plan import build_plan, plan_report\n"
        "spec = resolve_model('qwen3-8b')\n"
        "src, dst = megatron_layout(spec, MegatronParallel(tp=2, dp=2)), vllm_layout(spec, VllmParallel(tp=4))\n"
        "plan_report(build_plan(src, dst)); dtensor_report(dst)\n"
        "print(sorted(m for m in ('torch', 'megatron', 'vllm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_rows_larger_than_the_budget_are_split_inside_the_row():
    src = split_layout({"w": ((4, 64), "float32")}, parts=1, dim=0)
    dst = split_layout({"w": ((4, 64), "float32")}, parts=1, dim=0)
    plan = build_plan(src, dst, bucket_bytes=100)  # one row is 256 bytes
    assert all(t.nbytes <= 100 for t in plan.transfers)
    assert plan.bytes_planned == plan.bytes_min
    simulate(src, dst, plan)


def test_digest_covers_element_type():
    t32 = {"w": ((8, 4), "float32")}
    t16 = {"w": ((8, 4), "bfloat16")}
    a = build_plan(split_layout(t32, parts=1, dim=0), split_layout(t32, parts=1, dim=0))
    b = build_plan(split_layout(t16, parts=1, dim=0), split_layout(t16, parts=1, dim=0))
    assert a.dtype == "float32" and b.dtype == "bfloat16"
    assert a.digest() != b.digest()
    assert a.for_rank("dst", 0).digest() != b.for_rank("dst", 0).digest()


def test_local_param_dtype_must_match_its_tensor():
    src = split_layout({"w": ((8, 4), "float32")}, parts=1, dim=0)
    dst = split_layout({"w": ((8, 4), "float32")}, parts=1, dim=0)
    bad = dataclasses.replace(dst.params[0], dtype="bfloat16")
    dst = dataclasses.replace(dst, params=(bad,))
    with pytest.raises(PlanError, match="holds bfloat16 but w is float32"):
        build_plan(src, dst)


def test_passes_add_records_and_never_change_a_plan(monkeypatch):
    """A pass's record is a new plan (the old one keeps its digest and slices), one record per
    pass, hashed under its name after the schema version; a slice carries its records over
    the wire under the same names, and a record of an unknown pass is refused."""
    from mcore_reshard.plan import PLAN_SCHEMA, Colocated
    from mcore_reshard.plan.types import plan_digest
    from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire

    src = split_layout(TENSORS, parts=2, dim=0)
    dst = split_layout(TENSORS, parts=2, dim=1)
    plan = build_plan(src, dst, bucket_bytes=64)
    assert plan.extensions == () and PLAN_SCHEMA == 2
    before, slice0 = plan.digest(), plan.for_rank("src", 0)
    placed = plan.extended(Colocated(((0, 0), (1, 1))))
    assert plan.digest() == before and plan.for_rank("src", 0) == slice0 and plan.same_device == ()
    assert placed.same_device == ((0, 0), (1, 1)) and placed.digest() != before
    assert placed.transfers is plan.transfers and placed.get("placement") == Colocated(((0, 0), (1, 1)))
    assert placed.extended(Colocated(((0, 1),))).same_device == ((0, 1),)  # replaced, not added
    s = placed.for_rank("dst", 1)
    assert s.same_device == (1,) and s.transfers == plan.for_rank("dst", 1).transfers
    wire = slice_to_wire(s)
    assert wire["extensions"] == {"placement": [1]} and slice_from_wire(wire) == s
    # the schema version is hashed first: the same transfers under another schema never match
    from mcore_reshard.plan import types

    assert plan_digest(plan.transfers, plan.num_buckets, plan.dtype) == before
    monkeypatch.setattr(types, "PLAN_SCHEMA", 1)
    assert plan_digest(plan.transfers, plan.num_buckets, plan.dtype) != before
    monkeypatch.undo()
    with pytest.raises(PlanError, match="unknown passes \\['stripes'\\]"):
        slice_from_wire(dict(wire, extensions={"stripes": [0]}))
    with pytest.raises(ValueError, match="one record per pass"):
        dataclasses.replace(plan, extensions=(Colocated(((0, 0),)), Colocated(((1, 1),)))).digest()
