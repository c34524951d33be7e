"""The refit group's control plane admits only its own job: the store listens on the address
it is given, every control value is authenticated with the job's secret, nothing read from
the network is unpickled, and an abort reaches every rank at once."""

from __future__ import annotations

import pickle
import re
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from mcore_reshard.errors import RefitAborted, RefitTimeout
from mcore_reshard.infra.ports import free_port
from mcore_reshard.testing import attacks
from mcore_reshard.transport.group import RankMap, RefitGroup


def _pair(secret: str = "s3cret", timeout_s: float = 10.0):
    """Two ranks of one group; like the driver, every group gets a fresh nonce."""
    import secrets

    rm, port, groups, nonce = RankMap.disaggregated(1, 1), free_port(), {}, secrets.token_hex(8)
    th = threading.Thread(target=lambda: groups.update(
        {1: RefitGroup.create("127.0.0.1", port, 1, 2, timeout_s, False, rank_map=rm, secret=secret, nonce=nonce)}))
    th.start()
    groups[0] = RefitGroup.create("127.0.0.1", port, 0, 2, timeout_s, True, rank_map=rm, secret=secret, nonce=nonce)
    th.join(20)
    return port, groups


def _close(groups):
    for g in groups.values():
        g.close(barrier=False)


def test_store_listens_only_on_the_given_address():
    port, groups = _pair()
    try:
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
        assert listening, "the store's listening socket was not found"
        assert all(c.laddr.ip == "127.0.0.1" for c in listening), listening  # never 0.0.0.0 / ::
    finally:
        _close(groups)


