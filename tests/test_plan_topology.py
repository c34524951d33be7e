"""Locations in the plan: bytes per link class, the one-copy-per-node floor, modelled time."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.cli import main
from mcore_reshard.errors import ConfigError
from mcore_reshard.layout import Box
from mcore_reshard.plan import get_plan
from mcore_reshard.plan.floor import _covered
from mcore_reshard.plan.planner import build_plan
from mcore_reshard.plan.placed import (
    LINK_CLASSES,
    Links,
    Location,
    RankPlacement,
    hf_ipc_bytes,
    inter_node_minimum,
    placement_report,
    plan_for_placement,
)
from mcore_reshard.settings.topology import TopologyConfig

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
    sep = RankPlacement.separate(10, 4, gpus_per_node=8)
    assert sep.src[9] == Location(1, 1) and sep.dst[0] == Location(2, 0)  # engines start on a fresh node
    assert sep.link(0, 0) == "inter_node"
    col = RankPlacement.colocated(4, 4, gpus_per_node=2)
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
    place = RankPlacement.separate(src.world_size, dst.world_size, gpus_per_node=4)
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
    place = RankPlacement((L(0, 0), L(1, 0), L(1, 1)), (L(1, 1), L(1, 2), L(0, 3), L(2, 0)), gpus_per_node=4)
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
    place = RankPlacement.colocated(4, 4, gpus_per_node=8)
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


# ------------------------------------------------- relays: EPLB copies, bits-carried tensors


def _eplb_layouts(experts: int, redundant: int, dp: int):
    """megatron EP2 on node 0 -> one vLLM engine of DP``dp`` x TP1 with EP and ``redundant``
    EPLB slots on node 1: a redundant slot holds another rank's expert (or its own again)."""
    from mcore_reshard.adapters.vllm.rules import VllmParallel

    spec = tiny_spec(moe=True, experts=experts)
    src = megatron_layout(spec, MegatronParallel(tp=1, ep=2, dp=2))
    dst = vllm_layout(spec, VllmParallel(tp=1, dp=dp, enable_ep=True, num_redundant_experts=redundant))
    place = RankPlacement.separate(src.world_size, dst.world_size, gpus_per_node=dst.world_size)
    return src, dst, place


def _run_dst_slices(plan, src, dst, seed: int) -> dict:
    """Execute ``plan`` in one process as the ranks do: each source packs its messages, every
    receiver -- a relay group's members too -- unpacks them with the transfers of its own
    slice (``for_rank``), at its own places. Returns the destination locals."""
    import torch

    from mcore_reshard.transport.views import TORCH_DTYPES
    from mcore_reshard.transport.executor import zero_fill_padding
    from mcore_reshard.transport.packing import message_numel, pack, unpack
    from support.worlds import canonical, locals_of

    canon = canonical(src.tensors, seed=seed)
    s = {r: locals_of(src, r, canon) for r in range(src.world_size)}
    d = {r: locals_of(dst, r, None) for r in range(dst.world_size)}
    channels = {r: plan.for_rank("dst", r).channels() for r in range(plan.num_dst)}
    for rank in range(plan.num_src):
        for k, messages in enumerate(plan.for_rank("src", rank).messages()):
            for (to, g), ts in messages.items():
                msg = pack(ts, s[rank], torch.empty(message_numel(ts), dtype=TORCH_DTYPES[plan.dtype]))
                for m in plan.relay_groups[g] if g >= 0 else (to,):
                    mine = channels[m][k].pop((rank, to, g))
                    assert [(t.canonical, t.box) for t in mine] == [(t.canonical, t.box) for t in ts]
                    unpack(mine, msg, d[m])
    assert all(not c for per in channels.values() for c in per), "a receiver expects a message nobody sent"
    for r in range(dst.world_size):
        zero_fill_padding(d[r], dst.for_rank(r))
    return {"canon": canon, "dst": d}


