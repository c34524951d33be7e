"""Fan-out relays over real gloo groups: the training ranks on node 0 send each box into node 1
once; there, each group of identical inference ranks spreads the boxes over its members, who
forward them to each other. Every destination holds exactly its descriptors' bytes, checksums
pass on every rank, and a write corrupted on one member is caught and named."""

from __future__ import annotations

import math
import traceback
from typing import Any

import pytest
import torch

from mcore_reshard.plan.placed import RankPlacement, placement_report, plan_for_placement, relay_groups
from mcore_reshard.infra.ports import free_port
from mcore_reshard.transport.group import RankMap, RefitGroup
from support.worlds import T, refit_once, ship, spawn_ranks
from mcore_reshard.wire.faults import Fault
from toy_layouts import split_layout

NUM_SRC, PARTS, REPLICAS = 2, 2, 2


def _run_rank(rank: int, world: int, port: int, q: Any, num_src: int, num_dst: int, body) -> None:
    """A spawned rank: join the refit group (sources first, then destinations), run
    ``body(rank map, source rank, destination rank, group)`` and ship its result -- or the
    traceback of any failure -- to the parent."""
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        rm = RankMap.disaggregated(num_src, num_dst)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm)
        out = body(rm, s_rank, d_rank, group)
        group.close()
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out = {"crash": traceback.format_exc()}
    ship(q, rank, out)


def _layouts():
    src = split_layout(T, parts=NUM_SRC, dim=0)
    dst = split_layout(T, parts=PARTS, dim=1, replicas=REPLICAS, pad_rows=1)  # rank r*PARTS + p
    place = RankPlacement.separate(NUM_SRC, PARTS * REPLICAS, gpus_per_node=8)  # all inference ranks on node 1
    plan = plan_for_placement(src, dst, place, bucket_bytes=96)
    return src, dst, place, plan


def test_relay_plan_sends_each_box_into_the_node_once():
    src, dst, place, plan = _layouts()
    assert relay_groups(dst, place) == ((0, 2), (1, 3)) == plan.relay_groups
    rep = placement_report(plan, src, dst, place)
    one_copy = sum(math.prod(s) * 4 for s, _ in T.values())
    assert rep.bytes_inter_node == rep.bytes_inter_node_min == one_copy == sum(plan.send_bytes())
    assert rep.bytes_intra_node == one_copy  # each member forwards its share to the other
    assert plan.bytes_planned == plan.bytes_min == REPLICAS * one_copy
    for g in plan.relay_groups:  # the members split the group's bytes over the fabric
        direct = [sum(t.nbytes for t in plan.transfers if t.dst == m) for m in g]
        assert min(direct) > 0
    # every member's slice holds every box of its group, each once
    for g in plan.relay_groups:
        boxes = [sorted((t.canonical, t.box.offsets) for t in plan.for_rank("dst", m).transfers) for m in g]
        assert boxes[0] == boxes[1] and len(set(boxes[0])) == len(boxes[0])


def _relay_main(rank: int, world: int, port: int, q: Any) -> None:
    def body(rm, s_rank, d_rank, group):
        src, dst, place, plan = _layouts()
        return {"ok": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=3),
                "flip": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=4,
                                   fault=Fault("bitflip", tensor="local.a") if d_rank == 2 else None)}

    _run_rank(rank, world, port, q, NUM_SRC, PARTS * REPLICAS, body)


