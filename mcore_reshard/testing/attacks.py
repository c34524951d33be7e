"""What a process that can reach the refit store can try, with the key names it could list:
each attack runs on a live group of ``n`` ranks in this process (one thread a rank) and returns
what every rank ended with. ``tests/test_control_plane.py`` asserts on them and
``scripts/soak.py --faults`` prints them as rows of its fault matrix.

The one power such a writer must have is failing a refit within its deadline (``control.py``):
each result says how long the ranks took and what they decided, so a hang or a split shows.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..infra.ports import free_port
from ..transport.control import Decision
from ..transport.group import RankMap, RefitGroup

__all__ = ["Attack", "local_group", "close_group", "decide_held", "garbage_over_the_decision",
           "replayed_decision_and_no_copy", "deleted_decision", "deleted_vote", "deleted_exchange_value",
           "deleted_abort", "garbage_hint", "Deleter", "persistent_deleter_and_late_reader", "deleted_hints_and_a_raising_rank",
           "STORE_ATTACKS"]


@dataclass
class Attack:
    """One attack's result: per rank its decision (``commit`` / ``abort`` / ``unknown``, or
    what an exchange returned), its first error line, and the seconds from the tampering
    until that rank was done (``None``: it never was, within the attack's own limit)."""

    name: str
    outcomes: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: list[float | None] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    #: Every rank must be done within this (the attacks that only fail a refit: at once; one
    #: that leaves ranks unsure: the refit's deadline plus the decision's grace).
    limit_s: float = 10.0

    @property
    def slowest(self) -> float | None:
        return None if any(s is None for s in self.seconds) else max(self.seconds, default=0.0)


def local_group(n: int, timeout_s: float = 10.0, epoch: int = 1) -> dict[int, RefitGroup]:
    """``n`` ranks of one refit group (one trainer, ``n - 1`` destinations), all in refit ``epoch``."""
    rm, port, groups, nonce = RankMap.disaggregated(1, n - 1), free_port(), {}, secrets.token_hex(8)
    threads = [threading.Thread(target=lambda r=r: groups.update({r: RefitGroup.create(
        "127.0.0.1", port, r, n, timeout_s, False, rank_map=rm, secret="job", nonce=nonce)})) for r in range(1, n)]
    for t in threads:
        t.start()
    groups[0] = RefitGroup.create("127.0.0.1", port, 0, n, timeout_s, True, rank_map=rm, secret="job", nonce=nonce)
    for t in threads:
        t.join(20)
    for g in groups.values():
        g.control.begin_refit(epoch)
    return groups


def close_group(groups: dict[int, RefitGroup]) -> None:
    for g in groups.values():
        g.close(barrier=False)


def begin(groups: dict[int, RefitGroup], epoch: int) -> None:
    for g in groups.values():
        g.control.begin_refit(epoch)


def slot(g: RefitGroup, kind: str, rank: int = -1, seq: int = 0) -> str:
    """The store key of ``rank``'s ``kind`` message in ``g``'s current refit (a writer lists it)."""
    return g.control._slot(kind, g.control.epoch, seq, rank)


def decide_held(groups: dict[int, RefitGroup], tamper: Callable[[RefitGroup], None], timeout_s: float = 10.0,
                oks: dict[int, bool] | None = None) -> list[tuple[Decision | None, float | None]]:
    """Rank 0 decides while every other rank has voted but is held before reading the decision
    (the race where a writer strikes between two readers, made certain); ``tamper(g0)`` runs
    then, and the held ranks go on. Per rank: (its decision, seconds from the release)."""
    release, out, n = threading.Event(), {}, len(groups)
    released = [0.0]
    oks = oks or {}

    def rank(r: int) -> None:
        d = groups[r].control.decide(oks.get(r, True), {"r": r}, "" if oks.get(r, True) else f"rank {r}: no",
                             timeout_s=timeout_s, after_vote=release.wait)
        out[r] = (d, time.monotonic() - released[0])

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, n)]
    for t in threads:
        t.start()
    g0 = groups[0]
    while sum(g0.control._read(g0.control._slot("vote", g0.control.epoch, 0, r)) is not None for r in range(1, n)) < n - 1:
        time.sleep(0.005)
    out[0] = (g0.control.decide(oks.get(0, True), {"r": 0}, timeout_s=timeout_s), 0.0)
    tamper(g0)
    released[0] = time.monotonic()
    release.set()
    for t in threads:
        t.join(timeout_s + 10)
    return [out.get(r, (None, None)) for r in range(n)]


def _result(name: str, groups: dict[int, RefitGroup], got: list[tuple[Decision | None, float | None]]) -> Attack:
    a = Attack(name)
    for d, s in got:
        a.outcomes.append("hung" if d is None else ("commit" if d.commit else "abort") if d.known else "unknown")
        a.errors.append("" if d is None or not d.errors else d.errors[0])
        a.seconds.append(s)
    for g in groups.values():
        for k, v in g.rejected.items():
            a.rejected[k] = a.rejected.get(k, 0) + v
    return a


