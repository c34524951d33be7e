"""Delta refits (``transport/delta.py``): the encoding's bytes, the agreement on the baseline,
and deltas through the executor -- in process, and over gloo through fan-out relays (a relay
forwards the delta, not the dense box). Live megatron -> vLLM deltas are in
``test_refit_bf16.py`` (TP2xEP2, PP2), ``test_colocated.py`` (shared memory) and
``test_faults.py`` (a corrupted baseline; after a failure the next refit is full)."""

from __future__ import annotations

import json
import math
import traceback
from typing import Any

import pytest
import torch

from mcore_reshard.errors import ConfigError
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.tags import direct_tag, header_tag
from mcore_reshard.plan.placed import RankPlacement, plan_for_placement
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.protocol import RefitRequest
from mcore_reshard.transport.delta import DeltaRun, DeltaState, decide, encoded_numel, refit_id
from mcore_reshard.transport.executor import TransferOptions, execute_plan, zero_fill_padding
from mcore_reshard.transport.group import RankMap, RefitError, RefitGroup
from support.worlds import T, T16, canonical, expected_equal, locals_of, ship, spawn_ranks
from toy_layouts import split_layout


# -- the encoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_a_box_costs_nothing_unchanged_positions_and_values_sparse_and_itself_dense(itemsize):
    n = 1000
    assert encoded_numel(0, n, itemsize) == 0
    assert encoded_numel(n, n, itemsize) == n
    # h changed elements: an int32 position (4 bytes) and the value each, in wire elements
    for h in (1, 7, 100):
        assert encoded_numel(h, n, itemsize) * itemsize == math.ceil(4 * h / itemsize) * itemsize + h * itemsize
    # bf16: 6 bytes per changed element against 2 per element dense -> sparse pays below 1/3
    assert encoded_numel(330, n, 2) < n < encoded_numel(340, n, 2)


def test_header_tags_sit_beside_zero_copy_tags_and_never_collide():
    tags = {direct_tag(k, i) for k in range(4) for i in range(64)}
    heads = {header_tag(k, g) for k in range(4) for g in range(-1, 64)}
    assert not tags & heads and len(heads) == 4 * 65


def test_every_rank_decides_the_same_and_says_why_a_refit_is_full():
    names = ["training rank 0", "vLLM rank 0", "vLLM rank 1"]
    r = refit_id("d" * 64, "nonce", 3)
    assert decide(["x", "x", "x"], "auto", r, names).on
    off = decide(["x", "x", "x"], "off", r, names)
    assert not off.on and off.reason == "refit.delta=off"
    first = decide([None, None, None], "auto", r, names)
    assert not first.on and "first refit" in first.reason
    missing = decide(["x", None, "x"], "auto", r, names)
    assert not missing.on and "vLLM rank 0 hold no committed baseline" in missing.reason
    split = decide(["x", "y", "x"], "auto", r, names)
    assert not split.on and "2 different committed refits" in split.reason


def test_a_baseline_is_offered_only_after_a_commit_under_the_same_plan():
    s = DeltaState()
    rid = refit_id("a" * 64, "n", 1)
    s.begin()
    s.finished(rid)
    assert s.offer("a" * 64) is None  # not committed yet
    s.settle(True)
    assert s.offer("a" * 64) == rid and s.offer("b" * 64) is None  # a changed plan: full
    s.begin()
    s.finished(refit_id("a" * 64, "n", 2))
    s.settle(False)  # aborted: the receivers kept the old weights, this rank kept the new
    assert s.offer("a" * 64) is None


def test_a_refit_is_at_the_minimum_when_full_or_a_delta_no_larger_than_full():
    from mcore_reshard.refit.driver import bytes_at_minimum

    assert bytes_at_minimum(1000, 1000, 1000, 0, delta=False)
    assert not bytes_at_minimum(999, 1000, 1000, 0, delta=False)  # a full refit moves exactly the minimum
    assert bytes_at_minimum(300 + 16, 1000, 1000, 16, delta=True)
    assert bytes_at_minimum(1000 + 16, 1000, 1000, 16, delta=True)  # every box dense: full + headers
    assert not bytes_at_minimum(1001 + 16, 1000, 1000, 16, delta=True)  # more data than full
    assert not bytes_at_minimum(300, 1000, 1200, 0, delta=True)  # planned above the minimum


def test_rank_reports_carry_their_delta_part_over_the_wire():
    from mcore_reshard.wire.protocol import DeltaStats, RankReport

    r = RankReport("src", 1, bytes_full=64, bytes_headers=8,
                   delta=DeltaStats(True, "", elements=10, changed=2, boxes=(1, 1, 0), state_bytes=20))
    assert RankReport.from_wire(json.loads(json.dumps(r.to_wire()))) == r