@pytest.mark.slow
def test_relayed_refit_writes_every_member_and_catches_a_bad_write():
    world = NUM_SRC + PARTS * REPLICAS
    res = spawn_ranks(_relay_main, world, free_port())
    one_copy = sum(math.prod(s) * 4 for s, _ in T.values())
    ok = {r: res[r]["ok"] for r in range(world)}
    for r in range(NUM_SRC, world):
        assert ok[r]["err"] is None and ok[r]["bad"] == [], (r, ok[r])
        assert ok[r]["stats"].verified
    # the sources sent one copy in all; each member received half of the model (its TP half),
    # part from the sources and part from its group peer
    assert sum(ok[r]["stats"].bytes_sent for r in range(NUM_SRC)) == one_copy
    assert sum(ok[r]["stats"].bytes_received for r in range(NUM_SRC, world)) == REPLICAS * one_copy
    assert all(ok[r]["stats"].bytes_sent > 0 for r in range(NUM_SRC, world))  # every member forwards

    # destination rank 2 (group rank 4) corrupts one write of what its peer forwarded or it got itself
    err = res[4]["flip"]["err"]
    assert err is not None and "checksum mismatch" in err and "local.a" in err, err
    assert res[4]["flip"]["bad"] == ["local.a"]
    for r in range(world):
        if r != 4:
            assert res[r]["flip"]["err"] is None, (r, res[r]["flip"])


def _moe_layouts():
    from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
    from mcore_reshard.plan.placed import Location
    from toy_layouts import tiny_spec

    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    dst = vllm_layout(spec, VllmParallel(tp=1, replicas=2))
    place = RankPlacement((Location(0, 0), Location(0, 1)), (Location(1, 0), Location(1, 1)), gpus_per_node=2)
    return src, dst, plan_for_placement(src, dst, place, bucket_bytes=1 << 15)


def _moe_main(rank: int, world: int, port: int, q: Any) -> None:
    def body(rm, s_rank, d_rank, group):
        src, dst, plan = _moe_layouts()
        return refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=5, tensors=src.tensors)

    _run_rank(rank, world, port, q, 2, 2, body)


@pytest.mark.slow
def test_both_members_relay_in_one_bucket():
    """Two identical workers that each get part of every bucket from the trainers and the rest
    from each other: each forwards its direct messages before waiting for the other's (waiting
    for everything first would deadlock)."""
    src, dst, plan = _moe_layouts()
    assert plan.relay_groups == ((0, 1),)
    both = [k for k in range(plan.num_buckets) if {t.dst for t in plan.transfers if t.bucket == k} == {0, 1}]
    assert both  # the case that needs the order
    res = spawn_ranks(_moe_main, 4, free_port())
    for r in (2, 3):
        assert res[r]["err"] is None, res[r]["err"]
        assert res[r]["bad"] == [] and res[r]["stats"].verified and res[r]["stats"].bytes_sent > 0


# ---------------------------------------------------------------- piece-level relays
# An engine of TP2 replicates some pieces over its two ranks (norms, the router, q/k norms);
# with two such engines on a node, rank-level groups {0, 2}, {1, 3} alone would take those
# pieces into the node twice. Piece-level relays take them once, into one holder, which
# forwards them to all three others.


def _tp2_layouts(nkv: int = 2):
    from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
    from toy_layouts import tiny_spec

    spec = tiny_spec(moe=True, nkv=nkv)
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    dst = vllm_layout(spec, VllmParallel(tp=2, replicas=2))
    place = RankPlacement.separate(src.world_size, dst.world_size, gpus_per_node=4)  # node 0 trains, node 1 serves
    return src, dst, place, plan_for_placement(src, dst, place, bucket_bytes=1 << 13)


def _full_bytes(layout, itemsize: int) -> int:
    return sum(math.prod(s) for s, _ in layout.tensors.values()) * itemsize