def garbage_over_the_decision(n: int = 4) -> Attack:
    """Rank 0 committed; then the decision key is overwritten with garbage before the others read it."""
    groups = local_group(n)
    try:
        got = decide_held(groups, lambda g0: g0.store.set(slot(g0, "decision"), "garbage"))
        return _result("garbage over the decision after one rank committed", groups, got)
    finally:
        close_group(groups)


def replayed_decision_and_no_copy(n: int = 3, timeout_s: float = 30.0) -> Attack:
    """Refit 1's authentic abort decision replayed over refit 2's commit, and rank 0's signed
    copy deleted: the held ranks cannot learn refit 2's decision."""
    groups = local_group(n, timeout_s)
    try:
        decide_held(groups, lambda g0: None, oks={r: False for r in range(1, n)})
        old = groups[0].control._read(slot(groups[0], "decision"))
        begin(groups, 2)

        def tamper(g0: RefitGroup) -> None:
            g0.store.set(slot(g0, "decision"), old)
            g0.store.delete_key(slot(g0, "decided", 0))

        got = decide_held(groups, tamper, timeout_s)
        return _result("the previous refit's signed decision over this one, and the committer's copy deleted",
                       groups, got)
    finally:
        close_group(groups)


def deleted_decision(n: int = 3) -> Attack:
    """Rank 0 committed; then the decision key is deleted before the others read it."""
    groups = local_group(n)
    try:
        got = decide_held(groups, lambda g0: g0.store.delete_key(slot(g0, "decision")))
        return _result("the decision deleted after one rank committed", groups, got)
    finally:
        close_group(groups)


def deleted_vote(n: int = 3) -> Attack:
    """Rank 1's vote is deleted as soon as it is written (before anyone read it)."""
    groups = local_group(n)
    try:
        g1, out = groups[1], {}
        t0 = time.monotonic()

        def rank(r: int) -> None:
            hook = (lambda: g1.store.delete_key(slot(g1, "vote", 1))) if r == 1 else None
            out[r] = (groups[r].control.decide(True, None, after_vote=hook), time.monotonic() - t0)

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return _result("a vote deleted as soon as it was written", groups, [out.get(r, (None, None)) for r in range(n)])
    finally:
        close_group(groups)


def deleted_exchange_value(n: int = 3) -> Attack:
    """Rank 0's exchange value is deleted before the others post theirs (and read it)."""
    groups = local_group(n)
    try:
        g0, res, when = groups[0], {}, {}
        key = slot(g0, "ctl", 0, g0.control._seq)
        t0 = time.monotonic()

        def rank(r: int) -> None:
            res[r] = groups[r].control.exchange(r)
            when[r] = time.monotonic() - t0

        first = threading.Thread(target=rank, args=(0,), daemon=True)
        first.start()
        while g0.control._read(key) is None:
            time.sleep(0.001)
        g0.store.delete_key(key)
        rest = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, n)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(20)
        a = Attack("an exchange value deleted before the others read it")
        a.outcomes = [res.get(r, "hung") for r in range(n)]
        a.errors = [""] * n
        a.seconds = [when.get(r) for r in range(n)]
        return a
    finally:
        close_group(groups)


def deleted_abort(n: int = 3) -> Attack:
    """Rank 1 posts its abort and the key is deleted at once; rank 1 then votes no."""
    groups = local_group(n)
    try:
        groups[1].control.post_abort("destination rank 0: failing on purpose")
        groups[0].store.delete_key(slot(groups[0], "abort", 1))
        got = decide_held(groups, lambda g0: None, oks={1: False})
        return _result("an abort deleted right after it was posted (its rank then votes no)", groups, got)
    finally:
        close_group(groups)


def garbage_hint(n: int = 2) -> Attack:
    """A non-integer where the abort hint goes, before the refit's votes: ``TCPStore.add`` on
    it would drop the caller's connection (every rank would report the store's host dead)."""
    groups = local_group(n)
    try:
        g0 = groups[0]
        g0.store.set(slot(g0, "hint"), "garbage")
        polled = [g.control.abort_message() for g in groups.values()]  # as every transfer wait polls it
        got = decide_held(groups, lambda g: None)
        a = _result("garbage in the abort hint", groups, got)
        a.errors = [e or (p or "") for e, p in zip(a.errors, polled)]  # an abort seen in the poll is an error
        if any(g.control.store_dead for g in groups.values()):
            a.errors = [e or "a rank took the store for dead" for e in a.errors]
        return a
    finally:
        close_group(groups)