class _Payload:
    """A pickle that would create a file if anyone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_planted_values_are_ignored_and_counted_never_unpickled(tmp_path, caplog):
    port, groups = _pair()
    marker = tmp_path / "pwned"
    try:
        # A stray client on the same store plants a pickle under the very key rank 1's next
        # exchange value will use (it cannot know that name; this is the worst case).
        g0, g1 = groups[0], groups[1]
        slot = g0.control._slot("ctl", g0.control.epoch, 0, 1)
        g0.store.set(slot, pickle.dumps(_Payload(str(marker))))
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(v=g0.control.exchange({"from": 0}, timeout_s=10)))
        t.start()
        time.sleep(0.3)  # rank 0 has polled the planted value many times by now
        assert g0.rejected["ctl"] >= 2
        # counted on every poll, logged once
        assert sum("rejected a ctl value" in r.getMessage() for r in caplog.records) == 1
        assert g1.control.exchange({"from": 1}, timeout_s=10) == [{"from": 0}, {"from": 1}]
        t.join(10)
        assert got["v"] == [{"from": 0}, {"from": 1}]  # the real value replaced the planted one
        assert not marker.exists()  # nothing was unpickled
    finally:
        _close(groups)


def _signed_vote(g, epoch: int, rank: int) -> bytes:
    return g.store.get(g.control._slot("vote", epoch, 0, rank))


def test_replayed_votes_and_aborts_are_rejected():
    """A signed "ok" of rank 1 copied into the next refit, or from another group of the same
    job, does not count: the other rank never commits on it."""
    port, groups = _pair(timeout_s=10.0)
    try:
        g0, g1 = groups[0], groups[1]
        for g in (g0, g1):
            g.control.begin_refit(1)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(d=g1.control.decide(True, {"r": 1})))
        t.start()
        assert g0.control.decide(True, {"r": 0}).commit
        t.join(10)
        assert out["d"].commit and out["d"].payloads == ({"r": 0}, {"r": 1})
        ok_vote = _signed_vote(g0, 1, 1)
        g1.control.post_abort("source rank 1: failing on purpose")
        abort = g0.store.get(g0.control._slot("abort", 1, 0, 1))
        # refit 2: the recorded "ok" and abort of refit 1 are replayed into refit 2's slots
        for g in (g0, g1):
            g.control.begin_refit(2)
        g0.store.set(g0.control._slot("vote", 2, 0, 1), ok_vote)
        g0.store.set(g0.control._slot("abort", 2, 0, 1), abort)
        g0.store.add(g0.control._slot("hint", 2, 0, -1), 1)
        assert g0.control.abort_message() is None and g0.rejected["abort"] == 1  # the replayed abort stops nobody
        t0 = time.monotonic()
        d0 = g0.control.decide(True, {"r": 0}, timeout_s=1.0)  # rank 1 never votes in refit 2
        assert not d0.commit and d0.known and time.monotonic() - t0 >= 1.0
        assert "no vote" in d0.errors[0] and "group rank 1" in d0.errors[0]
        assert g0.rejected["vote"] >= 1
    finally:
        _close(groups)
    # another group of the same job (same secret, a new nonce): refit 1's vote means nothing there
    port, groups = _pair(timeout_s=10.0)
    try:
        g0 = groups[0]
        for g in groups.values():
            g.control.begin_refit(1)
        g0.store.set(g0.control._slot("vote", 1, 0, 1), ok_vote)
        assert not g0.control.decide(True, None, timeout_s=0.5).commit
        assert g0.rejected["vote"] >= 1
    finally:
        _close(groups)


def test_garbage_in_the_abort_path_does_not_delay_an_abort():
    """An outside writer fills the store with garbage (even at the exact key of rank 1's
    abort and its hint counter): rank 1's real abort still stops rank 0 at once."""
    import torch

    port, groups = _pair(timeout_s=60.0)
    try:
        g0, g1 = groups[0], groups[1]
        for g in (g0, g1):
            g.control.begin_refit(1)
        g0.store.set(g0.control._slot("abort", 1, 0, 1), "garbage")
        g0.store.add(g0.control._slot("hint", 1, 0, -1), 5)
        for i in range(50):
            g0.store.set(f"abort/{i}", "garbage")
        work = g0.recv(torch.empty(4), 1, 7)  # rank 1 never sends
        threading.Timer(0.5, g1.control.post_abort, args=("source rank 1: injected failure",)).start()
        t0 = time.monotonic()
        with pytest.raises(RefitAborted, match="injected failure"):
            g0.wait_work(work, 60.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        _close(groups)


def test_abort_reaches_a_rank_blocked_in_a_receive_within_a_second():
    """A rank waiting for bytes that will never come stops at the abort signal, not at its
    timeout (gloo cannot cancel the receive; the wait is abandoned)."""
    import torch

    port, groups = _pair(timeout_s=60.0)
    try:
        g0, g1 = groups[0], groups[1]
        g0.control.begin_refit()
        g1.control.begin_refit()
        work = g1.recv(torch.empty(4), 0, 7)  # rank 0 never sends
        threading.Timer(0.5, g0.control.post_abort, args=("source rank 0: injected failure",)).start()
        t0 = time.monotonic()
        with pytest.raises(RefitAborted, match="injected failure"):
            g1.wait_work(work, 60.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        _close(groups)


@pytest.mark.heavy  # 1000 refits of the control plane
def test_store_key_count_is_constant_over_1000_refits():
    """Every refit's keys are deleted: the store does not grow with a long run."""
    port, groups = _pair(timeout_s=10.0)
    counts: list[int] = []
    try:
        def rank(g, first, last):
            for e in range(first, last + 1):
                g.control.begin_refit(e, watch=True)
                g.control.check_agreement(["digest", "checksum"])
                assert g.control.decide(True, {"e": e}).commit
                if g.rank == 0:
                    counts.append(g._tcp_store.num_keys())

        def both(first, last) -> int:
            """Refits ``first..last`` on both ranks; the store's keys once both are done."""
            t = threading.Thread(target=rank, args=(groups[1], first, last))
            t.start()
            rank(groups[0], first, last)
            t.join(60)
            assert not t.is_alive()
            return groups[0]._tcp_store.num_keys()

        settled_early = both(1, 10)
        settled_late = both(11, 1000)
        assert len(counts) == 1000
        # Bounded, not growing: at rest after 1000 refits the store holds no more keys than
        # after 10; counted mid-run (the other rank may be a refit ahead or behind), the last
        # 200 refits never see more than the first 200 plus one key of a neighbouring refit.
        assert settled_late <= settled_early, (settled_early, settled_late)
        early, late = counts[10:210], counts[-200:]
        assert max(late) <= max(early) + 1, (early[:20], late[-20:])
        assert max(counts) < 20
    finally:
        _close(groups)


def _die_between_last_byte_and_vote(rank: int, port: int, q) -> None:
    import os

    from mcore_reshard.transport.group import RankMap, RefitGroup

    g = RefitGroup.create("127.0.0.1", port, rank, 3, 60.0, rank == 0, rank_map=RankMap.disaggregated(1, 2),
                          secret="s", nonce="n")
    g.control.begin_refit(1, watch=True)
    g.control.barrier()  # every rank is in the refit: the "transfer" is done
    if rank == 2:
        time.sleep(0.5)
        os._exit(7)  # dies before it votes
    t0 = time.monotonic()
    d = g.control.decide(True, None, timeout_s=60.0)
    q.put((rank, d.commit, d.known, list(d.errors), time.monotonic() - t0))


@pytest.mark.slow  # 3 spawned ranks
def test_a_rank_that_dies_before_its_vote_is_known_to_every_rank_within_two_seconds():
    """The death is visible at once (its sockets close), so no rank waits for the timeout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_die_between_last_byte_and_vote, args=(r, port, q), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict((r, rest) for r, *rest in (q.get(timeout=60) for _ in range(2)))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        commit, known, errors, seconds = got[r]
        assert not commit and known
        assert any("group rank 2" in e and "died" in e for e in errors), errors
        assert seconds < 2.0, seconds


# -- an outside writer that can write or delete any key: one power, failing a refit in time ----
# (the attacks themselves: ``mcore_reshard.testing.attacks``, also rows of ``scripts/soak.py --faults``)

def test_garbage_over_the_decision_after_one_rank_committed_every_rank_commits():
    """The probe's race: rank 0 commits, then the decision key is overwritten. The others read
    rank 0's signed copy of the decision and commit too, at once; the garbage is counted."""
    a = attacks.garbage_over_the_decision(4)
    assert a.outcomes == ["commit"] * 4, a
    assert a.slowest < 1.0, a
    assert a.rejected["decision"] >= 3, a


def test_the_previous_refits_signed_decision_over_this_one_and_no_copy_ends_unknown_and_named():
    """Refit 1's authentic abort decision is replayed over refit 2's commit, and rank 0's
    signed copy is deleted: the held ranks cannot learn the decision. Each ends within the
    echo wait (not the 30 s timeout, never a hang), unknown (so an engine worker reports
    ``unsure`` and its engine stays gated), with a line naming the replayed value."""
    a = attacks.replayed_decision_and_no_copy(3, timeout_s=30.0)
    assert a.outcomes == ["commit", "unknown", "unknown"], a
    assert a.slowest < 5.0, a
    for e in a.errors[1:]:
        assert "does not verify" in e and "replayed signed decision (refit 1" in e, a.errors


def test_deleted_decision_vote_exchange_and_abort_keys_end_in_time():
    decision = attacks.deleted_decision(3)  # the others find rank 0's signed copy
    assert decision.outcomes == ["commit"] * 3 and decision.slowest < 1.0, decision
    vote = attacks.deleted_vote(3)  # rank 1 posts its vote again
    assert vote.outcomes == ["commit"] * 3 and vote.slowest < 2.0, vote
    exchange = attacks.deleted_exchange_value(3)  # rank 0 posts its value again
    assert exchange.outcomes == [[0, 1, 2]] * 3 and exchange.slowest < 2.0, exchange
    abort = attacks.deleted_abort(3)  # rank 1's "no" still aborts at once
    assert abort.outcomes == ["abort"] * 3 and abort.slowest < 2.0, abort
    assert "rank 1: no" in abort.errors[0], abort.errors


def test_garbage_in_the_abort_hint_is_counted_and_the_refit_still_commits():
    """A non-integer in the hint would make ``TCPStore.add`` drop the caller's connection (and
    every rank report the store's host dead): the hint is a signed presence flag, never added."""
    a = attacks.garbage_hint(2)
    assert a.outcomes == ["commit", "commit"] and a.errors == ["", ""], a
    assert a.rejected["hint"] >= 1, a
    # and a real abort still stops the other rank at once, the garbage notwithstanding
    groups = attacks.local_group(2)
    try:
        g0, g1 = groups[0], groups[1]
        g0.store.set(attacks.slot(g0, "hint"), "garbage")
        assert g0.control.abort_message() is None and g0.rejected["hint"] == 1
        g1.control.post_abort("destination rank 0: injected")
        time.sleep(attacks_rescan())
        assert "injected" in g0.control.abort_message()
    finally:
        attacks.close_group(groups)


def attacks_rescan() -> float:
    from mcore_reshard.transport import control

    return control._RESCAN_S + 0.05


def test_every_engine_fault_survives_the_wire():
    """What a test injects on a vLLM worker reaches it whole through ``update_info``: a fault at
    a protocol step, a destination bit flip where a box lands (no step: it was once dropped on
    the wire, so such a refit silently ran clean), a worker's exit after n writes, an altered
    baseline."""
    from mcore_reshard.wire.faults import EngineFault, Fault

    for fault in (EngineFault(1, Fault("sleep", at="before_vote", seconds=2.0)),
                  EngineFault(0, Fault(tensor="draft.model.layers.4.eh_proj.weight", offset=64)),
                  EngineFault((1, 3), exit_after_writes=5), EngineFault(2, alter_baseline="model.norm.weight")):
        assert EngineFault.from_wire(fault.to_wire()) == fault


# -- two-phase commit's rule: only the coordinator commits; a rank that voted ok never aborts alone --

@pytest.mark.heavy  # waits out the attack's real deadlines (about 11 s)
def test_a_persistent_deleting_writer_and_a_late_reader_cannot_split_the_decision():
    """Every vote, decision and signed copy is deleted as soon as it is written, for the whole
    refit, and one rank reads 3 s late. Once, the ranks that read the coordinator's commit in
    time committed while the late ones timed out and wrote an abort over the emptied key (the
    key written twice, both outcomes "known"). Now only the coordinator decides: commit once it
    caught every rank's "ok" (each rank re-posts its own while it waits), or abort at its
    deadline if the writer kept one from it; every other rank reads that one decision or ends
    unsure. Never two known outcomes; every rank ends by its deadline plus the grace."""
    a = attacks.persistent_deleter_and_late_reader(4, late=3, late_s=3.0, timeout_s=6.0)
    assert a.rejected["deleted"] > 0, a  # the writer did delete
    assert "hung" not in a.outcomes and a.outcomes[0] in ("commit", "abort"), a
    assert set(a.outcomes) <= {a.outcomes[0], "unknown"}, a  # one decision, or none learnt
    assert all(s is not None and s < 6.0 + 3.0 + 2.0 + 1.0 for s in a.seconds), a
    for outcome, e in zip(a.outcomes, a.errors):
        assert outcome != "unknown" or "could not learn the refit's decision" in e, a.errors


def test_a_rank_that_voted_ok_asks_the_coordinator_to_abort_at_its_deadline():
    """Rank 2 never votes; rank 1 voted ok and meets its (short) deadline first: it does not
    decide abort itself, it asks the coordinator (rank 0, whose own deadline is far off), which
    aborts at once; both read that one decision, naming the silent rank."""
    groups = attacks.local_group(3, timeout_s=30.0)
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(d0=groups[0].control.decide(True, None, timeout_s=30.0)))
        t.start()
        t0 = time.monotonic()
        d1 = groups[1].control.decide(True, None, timeout_s=1.0)
        seconds = time.monotonic() - t0
        t.join(10)
        assert d1.known and not d1.commit and seconds < 3.0, (d1, seconds)
        assert out["d0"].known and not out["d0"].commit, out
        assert "destination rank 1 (group rank 2): no vote within 1.0s" in d1.errors[0], d1.errors
        assert d1.errors == out["d0"].errors[:len(d1.errors)]  # one decision
    finally:
        attacks.close_group(groups)


def test_a_long_wait_backs_off_its_polls():
    """A rank waiting in an exchange polls every 5 ms at first, then every tenth of its wait so
    far, at most every 20 ms: over a 1 s wait for a rank that never posts, at most about 65
    polls (fixed 5 ms polls: about 200), and the wait still ends at its deadline, naming it."""
    groups = attacks.local_group(2, timeout_s=30.0)
    try:
        control, polls = groups[0].control, []
        check = control.raise_if_aborted
        control.raise_if_aborted = lambda: (polls.append(time.monotonic()), check())[1]  # once per poll
        with pytest.raises(RefitTimeout, match="no answer from destination rank 0 .* within 1.0s"):
            control.exchange("mine", timeout_s=1.0)
        gaps = [b - a for a, b in zip(polls, polls[1:])]
        assert 30 <= len(polls) <= 100, len(polls)
        assert min(gaps[:5]) < 0.015 and max(gaps[-5:]) >= 0.018, (gaps[:5], gaps[-5:])
    finally:
        attacks.close_group(groups)


def test_a_rank_that_raises_reaches_every_rank_within_a_second_with_every_hint_deleted():
    """Ranks inside their transfer once read the aborts only while the hint existed: with each
    hint deleted as it appeared they learned at their timeout (20 s). The slow scan finds the
    abort without it: every rank stops within about a second."""
    a = attacks.deleted_hints_and_a_raising_rank(4, timeout_s=20.0)
    assert a.outcomes == ["aborted", "abort", "aborted", "aborted"], a
    assert all(s is not None and s < 1.5 for s in a.seconds), a
    assert all("raised on purpose" in e for e in a.errors), a.errors


def _dropped_receive(rank: int, world: int, port: int, q) -> None:
    """Rank 1 posts a receive and drops its ``Work`` (a refit unwinding at an abort); rank 0
    then sends its bytes. Rank 1 reports its busy threads, then closes; rank 0 reports how its
    own pending receive from rank 1 ended and its busy threads after."""
    import os
    from datetime import timedelta

    import torch

    from mcore_reshard.testing.idle import busy
    from mcore_reshard.transport.group import RankMap, RefitGroup

    g = RefitGroup.create("127.0.0.1", port, rank, 2, 60.0, rank == 0, rank_map=RankMap.disaggregated(1, 1),
                          secret="s", nonce="n")
    g.control.begin_refit(1)
    if rank == 1:
        g.recv(torch.zeros(60_000, dtype=torch.uint8), 0, 8)  # posted, its Work dropped at once
        g.control.barrier()
        g.control.barrier()  # rank 0 has sent
        time.sleep(0.5)
        q.put((1, {"hot": busy([os.getpid()], seconds=1.5)}))
        g.control.barrier()
        g.close(barrier=False)
        time.sleep(3.0)  # alive while rank 0 looks: its pending wait must fail on the closed sockets
        return
    g.control.barrier()
    g.send(torch.ones(60_000, dtype=torch.uint8), 1, 8).wait(timedelta(seconds=30))
    pending = g.recv(torch.zeros(4, dtype=torch.uint8), 1, 9)  # rank 1 never sends this
    g.control.barrier()
    g.control.barrier()
    t0 = time.monotonic()
    try:
        pending.wait(timedelta(seconds=30))
        ended = "completed"
    except RuntimeError as exc:
        ended = str(exc)
    seconds = time.monotonic() - t0
    g.close(barrier=False)
    q.put((0, {"ended": ended, "seconds": seconds, "hot": busy([os.getpid()], seconds=1.0)}))


@pytest.mark.slow  # 2 spawned ranks (gloo's pairs of a second in-process group do not deliver here)
def test_a_receive_dropped_by_a_failed_refit_leaves_no_thread_spinning_and_close_tears_down_at_once():
    """A failed refit unwinds with receives still posted. Gloo left such a receive's pair
    waiting for a buffer that was gone: the bytes that then arrived stayed unread and its event
    loop woke on them forever, a full core (a vLLM worker after a killed trainer, for more than
    ten minutes). The data plane holds every posted receive until it completes or the group
    closes; closing tears every socket down at once, so a peer's pending wait fails at once."""
    from support.worlds import spawn_ranks

    got = spawn_ranks(_dropped_receive, 2, free_port(), wait_s=120.0)
    assert got[1]["hot"] == {}, got  # the receiver's loop is idle with the bytes of a dropped receive arrived
    ended, seconds = got[0]["ended"], got[0]["seconds"]
    assert re.search("(?i)closed|reset", ended) and seconds < 2.0, (ended, seconds)
    assert got[0]["hot"] == {}, got[0]["hot"]