@pytest.mark.parametrize("nkv", [2, 1])  # nkv=1: the KV head is replicated over the TP ranks too
def test_replicated_pieces_cross_into_a_node_once(nkv):
    from mcore_reshard.plan import get_plan
    from mcore_reshard.transport.executor import zero_fill_padding
    from mcore_reshard.testing.local_plan import run_plan_locally
    from support.worlds import canonical, expected_equal, locals_of

    src, dst, place, plan = _tp2_layouts(nkv)
    assert relay_groups(dst, place) == ((0, 2), (1, 3))
    assert plan.relay_groups == ((0, 1, 2, 3), (0, 2), (1, 3))  # + the pieces all four hold
    shared = {t.canonical for t, g in zip(plan.transfers, plan.relay_of) if g == 0}
    assert "model.norm.weight" in shared and any("input_layernorm" in n for n in shared)
    assert not any("experts" in n for n in shared)  # sharded: one group per TP rank
    rep = placement_report(plan, src, dst, place)
    one_copy = _full_bytes(dst, plan.itemsize)
    assert rep.bytes_inter_node == rep.bytes_inter_node_min == one_copy == sum(plan.send_bytes())
    assert plan.bytes_planned == plan.bytes_min
    # without piece-level groups the replicated pieces would cross twice
    direct = placement_report(get_plan(src, dst, bucket_bytes=1 << 13, placement=place), src, dst, place)
    assert direct.bytes_inter_node > rep.bytes_inter_node
    # every member's slice holds each of its boxes once; forwarded ones included, every rank
    # receives at most one budget per bucket
    for r in range(dst.world_size):
        mine = plan.for_rank("dst", r)
        keys = [(t.dst_name, t.canonical, t.box.offsets, t.box.sizes) for t in mine.transfers]
        assert len(set(keys)) == len(keys)
        assert sum(t.nbytes for t in mine.transfers) == sum(p.numel - p.padding for p in dst.for_rank(r)) * 4
        per_bucket = [0] * plan.num_buckets
        for t in mine.transfers:
            per_bucket[t.bucket] += t.nbytes
        assert max(per_bucket) <= plan.bucket_bytes
    # executed in one process: every destination holds exactly its descriptors' elements
    canon = canonical(src.tensors, seed=9)
    s = {r: locals_of(src, r, canon) for r in range(src.world_size)}
    d = {r: locals_of(dst, r, None) for r in range(dst.world_size)}
    assert run_plan_locally(plan, s, d) == plan.bytes_min
    for r in range(dst.world_size):
        zero_fill_padding(d[r], dst.for_rank(r))
        assert expected_equal(dst, r, canon, d[r]) == []


def _tp2_main(rank: int, world: int, port: int, q: Any) -> None:
    def body(rm, s_rank, d_rank, group):
        src, dst, place, plan = _tp2_layouts()
        # destination rank 3 corrupts its first write of the final norm, which all four hold
        # and one of the others receives over the fabric and forwards
        return {"ok": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=6, tensors=src.tensors),
                "flip": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=8, tensors=src.tensors,
                                   fault=Fault("bitflip", tensor="model.norm.weight") if d_rank == 3 else None)}

    _run_rank(rank, world, port, q, 2, 4, body)


@pytest.mark.slow
def test_piece_relayed_refit_over_gloo_writes_every_member_and_names_a_bad_forwarded_write():
    src, dst, place, plan = _tp2_layouts()
    norm = [t for t, g in zip(plan.transfers, plan.relay_of) if t.canonical == "model.norm.weight"]
    assert len(norm) == 1 and norm[0].dst != 3  # rank 3 gets it forwarded
    world = src.world_size + dst.world_size
    res = spawn_ranks(_tp2_main, world, free_port())
    rep = placement_report(plan, src, dst, place)
    for r in range(world):
        assert "crash" not in res[r], res[r].get("crash")
        ok = res[r]["ok"]
        assert ok["err"] is None and (ok["bad"] in (None, [])), (r, ok)
        assert ok["stats"].verified
    assert sum(res[r]["ok"]["stats"].bytes_sent for r in range(src.world_size)) == rep.bytes_inter_node
    assert sum(res[r]["ok"]["stats"].bytes_sent for r in range(src.world_size, world)) == rep.bytes_intra_node
    bad = res[src.world_size + 3]["flip"]
    assert bad["err"] is not None and "checksum mismatch" in bad["err"] and "model.norm.weight" in bad["err"], bad
    assert bad["bad"] == ["model.norm.weight"]
    for r in range(world):
        if r != src.world_size + 3:
            assert res[r]["flip"]["err"] is None, (r, res[r]["flip"])


