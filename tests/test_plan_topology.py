"""Locations in the plan: bytes per link class, the one-copy-per-node floor, modelled time."""

from __future__ import annotations

import json
import math

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.cli import main
from mcore_reshard.errors import ConfigError
from mcore_reshard.layout import Box
from mcore_reshard.plan import get_plan
from mcore_reshard.plan.planner import build_plan
from mcore_reshard.plan.topology import (
    LINK_CLASSES,
    Links,
    Location,
    Placement,
    TopologyConfig,
    _covered,
    hf_ipc_bytes,
    inter_node_minimum,
    placement_report,
    plan_for_placement,
)

from toy_layouts import tiny_spec


def _full_bytes(side, itemsize: int) -> int:
    return sum(math.prod(shape) for shape, _ in side.tensors.values()) * itemsize


def test_covered_counts_a_union_minus_another():
    a, b = Box((0, 0), (4, 4)), Box((2, 2), (4, 4))
    assert _covered([a]) == 16 and _covered([a, a]) == 16
    assert _covered([a, b]) == 16 + 16 - 4
    assert _covered([a, b], [Box((0, 0), (2, 8))]) == 28 - 8
    assert _covered([a], [a]) == 0


def test_placements_and_link_classes():
    sep = Placement.separate(10, 4, gpus_per_node=8)
    assert sep.src[9] == Location(1, 1) and sep.dst[0] == Location(2, 0)  # engines start on a fresh node
    assert sep.link(0, 0) == "inter_node"
    col = Placement.colocated(4, 4, gpus_per_node=2)
    assert [col.link(0, d) for d in range(4)] == ["same_device", "intra_node", "inter_node", "inter_node"]
    with pytest.raises(ConfigError, match="topology.placement=colocated needs as many"):
        TopologyConfig(placement="colocated").place(4, 2)
    with pytest.raises(ConfigError, match="topology.placement='ring'"):
        TopologyConfig(placement="ring")
    with pytest.raises(ConfigError, match="topology.inter_node_gbps=0"):
        TopologyConfig(inter_node_gbps=0)


def test_separate_nodes_floor_is_one_copy_per_inference_node():
    """4 trainers on node 0; 4 engines of TP2 on nodes 1-2 (2 engines per node): everything
    crosses the fabric, the floor is one full model per inference node."""
    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1, dp=2))
    dst = vllm_layout(spec, VllmParallel(tp=2, replicas=4))
    plan = get_plan(src, dst, bucket_bytes=1 << 16)
    place = Placement.separate(src.world_size, dst.world_size, gpus_per_node=4)
    rep = placement_report(plan, src, dst, place, Links(450, 50))
    full = _full_bytes(dst, plan.itemsize)
    assert rep.bytes_inter_node == plan.bytes_planned == plan.bytes_min and rep.bytes_intra_node == 0
    assert rep.bytes_inter_node_min == 2 * full == inter_node_minimum(src, dst, place, plan.itemsize)
    recv = plan.recv_bytes()
    assert rep.busiest_inter_node == max(max(recv), max(plan.send_bytes()))
    assert rep.modelled_seconds == pytest.approx(rep.busiest_inter_node / 50e9, rel=1e-6)
    assert rep.bytes_hf_ipc == hf_ipc_bytes(dst, plan.itemsize) == dst.world_size * full
    assert sum(getattr(rep, f"bytes_{c}") for c in LINK_CLASSES) == plan.bytes_planned


def test_colocated_floor_is_zero_where_a_node_trains_the_whole_model():
    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(tp=1, ep=4, dp=8))  # EP4 x DP8: every node of 4 holds it all
    dst = vllm_layout(spec, VllmParallel(tp=2, replicas=4))
    plan = get_plan(src, dst, bucket_bytes=1 << 16)
    place = TopologyConfig(gpus_per_node=4, placement="colocated").place(8, 8)
    rep = placement_report(plan, src, dst, place)
    assert rep.bytes_inter_node_min == 0
    assert sum(getattr(rep, f"bytes_{c}") for c in LINK_CLASSES) == plan.bytes_planned