def test_refit_request_checks_its_delta_settings_in_one_line():
    with pytest.raises(ConfigError, match="delta='sometimes' is not one of auto, off"):
        RefitRequest("d", delta="sometimes")
    with pytest.raises(ConfigError, match="delta_state_limit_bytes=-1"):
        RefitRequest("d", delta_state_limit_bytes=-1)
    assert RefitRequest.from_wire(RefitRequest("d", delta="off").to_wire()).delta == "off"


# -- through the executor, in process -------------------------------------------------------


def _run(plan, s, d, group, state, refit, on):
    return execute_plan(plan.for_rank("src", 0), plan.for_rank("dst", 0), s, d, group, TransferOptions(
        10.0, delta=DeltaRun(decide([refit if on else None], "auto", refit, ["rank 0"]), state)))


@pytest.mark.parametrize("tensors", [T, T16], ids=["fp32", "bf16"])
def test_in_process_delta_equals_the_new_weights_and_a_wrong_baseline_is_named(tensors):
    """Full, then a few elements change: the delta carries them only, every destination tensor
    is bit for bit the new one; unchanged weights move nothing; one element of the receiver's
    baseline altered: the checksum of the whole box names its parameter."""
    src = split_layout(tensors, parts=1, dim=0)
    dst = split_layout(tensors, parts=1, dim=0, pad_rows=1)
    plan = build_plan(src, dst, bucket_bytes=128)
    canon = canonical(tensors, 1)
    canon["b"].view(-1)[0] = 0.0
    s, d = locals_of(src, 0, canon), locals_of(dst, 0, None)
    group = RefitGroup.create("127.0.0.1", free_port(), 0, 1, 10.0, True, rank_map=RankMap.colocated(1))
    state = DeltaState()
    try:
        first = _run(plan, s, d, group, state, "r1", False)
        state.settle(True)
        sent = plan.for_rank("src", 0).transfers
        assert not first.delta.on and state.nbytes == sum(t.box.numel for t in sent) * s["local.a"].element_size()
        for name in ("a", "c"):  # an element of two tensors, and +0.0 -> -0.0 (equal, other bits)
            canon[name].view(-1)[5] += 1
        canon["b"].view(-1)[0] = -0.0
        s.update(locals_of(src, 0, canon))
        second = _run(plan, s, d, group, state, "r2", True)
        state.settle(True)
        zero_fill_padding(d, dst.for_rank(0))
        assert expected_equal(dst, 0, canon, d) == []
        assert second.delta.on and second.verified and second.delta.changed == 3
        assert torch.signbit(d["local.b"].view(-1)[0])
        assert second.delta.boxes[1] >= 1 and second.delta.boxes[0] > 0
        same = _run(plan, s, d, group, state, "r3", True)
        state.settle(True)
        assert same.delta.on and same.delta.changed == 0 and same.delta.boxes[1] == same.delta.boxes[2] == 0
        d["local.c"].view(-1)[1] += 1  # the receiver no longer holds what the sender thinks
        with pytest.raises(RefitError, match=r"checksum mismatch in 1 transfer\(s\): local.c"):
            _run(plan, s, d, group, state, "r4", True)
    finally:
        group.close()


# -- over gloo, through fan-out relays ------------------------------------------------------

NUM_SRC, PARTS, REPLICAS = 2, 2, 2


def _relay_layouts():
    src = split_layout(T16, parts=NUM_SRC, dim=0)
    dst = split_layout(T16, parts=PARTS, dim=1, replicas=REPLICAS, pad_rows=1)
    place = RankPlacement.separate(NUM_SRC, PARTS * REPLICAS, gpus_per_node=8)
    return src, dst, plan_for_placement(src, dst, place, bucket_bytes=96)


def _relay_delta_main(rank: int, world: int, port: int, q: Any) -> None:
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        rm = RankMap.disaggregated(NUM_SRC, PARTS * REPLICAS)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm)
        src, dst, plan = _relay_layouts()
        state = DeltaState()
        canon = canonical(T16, 3)
        s = locals_of(src, s_rank, canon) if s_rank is not None else {}
        d = locals_of(dst, d_rank, None) if d_rank is not None else {}
        sp = plan.for_rank("src", s_rank) if s_rank is not None else None
        dp = plan.for_rank("dst", d_rank) if d_rank is not None else None

        def refit(n: int, corrupt: bool = False) -> dict:
            """Every rank offers its baseline, all decide alike (the endpoint's agreement), then
            one refit; each settles as a commit would."""
            group.control.begin_refit()
            rid = refit_id(plan.digest(), "relay", n)
            offers = group.control.exchange(state.offer(plan.digest()))
            decision = decide(offers, "auto", rid, [rm.name_at(r) for r in range(world)])
            state.begin()
            if corrupt and d_rank == 3:
                d["local.a"].view(-1)[2] += 1
            try:
                stats, err = execute_plan(sp, dp, s, d, group, TransferOptions(
                    20.0, delta=DeltaRun(decision, state), rank_map=rm)), None
            except RefitError as e:
                stats, err = None, str(e)
            if corrupt:  # the last refit: it fails, its group with it
                return {"stats": stats, "err": err}
            ok = all(group.control.exchange(err is None))
            state.settle(ok)
            bad = None
            if d_rank is not None:
                zero_fill_padding(d, dst.for_rank(d_rank))
                bad = expected_equal(dst, d_rank, canon, d)
            return {"stats": stats, "err": err, "bad": bad}

        out["full"] = refit(1)
        for name in canon:  # one element of each tensor changes
            canon[name].view(-1)[3] += 1
        if s_rank is not None:
            s.update(locals_of(src, s_rank, canon))
        out["delta"] = refit(2)
        out["corrupt"] = refit(3, corrupt=True)
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out = {"crash": traceback.format_exc()}
    ship(q, rank, out)