def test_relay_message_tags_are_unique_per_pair():
    """Every message a rank can get from one peer in a refit has its own tag: plain ones are
    the bucket (checksums: the bucket count), relayed ones one per (bucket, group, sent or
    forwarded, source), relayed checksums one per (group, forwarding member); all below the
    zero-copy tags."""
    from mcore_reshard.plan.tags import message_tag as _msg_tag

    B, G, ranks = 5, 3, range(6)
    tags = [_msg_tag(B, G, k, -1) for k in range(B + 1)]
    tags += [_msg_tag(B, G, k, g) for k in range(B) for g in range(G)]
    tags += [_msg_tag(B, G, k, g, forwarded_from=s) for k in range(B) for g in range(G) for s in ranks]
    tags += [_msg_tag(B, G, B, g, forwarded_from=v) for g in range(G) for v in ranks]
    assert len(set(tags)) == len(tags) and max(tags) < 1 << 29 and min(tags) == 0


# ------------------------------------------------------- EPLB: a redundant copy is a holder
# One engine of DP4 x TP1 with EP and 4 redundant slots (8 experts, 12 slots) on node 1: rank 2
# holds expert 0 again in its last slot, rank 3 experts 1..3 in its slots. Each copy crosses into
# the node once; the member that did not receive it unpacks the forwarded bytes at its own slot.


def _eplb_layouts():
    from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
    from toy_layouts import tiny_spec

    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(tp=1, ep=2, dp=2))
    dst = vllm_layout(spec, VllmParallel(tp=1, dp=4, enable_ep=True, num_redundant_experts=4))
    place = RankPlacement.separate(src.world_size, dst.world_size, gpus_per_node=4)
    return src, dst, place, plan_for_placement(src, dst, place, bucket_bytes=1 << 13)


W2 = "model.layers.0.mlp.experts.routed_experts.w2_weight"  # vLLM's stack of the layer's down_projs


def _eplb_main(rank: int, world: int, port: int, q: Any) -> None:
    def body(rm, s_rank, d_rank, group):
        src, dst, _, plan = _eplb_layouts()
        # destination rank 2 corrupts its write of expert 0's down_proj, which it holds in its
        # last slot (offset 2 x 16 x 8) as a copy of rank 0's first
        return {"ok": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=21, tensors=src.tensors),
                "flip": refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed=22, tensors=src.tensors,
                                   fault=Fault("bitflip", tensor=W2, offset=2 * 16 * 8) if d_rank == 2 else None)}

    _run_rank(rank, world, port, q, 2, 4, body)


@pytest.mark.slow
def test_redundant_expert_copies_relayed_over_gloo_land_in_their_own_slots():
    src, dst, place, plan = _eplb_layouts()
    rep = placement_report(plan, src, dst, place)
    assert plan.relay_sites and rep.bytes_inter_node == rep.bytes_inter_node_min
    world = src.world_size + dst.world_size
    res = spawn_ranks(_eplb_main, world, free_port())
    for r in range(world):
        assert "crash" not in res[r], res[r].get("crash")
        ok = res[r]["ok"]
        assert ok["err"] is None and ok["bad"] in (None, []), (r, ok)
        assert ok["stats"].verified
    assert sum(res[r]["ok"]["stats"].bytes_sent for r in range(src.world_size)) == rep.bytes_inter_node
    # rank 2 unpacks expert 0 at its own slot: the forwarded or received copy is checked there
    expert0 = "model.layers.0.mlp.experts.0.down_proj.weight"
    mine = [t for t in plan.for_rank("dst", 2).transfers if t.canonical == expert0]
    assert [(t.dst_name, t.dst_view.offset) for t in mine] == [(W2, 2 * 16 * 8)]
    bad = res[src.world_size + 2]["flip"]
    assert bad["err"] is not None and "checksum mismatch" in bad["err"] and "experts.0.down_proj" in bad["err"], bad
    assert bad["bad"] == [W2]
    for r in range(world):
        if r != src.world_size + 2:
            assert res[r]["flip"]["err"] is None, (r, res[r]["flip"])