def test_plan_cli_reports_bytes_per_class(capsys):
    assert main(["plan", "model=qwen3-8b", "training.tp=2", "training.ep=1", "training.pp=1", "training.dp=1",
                 "training.layer_spec=local", "training.experts=sequential", "vllm.tp=1", "vllm.replicas=4",
                 "topology.gpus_per_node=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("bytes_same_device", "bytes_intra_node", "bytes_inter_node", "bytes_inter_node_min",
                "modelled_seconds", "busiest_rank_bytes", "bytes_hf_ipc"):
        assert key in out
    assert out["bytes_same_device"] + out["bytes_intra_node"] + out["bytes_inter_node"] == out["bytes_planned"]
    assert out["nodes"] == {"training": 1, "inference": 2}
    assert main(["plan", "topology.placement=ring"]) == 2
    assert "topology.placement='ring'" in capsys.readouterr().err


def _same_device_max(src, dst, place, itemsize: int) -> int:
    """Bytes a destination rank can take from a trainer on its own device: its pieces'
    overlap with that trainer's boxes (each rank's boxes of a tensor are disjoint)."""
    held: dict[tuple[int, str], list[Box]] = {}
    for p in src.params:
        for q in p.pieces:
            held.setdefault((p.rank, q.canonical), []).append(q.box)
    total = 0
    for p in dst.params:
        mates = [s for s in range(len(place.src)) if place.link(s, p.rank) == "same_device"]
        for q in p.pieces:
            for s in mates:
                total += sum(i.numel for b in held.get((s, q.canonical), ()) if (i := q.box.intersect(b)) is not None)
    return total * itemsize


def test_senders_prefer_the_same_device_then_the_same_node():
    """Three trainers hold the whole model; the one on a worker's device sends it everything,
    a worker with no trainer on its device takes it from its node's trainers only (by load)."""
    from toy_layouts import split_layout

    T = {"a": ((12, 8), "float32"), "b": ((8,), "float32"), "c": ((6, 4, 4), "float32")}
    src = split_layout(T, parts=1, dim=0, replicas=3)
    dst = split_layout(T, parts=2, dim=0, replicas=2)  # ranks 0, 1: engine 0; 2, 3: engine 1
    L = Location
    place = Placement((L(0, 0), L(1, 0), L(1, 1)), (L(1, 1), L(1, 2), L(0, 3), L(2, 0)), gpus_per_node=4)
    plan = get_plan(src, dst, bucket_bytes=1 << 10, placement=place)
    senders = {d: {t.src for t in plan.transfers if t.dst == d} for d in range(4)}
    assert senders == {0: {2}, 1: {1, 2}, 2: {0}, 3: {0, 1, 2}}
    load = plan.send_bytes()
    assert load[0] > 0 and load[1] > 0  # load still spreads among equals
    assert placement_report(plan, src, dst, place).bytes_same_device == plan.recv_bytes()[0]
    # deterministic, and part of the cache key (no placement: the plan of old, bit for bit)
    again = build_plan(src, dst, bucket_bytes=1 << 10, link_cost=lambda s, d: LINK_CLASSES.index(place.link(s, d)))
    assert again.digest() == plan.digest()
    assert get_plan(src, dst, bucket_bytes=1 << 10).digest() == build_plan(src, dst, bucket_bytes=1 << 10).digest()
    assert get_plan(src, dst, bucket_bytes=1 << 10).digest() != plan.digest()


def test_colocated_replicas_move_everything_on_their_own_device():
    """megatron TP1 x DP4 -> 4 vLLM TP1 engines, colocated: every byte stays on its device."""
    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(dp=4))
    dst = vllm_layout(spec, VllmParallel(tp=1, replicas=4))
    place = Placement.colocated(4, 4, gpus_per_node=8)
    plan = plan_for_placement(src, dst, place, bucket_bytes=1 << 16)
    rep = placement_report(plan, src, dst, place)
    assert rep.bytes_same_device == plan.bytes_planned == plan.bytes_min
    assert rep.bytes_intra_node == rep.bytes_inter_node == 0 and not plan.relay_groups
    assert plan.same_device == ((0, 0), (1, 1), (2, 2), (3, 3))
    blind = placement_report(get_plan(src, dst, bucket_bytes=1 << 16), src, dst, place)
    assert blind.bytes_same_device < rep.bytes_same_device


def test_colocated_moe_plan_takes_every_same_device_byte():
    """NeMo RL's colocated shape, scaled down (EP4 x DP8 -> 4 engines of TP2 on 2 nodes of 4):
    the same-device bytes are the most there can be, planned bytes stay the minimum."""
    spec = tiny_spec(moe=True)
    src = megatron_layout(spec, MegatronParallel(tp=1, ep=4, dp=8))
    dst = vllm_layout(spec, VllmParallel(tp=2, replicas=4))
    place = TopologyConfig(gpus_per_node=4, placement="colocated").place(8, 8)
    plan = plan_for_placement(src, dst, place, bucket_bytes=1 << 16)
    rep = placement_report(plan, src, dst, place)
    assert plan.bytes_planned == plan.bytes_min
    assert rep.bytes_same_device == _same_device_max(src, dst, place, plan.itemsize)
    assert rep.bytes_inter_node == rep.bytes_inter_node_min == 0
    blind = placement_report(get_plan(src, dst, bucket_bytes=1 << 16), src, dst, place)
    assert blind.bytes_same_device < rep.bytes_same_device