@pytest.mark.slow
def test_relays_forward_the_delta_and_every_member_ends_bit_for_bit_right():
    world = NUM_SRC + PARTS * REPLICAS
    res = spawn_ranks(_relay_delta_main, world, free_port())
    _, _, plan = _relay_layouts()
    assert plan.relay_groups
    full = {r: res[r]["full"] for r in range(world)}
    delta = {r: res[r]["delta"] for r in range(world)}
    for r in range(NUM_SRC, world):
        assert full[r]["err"] is None and full[r]["bad"] == [] and not full[r]["stats"].delta.on
        assert delta[r]["err"] is None and delta[r]["bad"] == [], (r, delta[r])
        assert delta[r]["stats"].delta.on and delta[r]["stats"].verified
    moved_full = sum(full[r]["stats"].bytes_received for r in range(NUM_SRC, world))
    moved = sum(delta[r]["stats"].bytes_received - delta[r]["stats"].bytes_headers for r in range(NUM_SRC, world))
    # members forward what they received from the sources: the delta, a small part of the boxes
    forwarded = sum(delta[r]["stats"].bytes_sent for r in range(NUM_SRC, world))
    assert 0 < forwarded < sum(full[r]["stats"].bytes_sent for r in range(NUM_SRC, world)) / 4
    assert 0 < moved < moved_full / 4
    assert sum(delta[r]["stats"].delta.changed for r in range(NUM_SRC)) == len(T16)
    # a member's altered baseline: its checksum names the tensor; every rank's refit fails
    err = res[NUM_SRC + 3]["corrupt"]["err"]
    assert err is not None and "checksum mismatch" in err and "local.a" in err, err


# -- what a vLLM worker keeps between delta refits --------------------------------------------

def test_a_patched_copy_takes_the_changes_at_the_commit_and_a_whole_one_is_cloned():
    """``ModelFormatCopies``: a parameter a delta only patched is not cloned; its committed copy
    takes the same changes at the commit, and not before (an abort leaves it as it was); a
    parameter written whole is cloned from its shadow; a failure after live weights changed
    drops every copy."""
    from mcore_reshard.adapters.vllm.baselines import ModelFormatCopies
    from mcore_reshard.layout.descriptor import View

    copies = ModelFormatCopies(keep=True)
    copies.committed = {"a": torch.arange(6.0), "b": torch.zeros(4)}
    held_a = copies.committed["a"]
    box = View(2, (3,), (1,))  # elements 2..4 of "a"
    shadow_a, shadow_b = held_a.clone(), torch.full((4,), 7.0)

    def refit(commit: bool) -> None:
        copies.begin()
        shadow_a[2 + 1] = 40.0  # box-flat position 1 of the box
        copies.patched("a", box, torch.tensor([1]), torch.tensor([40.0]))
        copies.wrote_whole("b")
        copies.before_processing({"a": shadow_a, "b": shadow_b})
        shadow_b.fill_(-1.0)  # vLLM repacks the shadow in place: the clone keeps the model format
        if commit:
            copies.commit()
        else:
            copies.drop(live_changed=False)

    refit(commit=False)
    assert torch.equal(copies.committed["a"], torch.arange(6.0)) and torch.equal(copies.committed["b"], torch.zeros(4))
    shadow_b.fill_(7.0)
    refit(commit=True)
    assert copies.committed["a"] is held_a  # patched where it lies, not replaced by a clone
    assert torch.equal(held_a, torch.tensor([0.0, 1.0, 2.0, 40.0, 4.0, 5.0]))
    assert torch.equal(copies.committed["b"], torch.full((4,), 7.0))
    assert copies.nbytes == 10 * 4
    copies.begin()
    copies.drop(live_changed=True)
    assert copies.committed == {}