def test_redundant_expert_copies_on_one_node_cross_into_it_once():
    """vLLM EPLB: 8 experts + 4 redundant slots over 4 EP ranks -- rank 2 holds expert 0 in
    its last slot, rank 3 experts 1..3. Each copy is a second holder of the same box: the box
    crosses into the node once and the holder forwards it, the other unpacks it at its slot."""
    from support.worlds import expected_equal

    src, dst, place = _eplb_layouts(experts=8, redundant=4, dp=4)
    plan = plan_for_placement(src, dst, place, bucket_bytes=1 << 13)
    rep = placement_report(plan, src, dst, place)
    assert plan.bytes_planned == plan.bytes_min
    assert rep.bytes_inter_node == rep.bytes_inter_node_min < placement_report(
        get_plan(src, dst, bucket_bytes=1 << 13, placement=place), src, dst, place).bytes_inter_node
    assert plan.relay_sites and not any("direct path" in n or "not used" in n for n in plan.notes)
    copies = {site[2] for box in plan.relay_sites for site in box}
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in copies
    assert len(copies) == 4 * 4 * 3  # experts 0..3 x 4 layers x gate, up, down
    # the copy's holders: rank 0 (slot 0) and rank 2 (slot 2) of the w2 stack
    (box,) = [b for b in plan.relay_sites if b[0][2] == "model.layers.0.mlp.experts.0.down_proj.weight"]
    assert [(r, v.offset != box[0][4].offset) for r, _, _, _, v in box] == [(0, False), (2, True)]
    # every member's slice lands each box at its own place, each once
    for r in range(dst.world_size):
        mine = plan.for_rank("dst", r).transfers
        keys = [(t.dst_name, t.dst_view.offset, t.canonical, t.box.offsets) for t in mine]
        assert len(set(keys)) == len(keys)
        assert sum(t.nbytes for t in mine) == sum(p.numel - p.padding for p in dst.for_rank(r)) * plan.itemsize
    out = _run_dst_slices(plan, src, dst, seed=11)
    for r in range(dst.world_size):
        assert expected_equal(dst, r, out["canon"], out["dst"][r]) == []
    # the members' places are part of the relays record's digest
    from dataclasses import replace

    assert plan.extended(replace(plan.get("relays"), sites=())).digest() != plan.digest()


def test_a_rank_holding_an_expert_twice_keeps_the_direct_path_and_says_so():
    """4 experts + 8 redundant slots over 2 EP ranks: rank 0 holds experts 0, 1 twice. The
    node's floor counts them once, no relay forwards to the rank itself: those tensors keep
    the direct path, the notes say which and why -- a performance miss, never a PlanError."""
    from support.worlds import expected_equal

    src, dst, place = _eplb_layouts(experts=4, redundant=8, dp=2)
    plan = plan_for_placement(src, dst, place, bucket_bytes=1 << 13)
    rep = placement_report(plan, src, dst, place)
    assert plan.bytes_planned == plan.bytes_min
    assert rep.bytes_inter_node > rep.bytes_inter_node_min
    (note,) = [n for n in plan.notes if "keep the direct path" in n]
    assert "destination rank 0 holds model.layers.0.mlp.experts.0." in note and "twice" in note
    assert "crosses into node 1 as" in note
    held_twice = {t.canonical for t in plan.transfers if ".experts.0." in t.canonical or ".experts.1." in t.canonical}
    assert held_twice and all(g < 0 for t, g in zip(plan.transfers, plan.relay_of) if t.canonical in held_twice)
    direct = placement_report(get_plan(src, dst, bucket_bytes=1 << 13, placement=place), src, dst, place)
    assert rep.bytes_inter_node < direct.bytes_inter_node  # experts 2, 3 (one copy per rank) still relayed
    out = _run_dst_slices(plan, src, dst, seed=12)
    for r in range(dst.world_size):
        assert expected_equal(dst, r, out["canon"], out["dst"][r]) == []


def test_relays_of_a_tensor_carried_as_its_bits_reach_every_member():
    """A tiny DeepSeek-V3 in bf16: its fp32 router bias travels as bf16 bits (boxes twice as
    wide on the wire). Two engines of TP2 on one node share the bias: relayed once, it must
    still reach all four ranks (it reached its first holder only, and the plan was refused
    for delivering fewer bytes than the destinations hold)."""
    from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3
    from mcore_reshard.layout.spec import spec_from_hf_config
    from mcore_reshard.transport.executor import zero_fill_padding
    from mcore_reshard.testing.local_plan import run_plan_locally
    from support.worlds import canonical, expected_equal, locals_of

    spec = spec_from_hf_config(TINY_DEEPSEEK_V3, dtype="bfloat16")
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    dst = vllm_layout(spec, VllmParallel(tp=2, replicas=2))
    place = RankPlacement.separate(src.world_size, dst.world_size, gpus_per_node=4)
    plan = plan_for_placement(src, dst, place, bucket_bytes=1 << 14)
    assert plan.reinterpret and plan.relay_groups
    rep = placement_report(plan, src, dst, place)
    assert plan.bytes_planned == plan.bytes_min and rep.bytes_inter_node == rep.bytes_inter_node_min
    bias = [g for t, g in zip(plan.transfers, plan.relay_of) if t.canonical in dict(plan.reinterpret)]
    assert bias and all(len(plan.relay_groups[g]) == 4 for g in bias)
    canon = canonical(src.tensors, seed=13)
    s = {r: locals_of(src, r, canon) for r in range(src.world_size)}
    d = {r: locals_of(dst, r, None) for r in range(dst.world_size)}
    assert run_plan_locally(plan, s, d) == plan.bytes_planned
    for r in range(dst.world_size):
        zero_fill_padding(d[r], dst.for_rank(r))
        assert expected_equal(dst, r, canon, d[r]) == []