class Deleter:
    """An outside writer that lists the store and deletes every key of the given kinds as soon
    as it appears, for as long as it runs (a thread; ``with Deleter(store, ("vote",)):``). It
    needs no secret: key names are listed, never guessed."""

    def __init__(self, store: Any, kinds: tuple[str, ...]) -> None:
        self.store, self.kinds = store, tuple(f"{k}/" for k in kinds)
        self.deleted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="store-deleter")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for k in self.store.list_keys():
                    if any(kind in k for kind in self.kinds):
                        self.deleted += bool(self.store.delete_key(k))
            except Exception:  # noqa: BLE001 - a slow or closed store: keep trying until stopped
                time.sleep(0.01)
                continue
            time.sleep(0.0005)

    def __enter__(self) -> "Deleter":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


def persistent_deleter_and_late_reader(n: int = 4, late: int = 3, late_s: float = 3.0,
                                       timeout_s: float = 6.0) -> Attack:
    """A writer deletes every vote, decision and signed copy of it as soon as each is written,
    for the whole refit, and rank ``late`` reads the decision ``late_s`` late (it voted ok at
    once). The split this once made: ranks that read the coordinator's commit in time committed,
    the late ones timed out and wrote an abort over the emptied key. Now every rank that voted
    ok either read the commit or ends unsure -- no rank decides abort on its own."""
    groups = local_group(n, timeout_s)
    try:
        out: dict[int, tuple[Decision, float]] = {}
        t0 = time.monotonic()

        def rank(r: int) -> None:
            hook = (lambda: time.sleep(late_s)) if r == late else None
            out[r] = (groups[r].control.decide(True, {"r": r}, timeout_s=timeout_s, after_vote=hook), time.monotonic() - t0)

        with Deleter(groups[0]._tcp_store, ("vote", "decision", "decided")) as deleter:
            threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s + late_s + 10)
        a = _result("a persistent writer deletes every vote, decision and copy; one rank reads 3 s late", groups,
                    [out.get(r, (None, None)) for r in range(n)])
        a.rejected["deleted"] = deleter.deleted
        a.limit_s = timeout_s + late_s + 2.0 + 1.0
        return a
    finally:
        close_group(groups)


def deleted_hints_and_a_raising_rank(n: int = 4, timeout_s: float = 20.0) -> Attack:
    """Every abort hint is deleted as it appears; rank 1 raises inside its transfer (posts its
    abort, votes no) while every other rank is blocked in a receive that will never complete.
    Each must learn of the abort from the slow scan within about a second, not at its timeout.
    Per rank: "aborted" (its wait stopped at the abort) or what ended it, and the seconds."""
    import torch

    from ..errors import RefitAborted

    groups = local_group(n, timeout_s)
    try:
        got: dict[int, tuple[str, str, float]] = {}
        t0 = time.monotonic()

        def blocked(r: int) -> None:  # a rank inside its transfer: waiting for bytes from rank 1
            try:
                groups[r].wait_work(groups[r].recv(torch.empty(4), 1, 7), timeout_s)
                got[r] = ("received", "", time.monotonic() - t0)
            except RefitAborted as exc:
                got[r] = ("aborted", str(exc), time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - any other end is named
                got[r] = (type(exc).__name__, str(exc), time.monotonic() - t0)

        with Deleter(groups[0]._tcp_store, ("hint",)) as deleter:
            threads = [threading.Thread(target=blocked, args=(r,), daemon=True) for r in range(n) if r != 1]
            for t in threads:
                t.start()
            time.sleep(0.3)
            groups[1].control.post_abort("source rank 1: raised on purpose")
            d = groups[1].control.decide(False, None, "source rank 1: raised on purpose", timeout_s=timeout_s)
            got[1] = ("abort" if d.known and not d.commit else "commit" if d.commit else "unknown",
                      d.errors[0] if d.errors else "", time.monotonic() - t0)
            for t in threads:
                t.join(timeout_s + 5)
        a = Attack("every abort hint deleted as it appears; a rank raises while the others wait for its bytes")
        a.outcomes = [got.get(r, ("hung", "", None))[0] for r in range(n)]
        a.errors = [got.get(r, ("", "", None))[1].splitlines()[0] if got.get(r, ("", "", None))[1] else ""
                    for r in range(n)]
        a.seconds = [got.get(r, ("", "", None))[2] for r in range(n)]
        a.rejected["deleted"] = deleter.deleted
        a.limit_s = 1.5  # the slow scan, not the timeout
        return a
    finally:
        close_group(groups)


#: Every store attack, for the fault matrix.
STORE_ATTACKS: tuple[Callable[[], Attack], ...] = (
    garbage_over_the_decision, replayed_decision_and_no_copy, deleted_decision, deleted_vote,
    deleted_exchange_value, deleted_abort, garbage_hint, persistent_deleter_and_late_reader,
    deleted_hints_and_a_raising_rank)
