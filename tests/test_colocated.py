"""Colocated refits: a trainer and a vLLM worker on one device exchange their bytes through
shared memory, never through the refit group; everything else takes the group as before.

Gloo level: two trainers and two workers, trainer i and worker i on device i -- half of each
worker's bytes are same-device, half cross devices. The group only ever carries flags and
checksums between same-device pairs, bytes per class are the plan's, and a failed refit leaves
no shared-memory segment behind. Live (slow): megatron -> vLLM with ``refit.placement=colocated``.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch

from mcore_reshard.plan.placed import RankPlacement, placement_report, plan_for_placement
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.faults import Fault
from mcore_reshard.transport.executor import TensorSink, TransferOptions, execute_plan, zero_fill_padding
from mcore_reshard.transport.group import RankMap, RefitError, RefitGroup
from mcore_reshard.transport.shm import PREFIX, SHM_DIR
from support.worlds import T, canonical, expected_equal, locals_of, ship, spawn_ranks
from toy_layouts import split_layout

N = 2  # trainers = workers; trainer i and worker i share device i


def _layouts():
    src = split_layout(T, parts=N, dim=0)
    dst = split_layout(T, parts=N, dim=1, pad_rows=1)  # every worker needs part of every trainer
    place = RankPlacement.colocated(N, N, gpus_per_node=8)
    return src, dst, place, plan_for_placement(src, dst, place, bucket_bytes=96)


def _segments() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(PREFIX)}


class _FailingSink(TensorSink):
    def resolve(self, name, view):
        raise RuntimeError("applier broke")


def _main(rank: int, world: int, port: int, port2: int, q: Any) -> None:
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        src, dst, place, plan = _layouts()
        rm = RankMap.disaggregated(N, N)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm, secret="s3cret")
        wire: list[tuple[str, int, str, int]] = []  # (op, peer group rank, dtype, elements)
        send, recv = group.send, group.recv
        group.send = lambda t, g, tag: (wire.append(("send", g, str(t.dtype), t.numel())), send(t, g, tag))[1]
        group.recv = lambda t, g, tag: (wire.append(("recv", g, str(t.dtype), t.numel())), recv(t, g, tag))[1]
        sp = plan.for_rank("src", s_rank) if s_rank is not None else None
        dp = plan.for_rank("dst", d_rank) if d_rank is not None else None

        def refit(seed, sink=None, fault=None):
            canon = canonical(T, seed)
            s = locals_of(src, s_rank, canon) if s_rank is not None else {}
            d = locals_of(dst, d_rank, None) if d_rank is not None else {}
            wire.clear()
            try:
                stats = execute_plan(sp, dp, s, d if sink is None else sink(d), group, TransferOptions(
                    20.0, fault=fault, plan_digest=plan.digest(), rank_map=rm))
                err = None
            except (RefitError, RuntimeError) as e:
                stats, err = None, f"{type(e).__name__}: {e}"
            bad = None
            if d_rank is not None and sink is None:
                zero_fill_padding(d, dst.for_rank(d_rank))
                bad = expected_equal(dst, d_rank, canon, d)
            return {"stats": stats, "err": err, "bad": bad, "wire": list(wire), "segments": sorted(_segments())}

        out["ok"] = refit(seed=3)
        out["again"] = refit(seed=4)  # a second refit: a fresh segment, the same result
        out["flip"] = refit(seed=5, fault=Fault("bitflip", 0) if s_rank == 0 else None)
        group.close()
        group = RefitGroup.create("127.0.0.1", port2, rank, world, 20.0, rank == 0, rank_map=rm, secret="s3cret")
        out["sink"] = refit(seed=6, sink=_FailingSink if d_rank == 0 else None)
        group.close(barrier=False)
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out["crash"] = traceback.format_exc()
    ship(q, rank, out)


def test_colocated_plan_marks_same_device_pairs_and_ships_them():
    from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire

    src, dst, place, plan = _layouts()
    assert plan.same_device == ((0, 0), (1, 1))
    rep = placement_report(plan, src, dst, place)
    assert rep.bytes_same_device > 0 and rep.bytes_intra_node > 0 and rep.bytes_inter_node == 0
    assert rep.bytes_same_device + rep.bytes_intra_node == plan.bytes_min
    for side in ("src", "dst"):
        for r in range(N):
            s = plan.for_rank(side, r)
            assert s.same_device == (r,)
            assert slice_from_wire(slice_to_wire(s)) == s


@pytest.mark.slow
def test_same_device_bytes_go_through_shared_memory_not_the_group():
    before = _segments()
    res = spawn_ranks(_main, 2 * N, free_port(), free_port())
    src, dst, place, plan = _layouts()
    rep = placement_report(plan, src, dst, place)
    pairs = {(0, 2), (1, 3)}  # group ranks of (trainer i, worker i)
    for run in ("ok", "again"):
        for r in range(N, 2 * N):
            got = res[r][run]
            assert got["err"] is None and got["bad"] == [] and got["stats"].verified, (r, got)
        stats = {r: res[r][run]["stats"] for r in range(2 * N)}
        assert sum(stats[r].bytes_same_device for r in range(N, 2 * N)) == rep.bytes_same_device
        assert sum(stats[r].bytes_same_device for r in range(N)) == rep.bytes_same_device
        assert sum(stats[r].bytes_received for r in range(N, 2 * N)) == plan.bytes_min
        for r in range(2 * N):
            for op, g, dtype, n in res[r][run]["wire"]:
                if tuple(sorted((r, g))) in pairs:  # flags, pings and checksums only
                    assert dtype in ("torch.int64", "torch.uint8"), (r, op, g, dtype, n)
            if r < N:  # cross-device data still takes the group
                assert any(op == "send" and dtype == "torch.float32" for op, _, dtype, _ in res[r][run]["wire"])
            assert res[r][run]["stats"].peak_extra_bytes <= 2 * 96
    # a bit flipped in trainer 0's first same-device message is caught by worker 0's checksums
    assert "checksum mismatch" in res[2]["flip"]["err"] and "from source rank 0" in res[2]["flip"]["err"]
    assert res[3]["flip"]["err"] is None
    # worker 0's applier fails mid-refit: every rank stops, and no segment is left behind
    assert "applier broke" in res[2]["sink"]["err"]
    assert all(res[r]["sink"]["err"] is not None for r in (0, 1))
    assert _segments() - before == set()


TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]


@pytest.mark.slow
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_colocated_refits_live(ckpt_cache, shared_engine, moe):
    """``refit.placement=colocated``: trainer rank i and vLLM worker i on device i. One trainer
    and one worker share everything (all bytes same-device); then TP2 (x EP2 for MoE) trainers
    -> the same worker (trainer 0's part same-device, trainer 1's from the next device)."""
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.jobs.refit import local_cluster
    from support.live import cluster

    ckpt = ckpt_cache.get(moe=moe, seed=7)
    spec = load_model_spec(ckpt, dtype="float32")
    cfg = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify="full", placement="colocated")
    llm = shared_engine(ckpt, tp=1)  # shared: every refit below writes all of its weights first
    before = _segments()
    split = MegatronParallel(tp=2, ep=2, etp=1) if moe else MegatronParallel(tp=2)
    for training, everything in ((MegatronParallel(), True), (split, False)):
        start = cluster if moe and not everything else local_cluster  # the session's TP2xEP2 pool; others used once
        with start(spec, ckpt, training, VllmParallel(tp=1), cfg, train={"lr": 0.05}, engines=[llm]) as c:
            d = c.driver
            assert d.placement == RankPlacement.colocated(training.world_size, 1, max(training.world_size, 1))
            want = placement_report(d.plan, d.src, d.dst, d.placement)
            assert want.bytes_inter_node == 0
            if everything:
                assert want.bytes_same_device == d.plan.bytes_min and want.bytes_intra_node == 0
            else:
                assert 0 < want.bytes_same_device < d.plan.bytes_min and want.bytes_intra_node > 0
            c.step(TOKENS)
            m = c.refit_once()
            assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
            assert m.bytes_same_device == want.bytes_same_device and m.peak_extra_bytes <= cfg.buffer_bytes
            dst = [r for r in d.last_reports if r.side == "dst"]
            src = [r for r in d.last_reports if r.side == "src"]
            assert sum(r.bytes_same_device for r in dst) == sum(r.bytes_same_device for r in src) == \
                want.bytes_same_device
            assert sum(r.bytes_received - r.bytes_same_device for r in dst) == want.bytes_intra_node
            assert c.logprob_error(TOKENS) <= 1.001
            # the next refit is a delta: through shared memory too, and equal element for element
            # (fp32 at lr 1e-6 still changes most elements: most boxes go dense, some sparse)
            c.step(TOKENS, lr=1e-6)
            m2 = c.refit_once()
            assert m2.delta and m2.verified and m2.at_minimum and any("full verification" in n for n in m2.notes)
            assert 0 < m2.bytes_same_device < m.bytes_same_device and m2.bytes_moved < m.bytes_moved
            assert c.logprob_error(TOKENS) <= 1.001
    assert _segments() - before == set()
