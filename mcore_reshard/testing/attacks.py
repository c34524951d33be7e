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
           "deleted_abort", "garbage_hint", "STORE_ATTACKS"]


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
        g.begin_refit(epoch)
    return groups


def close_group(groups: dict[int, RefitGroup]) -> None:
    for g in groups.values():
        g.close(barrier=False)


def begin(groups: dict[int, RefitGroup], epoch: int) -> None:
    for g in groups.values():
        g.begin_refit(epoch)


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
        d = groups[r].decide(oks.get(r, True), {"r": r}, "" if oks.get(r, True) else f"rank {r}: no",
                             timeout_s=timeout_s, after_vote=release.wait)
        out[r] = (d, time.monotonic() - released[0])

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, n)]
    for t in threads:
        t.start()
    g0 = groups[0]
    while sum(g0.control._read(g0.control._slot("vote", g0.control.epoch, 0, r)) is not None for r in range(1, n)) < n - 1:
        time.sleep(0.005)
    out[0] = (g0.decide(oks.get(0, True), {"r": 0}, timeout_s=timeout_s), 0.0)
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
            out[r] = (groups[r].decide(True, None, after_vote=hook), time.monotonic() - t0)

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
            res[r] = groups[r].exchange(r)
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
        groups[1].post_abort("destination rank 0: failing on purpose")
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
        polled = [g.abort_message() for g in groups.values()]  # as every transfer wait polls it
        got = decide_held(groups, lambda g: None)
        a = _result("garbage in the abort hint", groups, got)
        a.errors = [e or (p or "") for e, p in zip(a.errors, polled)]  # an abort seen in the poll is an error
        if any(g.control.store_dead for g in groups.values()):
            a.errors = [e or "a rank took the store for dead" for e in a.errors]
        return a
    finally:
        close_group(groups)


#: Every store attack, for the fault matrix.
STORE_ATTACKS: tuple[Callable[[], Attack], ...] = (
    garbage_over_the_decision, replayed_decision_and_no_copy, deleted_decision, deleted_vote,
    deleted_exchange_value, deleted_abort, garbage_hint)
