"""The transport: refit group, bucketed P2P executor, checksums.

Multi-process tests spawn one small gloo world each and run several checks in it (a process
start costs seconds); workers report through a queue and the parent asserts.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from typing import Any

import pytest
import torch

from mcore_reshard.transport.views import local_view, materialize_local
from mcore_reshard.plan import build_plan
from mcore_reshard.transport.checksum import checksum, checksums, digest
from mcore_reshard.transport.executor import TensorSink, TransferOptions, execute_plan, raw_send_bandwidth, zero_fill_padding
from mcore_reshard.transport.group import RankMap, RefitError, RefitGroup, RefitTimeout
from mcore_reshard.wire.faults import Fault
from mcore_reshard.infra.ports import free_port
from support.worlds import (T, T16, canonical, expected_equal, locals_of, refit_once, ship,
                            spawn_ranks)
from toy_layouts import split_layout

# -- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [0, 1], ids=["dense-rows", "strided-columns"])
def test_pack_unpack_moves_small_dense_boxes_by_memmove_and_the_rest_by_views(dim):
    """Source split along ``dim`` -> destination rows split 2 ways: dim 0 gives dense boxes
    (moved by bounds-checked memmove, reported as (address, nbytes)), dim 1 boxes of half
    the columns, strided in the destination's rows (views and a batched copy). Both land bit
    for bit; a source of another dtype is cast."""
    from mcore_reshard.transport.checksum import digest_at
    from mcore_reshard.transport.packing import pack, unpack

    src, dst = split_layout(T, parts=2, dim=dim), split_layout(T, parts=2, dim=0, pad_rows=1)
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    canon = canonical(T, seed=2)
    s = {r: locals_of(src, r, canon) for r in range(2)}
    d = {r: locals_of(dst, r, None) for r in range(2)}
    kinds = set()
    for r in range(2):
        for (peer, _), ts in plan.for_rank("src", r).messages()[0].items():
            buf = torch.empty(sum(t.box.numel for t in ts) + 5)
            msg = pack(ts, s[r], buf)
            written = unpack(ts, msg, d[peer])
            for t, w in zip(ts, written):
                kinds.add(type(w))
                want = local_view(d[peer][t.dst_name], t.dst_view)
                if isinstance(w, tuple):  # the address and size of exactly that box
                    assert w == (want.data_ptr(), want.numel() * want.element_size())
                    assert digest_at(w) == digest(want)
    zero = {r: {k: v.nan_to_num(0.0) for k, v in d[r].items()} for r in range(2)}
    assert all(expected_equal(dst, r, canon, zero[r]) == [] for r in range(2))
    assert kinds == ({tuple} if dim == 0 else {tuple, torch.Tensor})
    # fp32 sources into a bf16 message: no memmove (dtypes differ), cast by the batched copy
    ts = plan.for_rank("src", 0).messages()[0][(0, -1)]
    msg = pack(ts, s[0], torch.empty(sum(t.box.numel for t in ts), dtype=torch.bfloat16))
    got = {k: torch.zeros_like(v) for k, v in d[0].items()}
    assert all(isinstance(w, torch.Tensor) for w in unpack(ts, msg, got))
    for t in ts:
        assert torch.equal(local_view(got[t.dst_name], t.dst_view),
                           local_view(s[0][t.src_name], t.src_view).to(torch.bfloat16).float())


# -- checksums -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64])
def test_checksum_is_exact_and_sees_swaps_and_single_bits(dtype):
    x = (torch.randn(64, 33) * 100).to(dtype)
    base = checksum(x)
    assert checksum(x.clone()) == base
    swapped = x.clone().view(-1)
    swapped[[3, 700]] = swapped[[700, 3]]
    assert swapped[3] != swapped[700] or dtype == torch.int8
    if not torch.equal(swapped.view(x.shape), x):
        s = checksum(swapped)
        assert s[0] == base[0] and s[1] != base[1]  # plain sum is blind to a swap, weighted is not
    flipped = x.clone().view(-1)
    flipped.view(torch.uint8)[5] ^= 1  # one bit of one byte
    assert checksum(flipped) != base
    # The CPU algorithm (xxh3 of the bytes): equal copies agree, a swap or one bit does not.
    d = digest(x)
    assert d == digest(x.clone()) and d[1] == x.numel() * x.element_size()
    assert digest(flipped.view(x.shape)) != d
    if not torch.equal(swapped.view(x.shape), x):
        assert digest(swapped.view(x.shape)) != d


def test_checksum_follows_logical_order_not_strides():
    """A source view and a destination view of one box (different strides) agree."""
    big = torch.randn(10, 12)
    box = big[2:7, 3:9]  # strided
    assert not box.is_contiguous()
    assert checksum(box) == checksum(box.contiguous())
    assert checksum(box) != checksum(box.t().contiguous())
    sums = checksums([box, box.contiguous()])
    assert sums.dtype == torch.int64 and torch.equal(sums[0], sums[1])
    assert digest(box) == digest(box.contiguous()) != digest(box.t().contiguous())
    assert tuple(sums[0].tolist()) == digest(box)  # CPU tensors: the xxh3 rows


def test_rank_map_names_sides_and_group_ranks():
    rm = RankMap.disaggregated(2, 3)
    assert rm.world_size == 5 and rm.group_rank("dst", 1) == 3 and rm.roles(3) == (None, 1)
    assert rm.name("dst", 1) == "destination rank 1 (group rank 3)"
    co = RankMap.colocated(2)
    assert co.roles(1) == (1, 1)
    assert co.name_at(1) == "source rank 1 / destination rank 1 (group rank 1)"


def test_zero_fill_padding_touches_padding_only():
    dst = split_layout(T, parts=2, dim=1, pad_rows=2)
    canon = canonical(T, 0)
    got = {p.name: materialize_local(p, canon) for p in dst.for_rank(1)}
    for t in got.values():
        t.view(-1)[-1] = float("nan")  # last element is in a pad row
    zero_fill_padding(got, dst.for_rank(1))
    assert expected_equal(dst, 1, canon, got) == []


# -- one process: colocated world of one (every message is local) --------------------------


def test_single_rank_colocated_refit_copies_locally_and_verifies():
    src = split_layout(T, parts=1, dim=0)
    dst = split_layout(T, parts=1, dim=0, pad_rows=1)
    plan = build_plan(src, dst, bucket_bytes=96)
    assert plan.num_buckets > 3
    canon = canonical(T, 1)
    s, d = locals_of(src, 0, canon), locals_of(dst, 0, None)
    group = RefitGroup.create("127.0.0.1", free_port(), 0, 1, 10.0, True, rank_map=RankMap.colocated(1))
    try:
        stats = execute_plan(plan.for_rank("src", 0), plan.for_rank("dst", 0), s, d, group,
                             TransferOptions(10.0, plan_digest=plan.digest()))
    finally:
        group.close()
    zero_fill_padding(d, dst.for_rank(0))
    assert expected_equal(dst, 0, canon, d) == []
    assert stats.verified and stats.buckets == plan.num_buckets
    assert stats.bytes_sent == 0 and stats.messages == 0  # nothing touched the wire
    assert 0 < stats.peak_extra_bytes <= 2 * plan.bucket_bytes


def test_stuck_peer_times_out_naming_it_and_the_bucket():
    """Two ranks in one process (threads): the destination never shows up for the refit."""
    import threading

    src, dst = split_layout(T, parts=1, dim=0), split_layout(T, parts=1, dim=1)
    plan = build_plan(src, dst, bucket_bytes=1 << 20)
    rm, port, groups = RankMap.disaggregated(1, 1), free_port(), {}
    th = threading.Thread(target=lambda: groups.update(
        {1: RefitGroup.create("127.0.0.1", port, 1, 2, 10.0, False, rank_map=rm)}))
    th.start()
    groups[0] = RefitGroup.create("127.0.0.1", port, 0, 2, 10.0, True, rank_map=rm)
    th.join(20)
    try:
        th = threading.Thread(target=groups[1].connect, args=([0],))  # rank 1 connects, then idles
        th.start()
        with pytest.raises(RefitTimeout, match=r"destination rank 0 \(group rank 1\).*bucket 0"):
            execute_plan(plan.for_rank("src", 0), None, locals_of(src, 0, canonical(T, 0)), None,
                         groups[0], TransferOptions(0.5))
        with pytest.raises(RefitTimeout, match=r"no answer from destination rank 0 \(group rank 1\)"):
            groups[0].control.exchange("hello", timeout_s=0.5)
        th.join(10)
    finally:
        for g in groups.values():
            g.close(barrier=False)


# -- spawned worlds --------------------------------------------------------------------------


def _world_main(rank: int, world: int, port: int, port2: int, q: Any) -> None:
    """2 sources (group 0, 1) + 2 destinations (group 2, 3); several checks in one world."""
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        src = split_layout(T, parts=2, dim=0)  # source: rows split 2 ways
        dst = split_layout(T, parts=1, dim=1, replicas=2, pad_rows=1)  # destination: 2 full replicas, padded
        plan = build_plan(src, dst, bucket_bytes=80)
        rm = RankMap.disaggregated(2, 2)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm)
        sp = plan.for_rank("src", s_rank) if s_rank is not None else None
        dp = plan.for_rank("dst", d_rank) if d_rank is not None else None

        def refit(seed, sink=None):
            return refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed, sink=sink, progress=rank == 0)

        out["buckets"] = plan.num_buckets
        out["ok"] = refit(seed=7)
        out["again"] = refit(seed=8)  # same group, second refit
        # a broken write on destination rank 0 only (its first box of local.a, where it landed)
        out["flip"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 9, progress=rank == 0,
                                 fault=Fault("bitflip", tensor="local.a") if d_rank == 0 else None)
        # destination rank 1 holds a different plan
        bad_digest = plan.digest() if d_rank != 1 else "0" * 16
        canon = canonical(T, 10)
        d = locals_of(dst, d_rank, None) if d_rank is not None else {}
        try:
            execute_plan(sp, dp, locals_of(src, s_rank, canon) if s_rank is not None else {}, d, group,
                         TransferOptions(20.0, plan_digest=bad_digest, rank_map=rm))
            out["digest"] = None
        except RefitError as e:
            out["digest"] = str(e)
        out["digest_untouched"] = all(bool(t.isnan().all()) for t in d.values())
        out["bw"] = raw_send_bandwidth(group, 0, 2, 1 << 20, timeout_s=20.0)
        out["bcast"] = group.broadcast(torch.arange(4.0) * (rank == 2), root=2).tolist()

        # colocated refit on group ranks 0 and 1 (source r and destination r share a process), bf16
        if rank < 2:
            co = RefitGroup.create("127.0.0.1", port2, rank, 2, 20.0, rank == 0, rank_map=RankMap.colocated(2))
            src16 = split_layout(T16, parts=2, dim=0)
            dst16 = split_layout(T16, parts=2, dim=1, pad_rows=2)
            plan16 = build_plan(src16, dst16, bucket_bytes=64)
            canon16 = canonical(T16, 11)
            d16 = locals_of(dst16, rank, None)
            st = execute_plan(plan16.for_rank("src", rank), plan16.for_rank("dst", rank),
                              locals_of(src16, rank, canon16), d16, co, TransferOptions(20.0, plan_digest=plan16.digest()))
            zero_fill_padding(d16, dst16.for_rank(rank))
            out["colocated"] = {"stats": st, "bad": expected_equal(dst16, rank, canon16, d16)}
            co.close()
        group.close()
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out["crash"] = traceback.format_exc()
    q.put((rank, out))


#: Large boxes (2 MiB halves of "w", contiguous on both sides) go zero-copy; "b" is packed.
TZ = {"w": ((1024, 1024), "float32"), "b": ((8,), "float32")}


class _ResolveOnly:
    """The smallest sink: ``resolve`` and ``commit_box``, no ``baseline`` (full refits only)."""

    def __init__(self, tensors) -> None:
        self.tensors, self.committed = tensors, 0

    def resolve(self, name, view):
        return local_view(self.tensors[name], view)

    def commit_box(self, name, view) -> None:
        self.committed += 1


def _zero_copy_main(rank: int, world: int, port: int, q: Any) -> None:
    """2 sources (row halves) -> 1 destination (whole tensors): the big boxes skip the buffers."""
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        src = split_layout(TZ, parts=2, dim=0)
        dst = split_layout(TZ, parts=1, dim=0)
        plan = build_plan(src, dst, bucket_bytes=8 << 20)
        rm = RankMap.disaggregated(2, 1)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm)
        out["ok"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 3, tensors=TZ)
        # the smallest sink (resolve and commit_box): zero-copy boxes land in what it resolves
        canon = canonical(TZ, 4)
        d = locals_of(dst, d_rank, None) if d_rank is not None else {}
        sink = _ResolveOnly(d) if d_rank is not None else None
        execute_plan(plan.for_rank("src", s_rank) if s_rank is not None else None,
                     plan.for_rank("dst", d_rank) if d_rank is not None else None,
                     locals_of(src, s_rank, canon) if s_rank is not None else {}, sink, group,
                     TransferOptions(20.0, plan_digest=plan.digest(), wire_dtype=torch.float32, rank_map=rm))
        out["callable_bad"] = expected_equal(dst, d_rank, canon, d) if d_rank is not None else []
        out["commits"] = sink.committed if sink is not None else None
        # the destination's tensor corrupted after the bytes landed: caught, the box named
        out["corrupt"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 5, tensors=TZ,
                                    fault=Fault("bitflip", tensor="local.w"))
        group.close()
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out["crash"] = traceback.format_exc()
    q.put((rank, out))


class DyingTensors(dict):
    """Source tensors whose process exits on the ``after``-th lookup: a crash while packing."""

    def __init__(self, tensors, after: int) -> None:
        super().__init__(tensors)
        self.left = after

    def __getitem__(self, key):
        self.left -= 1
        if self.left < 0:
            os._exit(1)
        return super().__getitem__(key)


def _death_main(rank: int, world: int, port: int, q: Any) -> None:
    """Source rank 1 sends its first bucket(s), then dies while packing the next one."""
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        src = split_layout(T, parts=2, dim=0)
        dst = split_layout(T, parts=2, dim=1)
        plan = build_plan(src, dst, bucket_bytes=80)
        rm = RankMap.disaggregated(2, 2)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 10.0, rank == 0, rank_map=rm)
        canon = canonical(T, 3)
        s_locals = locals_of(src, s_rank, canon) if s_rank is not None else {}
        if rank == 1:
            q.put((rank, {"died": True}))
            q.close()
            q.join_thread()
            sent_first = sum(len(ts) for b in plan.for_rank("src", 1).buckets()[:2] for ts in b.values())
            s_locals = DyingTensors(s_locals, after=sent_first)  # the packs of buckets 0, 1 (checksums hash the packed bytes)
        t0 = time.perf_counter()
        try:
            execute_plan(plan.for_rank("src", s_rank) if s_rank is not None else None,
                         plan.for_rank("dst", d_rank) if d_rank is not None else None,
                         s_locals, locals_of(dst, d_rank, None) if d_rank is not None else {},
                         group, TransferOptions(15.0, plan_digest=plan.digest(), rank_map=rm))
            out["err"] = None
        except RefitError as e:
            out["err"], out["timeout"] = str(e), isinstance(e, RefitTimeout)
        out["seconds"] = time.perf_counter() - t0
    except BaseException:  # noqa: BLE001
        out["crash"] = traceback.format_exc()
    ship(q, rank, out)  # the group is broken; do not run its destructor's waits


@pytest.mark.slow
def test_refit_world_two_sources_two_destinations():
    res = spawn_ranks(_world_main, 4, free_port(), free_port())
    assert res[0]["buckets"] > 5  # small buffer: many rounds

    for key in ("ok", "again"):
        for r in (2, 3):
            got = res[r][key]
            assert got["err"] is None and got["bad"] == [], (key, r, got)
            assert got["stats"].verified and got["stats"].bytes_received > 0
        for r in (0, 1):
            st = res[r][key]["stats"]
            assert st.verified and st.bytes_sent > 0 and st.peak_extra_bytes <= 2 * 80
    sent = sum(res[r]["ok"]["stats"].bytes_sent for r in (0, 1))
    recv = sum(res[r]["ok"]["stats"].bytes_received for r in (2, 3))
    assert sent == recv == 2 * sum(math.prod(s) * 4 for s, _ in T.values())  # each replica gets it all once

    # a corrupted write is caught on destination 0 and named; everyone else is fine
    err = res[2]["flip"]["err"]
    assert err is not None and "checksum mismatch" in err and "local.a" in err
    assert "destination rank 0 (group rank 2)" in err and "source rank" in err
    assert res[2]["flip"]["bad"] == ["local.a"]
    for r in (0, 1, 3):
        assert res[r]["flip"]["err"] is None, res[r]["flip"]

    # digest disagreement: every rank raises naming destination rank 1, and no byte moved
    for r in range(4):
        msg = res[r]["digest"]
        assert msg is not None and "disagreement" in msg and "destination rank 1 (group rank 3)" in msg, msg
        assert res[r]["digest_untouched"]

    assert res[0]["bw"] > 0 and res[2]["bw"] > 0 and res[1]["bw"] is None
    assert all(res[r]["bcast"] == [0.0, 1.0, 2.0, 3.0] for r in range(4))

    for r in (0, 1):
        co = res[r]["colocated"]
        assert co["bad"] == [] and co["stats"].verified
        assert co["stats"].bytes_sent > 0  # half goes to the other process, half stays local


@pytest.mark.slow
def test_peer_death_mid_refit_raises_naming_the_missing_rank():
    res = spawn_ranks(_death_main, 4, free_port(), wait_s=60.0)
    assert res[1] == {"died": True}
    for r in (2, 3):  # both destinations wait on source rank 1
        err = res[r]["err"]
        assert err is not None and "source rank 1 (group rank 1) failed in bucket" in err, err
    assert res[0]["err"] is not None  # the surviving source cannot finish either


@pytest.mark.slow
def test_zero_copy_boxes_skip_the_buffers_and_stay_verified():
    """Boxes >= DIRECT_MIN_BYTES that are contiguous on both sides are sent from the source
    tensor and received into the destination tensor; the checksums still prove what the
    destination holds (a corruption after landing is caught)."""
    res = spawn_ranks(_zero_copy_main, 3, free_port())
    ok = res[2]["ok"]
    assert ok["err"] is None and ok["bad"] == [] and ok["stats"].verified
    w_bytes = 1024 * 1024 * 4
    assert ok["stats"].bytes_zero_copy == w_bytes  # both 2 MiB halves of w, not b
    assert ok["stats"].bytes_received == w_bytes + 8 * 4
    assert ok["stats"].peak_extra_bytes < 1 << 10  # only b's 16 bytes per source were buffered
    for r in (0, 1):
        assert res[r]["ok"]["stats"].bytes_zero_copy == w_bytes // 2
        assert res[r]["ok"]["stats"].peak_extra_bytes < 1 << 10
    assert res[2]["callable_bad"] == [] and res[2]["commits"] == 4  # w's 2 halves, b's 2 halves: each once
    err = res[2]["corrupt"]["err"]
    assert err is not None and "checksum mismatch in 1 transfer(s)" in err and "local.w" in err, err  # its first box
    assert res[2]["corrupt"]["bad"] == ["local.w"]
