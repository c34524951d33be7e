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