def test_bucket_rounds_skip_rounds_without_room_at_once():
    """``assign_buckets``' skip list (``_first_fit``) places every part where the one-by-one scan
    does: a busy sender whose rounds are left just short of full by equal parts (the case
    that made a 2000-round plan take minutes), with charged relay members, and random ones."""
    import random

    from mcore_reshard.plan import buckets

    def scan(src, dst, nbytes, budget, num_src, num_dst, extra):
        levels, cur, full, out = [], [0] * (num_src + num_dst), budget - (budget >> 6), []
        for s, d, nb, more in zip(src, dst, nbytes, extra):
            ranks = (s, d + num_src) + tuple(m + num_src for m in (more or ()) if m != d)
            r = max(cur[k] for k in ranks)
            while True:
                if r == len(levels):
                    levels.append([0] * (num_src + num_dst))
                after = [levels[r][k] + nb for k in ranks]
                if all(a <= budget for a in after) or all(a == nb for a in after):
                    break
                r += 1
            for k, a in zip(ranks, after):
                levels[r][k] = a
                if a > full and r == cur[k]:
                    buckets._advance(cur, k, levels, full)
            out.append(r)
        return out

    rng = random.Random(7)
    budget = 64 * 42 - 1  # 41 parts of 64 leave a round of the sender just under its "full" mark, no room
    cases = [([0] * 5000, [rng.randrange(4) for _ in range(5000)], [64] * 5000, [None] * 5000)]
    for _ in range(20):
        n = rng.randrange(1, 800)
        src = [rng.randrange(3) for _ in range(n)]
        dst = [rng.randrange(5) for _ in range(n)]
        nbytes = [rng.choice([1, 40, 64, 64, 64, 700, budget, budget + 5]) for _ in range(n)]
        extra = [tuple(rng.sample(range(5), rng.randrange(3))) if rng.random() < 0.3 else None for _ in range(n)]
        cases += [(src, dst, nbytes, extra), (src, dst, nbytes, [None] * n)]
    for src, dst, nbytes, extra in cases:
        want = scan(src, dst, nbytes, budget, 3, 5, extra)
        assert buckets.assign_buckets(src, dst, nbytes, budget, 3, 5, extra) == want


# --------------------------------------------------------------------------- what bytes_min counts


def _qwen3_moe_ep_rank_bytes(*, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, head_dim: int,
                             experts: int, moe_intermediate: int, pp: int, dp: int, redundant: int,
                             itemsize: int) -> list[int]:
    """Independent of the rules and the planner: the bytes each rank of ONE vLLM engine of
    Qwen3-MoE (untied) holds at tp=1, ``pp`` stages, ``dp`` DP ranks, ``enable_ep`` with
    ``redundant`` EPLB slots, as vLLM 0.32 lays it out -- the EP group of a stage is its dp*tp
    ranks, each holding (experts + redundant) / ep physical expert slots of every MoE layer;
    attention, norms and the router are replicated on every DP rank; ``qwen3_moe.py`` builds
    embed_tokens, norm and lm_head on every PP stage. Padded vocab rows are zero-filled by the
    receiver, not received: the real ``vocab`` rows count. Every rank of an engine holds the
    same number of bytes (even stages)."""
    ep = dp  # dp * tp
    assert (experts + redundant) % ep == 0
    slots = (experts + redundant) // ep
    attention = (heads + 2 * kv_heads) * head_dim * hidden + hidden * heads * head_dim + 2 * head_dim
    layer = 2 * hidden + attention + experts * hidden + slots * 3 * moe_intermediate * hidden
    everywhere = 2 * vocab * hidden + hidden  # embed_tokens, lm_head, final norm
    assert layers % pp == 0  # even stages: no question of where vLLM puts a remainder
    return [(everywhere + layers // pp * layer) * itemsize for _ in range(dp) for _ in range(pp)]


def test_bytes_min_sums_every_rank_of_every_engine():
    """tp=1 pp=2 dp=4 enable_ep + redundant experts, 2 engines (replicas): bytes_min is what
    every destination rank holds, summed over both engines' 16 ranks (a copy per engine), each
    rank's share as computed by hand from the model's sizes."""
    spec = tiny_spec(vocab=250, dtype="bfloat16")  # hidden 16, 4 layers, 8 q / 2 kv heads of 4, 8 experts of 8
    vllm = VllmParallel(tp=1, pp=2, dp=4, replicas=2, enable_ep=True, num_redundant_experts=4)
    src = megatron_layout(spec, MegatronParallel(tp=1, pp=2, ep=2, dp=2))
    dst = vllm_layout(spec, vllm)
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    one_engine = _qwen3_moe_ep_rank_bytes(hidden=16, layers=4, vocab=250, heads=8, kv_heads=2, head_dim=4,
                                          experts=8, moe_intermediate=8, pp=2, dp=4, redundant=4, itemsize=2)
    assert dst.world_size == plan.num_dst == 2 * 8
    assert plan.recv_bytes() == one_engine * 2
    assert plan.bytes_min == plan.bytes_planned == 2 * sum(one_engine)
