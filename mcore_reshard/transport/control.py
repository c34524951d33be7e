"""The refit group's control plane: signed messages through the rendezvous store.

Every rank of a refit group (trainers and every engine's workers) talks through one
``TCPStore``. The data plane (``group.py``) moves bytes; this class moves the few small
messages that decide a refit: the per-refit agreement on the plan, the abort signal and the
commit vote.

What it guarantees, and against whom
------------------------------------
A process that can reach the store but does not hold the job's secret (another job on the
host, an attacker on the network) can list every key (``TCPStore`` has no access control and
``list_keys`` works), read every value, write and delete. So:

* **Integrity holds.** Every value is JSON carrying an HMAC-SHA256 under the job's secret over
  (the group's nonce, the message kind, the refit epoch, the sequence number, the sender's
  rank, the body). The nonce is fresh per refit group (the driver draws it at every join), the
  epoch and sequence are those of one refit, and the reader checks all of them: a value copied
  from another group, another refit, another step of the same refit or another rank is
  rejected (counted in ``rejected``, logged once per key, never used). Nothing read from the
  network is unpickled. So no outside writer can forge a vote, an abort or a decision, and
  no replay of a real one is accepted where it was not sent.
* **Slots cannot be squatted.** Every key name is an HMAC of (nonce, kind, epoch, sequence,
  rank): listing the store shows the names of messages already written, never the name of one
  still to come, so no one can pre-plant a value a rank would then fail to overwrite. Each rank
  posts its abort to its own key (``set``, never ``compare_set``); the only write-once key is
  the refit's decision, whose name is unknown until its first writer creates it.
* **Availability, bounded.** A writer on the store can delete or overwrite keys after they
  appear. That gives it exactly one power: failing a refit within its deadline. No read
  blocks (``_read`` is one ``compare_set`` that returns at once, present or not), no value is
  parsed as anything but signed JSON (the abort hint is a presence flag, never ``add``-ed: a
  non-integer there makes ``TCPStore`` drop the caller's connection), a rank re-posts its own
  vote or exchange value when it finds it deleted, and every wait ends at the refit's
  deadline with a line naming what was found (a value that does not verify, or none). The
  outcome is then the old weights, or -- where some worker committed and another could not
  learn the decision -- an ``unsure`` worker, whose engine the driver keeps gated until a
  refit commits on all of its workers. Never a hang, never a mix. Keep the store's address
  off untrusted networks.

The decision
------------
``decide`` is a two-phase commit with one durable decision per refit: every rank writes its
vote, then waits for the signed decision, and commits only on reading a commit decision.
Who may write one is two-phase commit's rule, and it is what keeps the decision single even
when a writer on the store keeps deleting it (``compare_set`` guards an empty key only once):

* **commit**: only the coordinator, group rank 0 (the store's host, which also watches every
  peer's socket), after reading every rank's "ok";
* **abort**: a rank that voted no, a rank that read another rank's signed "no" (a "no" means
  no rank can have read all votes "ok"), or the coordinator, which decides commit alone and
  has not.

A rank that voted "ok" never decides abort on its own, however long it waits: the decision
may exist and have been deleted before it could read it. At its deadline, or at an abort
signal, it asks the coordinator to abort (``post_abort``) and keeps reading; if no decision
reaches it by the deadline plus ``_DECISION_GRACE_S`` it gets ``known=False`` -- unsure --
and must not serve what it staged (an engine worker stays gated until a later refit commits
on it). So no two ranks are ever sure of outcomes that contradict each other: every
authentic decision of a refit says the same thing. A rank that cannot read the decision
because the store's host died is unsure the same way.

Every rank that learns the decision posts a signed copy under its own key (``decided``)
*before* it acts on it. The shared key can be overwritten or deleted once it exists; the
copies make that harmless: a rank that finds the shared key holding a value that does not
verify, or about to propose because it found none, first looks for any rank's signed copy
and adopts it. The rule every rank applies: the first authentic decision it reads -- the
shared key, else any rank's copy -- is the decision; an unauthentic value is counted and
never waited on past ``_ECHO_WAIT_S`` (no valid decision can appear under a shared key that
holds one: ``compare_set`` writes only an empty slot) or the refit's deadline plus
``_DECISION_GRACE_S``. Why copies rather than per-rank votes on the outcome: a decision needs
one writer (a commit seen by one rank and a timeout seen by another must not both stand); the
copies keep that single writer and only add places to read its words from.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

from ..errors import RefitAborted, RefitTimeout
from ..wire.protocol import RankMap

__all__ = ["COORDINATOR", "ControlPlane", "Decision", "Signals", "SignedStore", "StoreGone"]

_log = logging.getLogger("mcore_reshard.transport")
#: A waiting rank's first polls come every ``_POLL_S``; then every tenth of the time it has
#: waited so far, at most ``_POLL_MAX_S`` apart (:func:`_poll_pause`).
_POLL_S = 0.005
_POLL_MAX_S = 0.02
_VOTE_AFTER_ABORT_S = 0.5  # how long a decider waits for the aborting rank's own "no" vote
#: After the shared decision key is found holding a value that does not verify: how long a rank
#: waits for another rank's signed copy of the decision before it reports the decision unknown.
_ECHO_WAIT_S = 2.0
#: Past the vote's deadline: how long a rank may still take to write or read the decision.
_DECISION_GRACE_S = 2.0
#: After an abort with refusals: how long a rank waits for the other ranks' "no" votes to name them all.
_REFUSALS_WAIT_S = 0.3
#: How often a waiting rank checks that its own vote or exchange value is still there.
_REPOST_EVERY_S = 0.1
#: With the abort hint present but no authentic abort found: how often to look again.
_RESCAN_S = 0.1
#: With no abort hint (none posted, or an outside writer deleted it): how often a rank looks
#: for an abort all the same -- the coordinator at every rank's abort key, every other rank at
#: the coordinator's abort and the decision -- so a rank that raises reaches every other within
#: about two of these even when each hint is deleted as it appears.
_SCAN_S = 0.5
#: The group rank that alone may decide commit (two-phase commit's coordinator).
COORDINATOR = 0
#: What ``_read``'s ``compare_set`` expects and writes: no real value is ever this.
_ABSENT = b"\x00absent"


def _poll_pause(start: float) -> float:
    """How long a rank that began waiting at ``start`` sleeps before its next poll: a tenth of
    the wait so far, between ``_POLL_S`` and ``_POLL_MAX_S``. Each poll is a few store round
    trips per rank: a wait of seconds (a slow peer, a long transfer elsewhere) polls four
    times less often than at a fixed ``_POLL_S``, and adds at most a tenth to a short one."""
    return min(_POLL_MAX_S, max(_POLL_S, (time.monotonic() - start) / 10))


class StoreGone(RefitAborted):
    """The refit store is unreachable (its host, group rank 0, died or closed it)."""


@dataclass(frozen=True)
class Decision:
    """The one outcome of a refit that every rank reads (or knows it could not read)."""

    commit: bool
    errors: tuple[str, ...] = ()
    #: False: this rank could not read the decision (store gone); it must not serve what it staged.
    known: bool = True
    #: Every rank's vote payload, by group rank (None where it had not voted or was not read).
    payloads: tuple[Any, ...] = field(default=(), compare=False)


class SignedStore:
    """One rank's signed messages in the group's store: their unguessable names, their MACs,
    reading them back and checking them, and how long this rank's keys live (see the module
    docstring). ``ControlPlane`` is what is said with them."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, key: bytes, nonce: str) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self._key, self.nonce = key, nonce
        self.epoch = 0
        #: Rejected (unauthenticated, replayed or misplaced) values, by message kind.
        self.rejected: Counter[str] = Counter()
        #: What the last rejected value of each kind was (garbage, or whose signed value).
        self.last_rejected: dict[str, str] = {}
        self._logged: set[str] = set()
        self.store_dead = False
        self._last_ctl: str | None = None  # this rank's last exchange key (``ControlPlane.exchange``)
        self._epoch_keys: list[str] = []  # this rank's keys of the current refit
        self._old_keys: list[str] = []  # ... and of the one before (deleted when the next begins)

    # -- naming and signing ------------------------------------------------------------------
    def derived_key(self, purpose: str) -> bytes:
        """A key for ``purpose`` (e.g. naming shared-memory segments) derived from the job's
        secret: the MAC key itself never leaves this object."""
        return hmac.new(self._key, f"derive|{purpose}".encode(), hashlib.sha256).digest()

    def _slot(self, kind: str, epoch: int, seq: int, rank: int) -> str:
        tag = hmac.new(self._key, f"slot\0{self.nonce}\0{kind}\0{epoch}\0{seq}\0{rank}".encode(), hashlib.sha256)
        return f"{kind}/{tag.hexdigest()[:24]}"

    def _mac(self, kind: str, epoch: int, seq: int, rank: int, body: str) -> str:
        msg = f"{self.nonce}\0{kind}\0{epoch}\0{seq}\0{rank}\0{body}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def _sign(self, kind: str, seq: int, obj: Any, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        body = json.dumps(obj)
        return json.dumps({"k": kind, "e": self.epoch, "s": seq, "r": rank, "b": body,
                           "m": self._mac(kind, self.epoch, seq, rank, body)})

    def _open(self, slot: str, raw: bytes, kind: str, seq: int, rank: int | None) -> tuple[bool, Any, int]:
        """(authentic, value, sender rank). ``rank`` None: any rank may have sent it. A value
        that is not authentic is counted (``rejected``) and its kind remembered
        (``last_rejected``: garbage, or a signed value of another refit, step, slot or rank)."""
        what = "garbage (not a message signed with this job's secret)"
        try:
            msg = json.loads(raw)
            r = int(msg["r"])
            mac_ok = 0 <= r < self.world_size and hmac.compare_digest(
                str(msg["m"]), self._mac(str(msg["k"]), int(msg["e"]), int(msg["s"]), r, msg["b"]))
            if mac_ok and msg["k"] == kind and msg["e"] == self.epoch and msg["s"] == seq and rank in (None, r):
                return True, json.loads(msg["b"]), r
            if mac_ok:
                what = (f"a replayed signed {msg['k']} (refit {msg['e']}, step {msg['s']}, rank {r}), "
                        f"not this refit's {kind}")
        except (ValueError, KeyError, TypeError):
            pass
        self.rejected[kind] += 1
        self.last_rejected[kind] = what
        if slot not in self._logged:
            self._logged.add(slot)
            _log.warning("refit control plane: rejected a %s value that is not this refit's own (%s): %s",
                         kind, slot, what)
        return False, None, -1

    # -- store access: any error means the store's host is gone ------------------------------
    def _store(self, fn: str, *args: Any) -> Any:
        if self.store_dead:
            raise StoreGone("the refit store is unreachable (its host, group rank 0, is gone)")
        try:
            return getattr(self.store, fn)(*args)
        except Exception as exc:  # noqa: BLE001 - TCPStore raises RuntimeError/DistStoreError/...
            self.store_dead = True
            raise StoreGone(f"the refit store is unreachable (its host, group rank 0, is gone): "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None

    def _put(self, slot: str, value: str) -> None:
        self._store("set", slot, value)
        self._epoch_keys.append(slot)

    def _read(self, slot: str) -> bytes | None:
        """The value at ``slot`` or None, in one round trip that never blocks: ``compare_set``
        with an expected value no writer uses returns the current value, or that value when the
        key is absent (``get`` would wait for a key deleted after a ``check``)."""
        raw = self._store("compare_set", slot, _ABSENT, _ABSENT)
        return None if raw == _ABSENT else raw

    def _repost(self, slot: str, value: str) -> None:
        """Write this rank's own ``value`` again if an outside writer deleted or replaced it."""
        if self._read(slot) != value.encode():
            self._store("set", slot, value)

    def _read_msg(self, kind: str, seq: int, rank: int) -> tuple[bool, Any]:
        """(there and authentic, value) of ``rank``'s ``kind`` message #``seq`` of this refit."""
        slot = self._slot(kind, self.epoch, seq, rank)
        raw = self._read(slot)
        if raw is None:
            return False, None
        ok, value, _ = self._open(slot, raw, kind, seq, rank)
        return ok, value

    # -- key lifetimes -----------------------------------------------------------------------
    def _next_epoch(self, epoch: int, shared: list[str]) -> None:
        """Move to refit ``epoch``: delete this rank's keys of the refit before the last one;
        ``shared``: keys of the last refit that this rank deletes along with its own, next time."""
        stale, self._old_keys = self._old_keys, self._epoch_keys + shared
        self._epoch_keys = []
        self._delete([k for k in stale if k != self._last_ctl])
        self.epoch = epoch

    def forget(self) -> None:
        """On leaving: delete this rank's keys of the refit before the last (best effort). The
        last refit's stay -- a rank that fails leaves right after the vote, while its peers may
        still be reading its abort or vote -- and go with the store: a group that failed is
        never used again, and its store lives only as long as its rank 0."""
        keys, self._old_keys = self._old_keys, []
        self._delete([k for k in keys if k != self._last_ctl])

    def _delete(self, keys: list[str]) -> None:
        if self.store_dead:
            return
        for k in keys:
            try:
                self.store.delete_key(k)
            except Exception:  # noqa: BLE001 - the store may be gone; nothing left to clean then
                self.store_dead = True
                return


class Signals(SignedStore):
    """One rank's signed signals in one refit group: the abort signal and the all-gather
    (``exchange``); :class:`ControlPlane` adds the vote and the decision."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, rank_map: RankMap, key: bytes,
                 nonce: str, timeout_s: float) -> None:
        super().__init__(store, rank, world_size, key, nonce)
        self.rank_map, self.timeout_s = rank_map, timeout_s
        self._seq = 0  # exchanges within the group (every rank calls them in step)
        self._posted_abort = False
        self._reposted: list[tuple[str, str]] = []  # this rank's abort and hint: (slot, value) to keep there
        self._abort: str | None = None
        self._abort_seen: float | None = None
        self._rescan_at = 0.0  # the abort hint is present: when to look at the aborts again
        self._scan_at = 0.0  # with no hint: when to look for an abort all the same (``_SCAN_S``)
        #: Called by every poll: peers known dead (rank -> reason); set by the data plane.
        self.dead_peers: Callable[[], dict[int, str]] = dict

    # -- refits ------------------------------------------------------------------------------
    def begin(self, epoch: int) -> None:
        """A new refit: delete this rank's keys of the refit before the last one (a slow rank
        may still read the last one's; none reads older ones) and reset the signals. Rank 0
        also deletes that refit's decision and abort hint, so the store holds a constant
        number of keys however many refits run."""
        shared = ([self._slot("decision", self.epoch, 0, -1), self._slot("hint", self.epoch, 0, -1)]
                  if self.rank == 0 and self.epoch else [])
        self._next_epoch(epoch, shared)
        self._posted_abort, self._abort, self._abort_seen, self._rescan_at = False, None, None, 0.0
        self._scan_at, self._reposted = 0.0, []

    def post_abort(self, message: str) -> None:
        """Tell every rank to stop: this rank's own abort key, then the hint pollers watch. Both
        are written again while this rank waits for the decision (``_repost_abort``), should an
        outside writer delete them; the slow scan (``_SCAN_S``) finds the abort without the hint."""
        self._posted_abort = True
        self._reposted = [(self._slot("abort", self.epoch, 0, self.rank), self._sign("abort", 0, message)),
                          (self._slot("hint", self.epoch, 0, -1), self._sign("hint", 0, self.rank))]
        try:
            self._put(*self._reposted[0])
            self._store("set", *self._reposted[1])
        except StoreGone:
            pass  # nobody can read it; every rank learns from the store's death instead

    def _repost_abort(self) -> None:
        for slot, value in self._reposted:
            self._repost(slot, value)

    def stop_everyone(self, message: str) -> None:
        """Abort this refit for a failure outside this rank's own refit loop (another thread of
        this rank saw it, e.g. the engine's calls failed): every rank stops at this signal, this
        one too (``abort_message`` answers ``message`` here from now on)."""
        self.post_abort(message)
        self._posted_abort, self._abort = False, message

    def abort_message(self) -> str | None:
        """Why this refit is being aborted by someone else (another rank's abort, a peer known
        dead, the store gone), or None. Raises nothing: a dead store is a message too.

        One store call per poll while nothing happens: the hint's presence. Present, the
        aborts are read (every ``_RESCAN_S`` while none is authentic: an outside writer's
        hint costs a little polling, never a stall). Absent, every ``_SCAN_S`` all the same:
        the coordinator reads every rank's abort, any other rank the coordinator's abort and
        the decision -- a few reads a second per rank, every rank's abort on one rank only."""
        if self._abort is not None:
            return self._abort
        dead = self.dead_peers()
        if dead:
            g, why = min(dead.items())
            msg = f"{self.rank_map.name_at(g)} died ({why})"
            if self.rank == 0 and not self._posted_abort:
                self.post_abort(msg)
                self._posted_abort = False  # posted on the dead rank's behalf: this rank stops too
            self._abort = msg
            return msg
        if self._posted_abort:
            return None
        try:
            now = time.monotonic()
            if now >= self._rescan_at:
                hint_slot = self._slot("hint", self.epoch, 0, -1)
                raw = self._read(hint_slot)
                if raw is not None:
                    self._open(hint_slot, raw, "hint", 0, None)  # counted when it is not a rank's own
                    self._rescan_at = now + _RESCAN_S
                    return self._scan(range(self.world_size))
            if now >= self._scan_at:
                self._scan_at = now + _SCAN_S
                return self._scan(range(self.world_size) if self.rank == COORDINATOR else (COORDINATOR,))
        except StoreGone as exc:
            self._abort = str(exc)
            return self._abort
        return None

    def _scan(self, ranks: Any) -> str | None:
        """The first authentic abort of ``ranks`` (this rank's own aside), else a decided
        abort, else None; kept as this rank's reason to stop."""
        for r in ranks:
            ok, value = self._read_msg("abort", 0, r) if r != self.rank else (False, None)
            if ok:
                self._abort = str(value)
                return self._abort
        decided = self._read_decision(self._slot("decision", self.epoch, 0, -1))
        if decided is not None and not decided["commit"]:  # decided abort: stop, whoever posted
            self._abort = "; ".join(decided["errors"]) or "the refit was decided: abort"
        return self._abort

    def raise_if_aborted(self) -> None:
        msg = self.abort_message()
        if msg is not None:
            if self.store_dead:
                raise StoreGone(msg)
            raise RefitAborted(f"aborted by another rank: {msg}")

    # -- all-gather --------------------------------------------------------------------------
    def exchange(self, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """All-gather a small JSON-able value among all ranks (no tensors, no backend).
        Raises ``RefitTimeout`` naming the ranks that never contributed (and what their slots
        held), ``RefitAborted`` at another rank's abort."""
        timeout_s = timeout_s or self.timeout_s
        seq = self._seq
        self._seq += 1
        slots = [self._slot("ctl", self.epoch, seq, r) for r in range(self.world_size)]
        mine = self._sign("ctl", seq, obj)
        self._store("set", slots[self.rank], mine)
        values: dict[int, Any] = {}
        rejected_before = self.rejected["ctl"]
        start = time.monotonic()
        deadline, repost_at = start + timeout_s, start + _REPOST_EVERY_S
        while True:
            for r in range(self.world_size):
                ok, value = self._read_msg("ctl", seq, r) if r not in values else (False, None)
                if ok:
                    values[r] = value
            if len(values) == self.world_size:
                self._repost(slots[self.rank], mine)  # still there for the ranks yet to read it
                break
            now = time.monotonic()
            if now > deadline:
                who = ", ".join(self.rank_map.name_at(r) for r in range(self.world_size) if r not in values)
                found = self._found("ctl", rejected_before)
                raise RefitTimeout(f"control exchange #{seq}: no answer from {who} within {timeout_s}s{found}")
            if now > repost_at:
                self._repost(slots[self.rank], mine)
                repost_at = now + _REPOST_EVERY_S
            self.raise_if_aborted()
            time.sleep(_poll_pause(start))
        # Every rank posts exchange n only after reading all of n-1: this rank's previous key
        # is dead now. The last one goes at the next refit (``begin``) or on leaving.
        if self._last_ctl is not None:
            self._delete([self._last_ctl])
        self._last_ctl = slots[self.rank]
        return [values[r] for r in range(self.world_size)]

    def _found(self, kind: str, rejected_before: int) -> str:
        """What a wait on ``kind`` values found besides silence (for its error line)."""
        n = self.rejected[kind] - rejected_before
        return f" (rejected {n} {kind} value(s) that do not verify: {self.last_rejected[kind]})" if n else ""

    def _read_decision(self, slot: str) -> dict | None:
        raw = self._read(slot)
        return None if raw is None else self._open_decision(slot, raw)

    def _open_decision(self, slot: str, raw: bytes) -> dict | None:
        ok, value, _ = self._open(slot, raw, "decision", 0, None)
        return value if ok else None


class ControlPlane(Signals):
    """One rank's signed messages in one refit group (see the module docstring): the abort
    signal and the all-gather (:class:`Signals`), the vote and the refit's one decision."""

    def decide(self, ok: bool, payload: Any, error: str = "", timeout_s: float | None = None,
               after_vote: Callable[[], None] | None = None) -> Decision:
        """Vote, then learn the refit's one decision (see the module docstring).

        Never raises, and returns by the vote's deadline plus ``_DECISION_GRACE_S``: a store
        that dies, a decision that cannot be read or only as values that do not verify, give
        ``Decision(commit=False, known=False)`` with a line saying what was found."""
        timeout_s = timeout_s or self.timeout_s
        votes: dict[int, Any] = {}
        try:
            vote_slot = self._slot("vote", self.epoch, 0, self.rank)
            mine = {"ok": ok, "payload": payload, "error": error}
            vote = self._sign("vote", 0, mine)
            self._put(vote_slot, vote)
            votes[self.rank] = mine
            if after_vote is not None:
                after_vote()  # fault injection: stop or die with the vote written, the decision unread
            decided = self._await_decision(votes, vote_slot, vote, timeout_s)
            if isinstance(decided, str):
                return Decision(False, (f"{self.rank_map.name_at(self.rank)}: {decided}",), False,
                                tuple(votes.get(r, {}).get("payload") for r in range(self.world_size)))
            # Posted before acting on it: a rank that finds the shared key overwritten reads this.
            self._put(self._slot("decided", self.epoch, 0, self.rank), self._sign("decided", 0, decided))
            errors = list(decided["errors"])
            if decided["commit"]:
                self._read_votes(votes)  # every vote is there: the committer read them all
            else:
                errors += self._other_refusals(votes, errors)
            return Decision(bool(decided["commit"]), tuple(errors), True,
                            tuple(votes.get(r, {}).get("payload") for r in range(self.world_size)))
        except StoreGone as exc:
            errors = [f"{self.rank_map.name_at(self.rank)}: could not learn the refit's decision: {exc}"]
            return Decision(False, tuple(errors), False,
                            tuple(votes.get(r, {}).get("payload") for r in range(self.world_size)))

    def _await_decision(self, votes: dict[int, Any], vote_slot: str, vote: str, timeout_s: float) -> dict | str:
        """The decision (a dict), or why this rank cannot learn it (a line) by the deadline."""
        decision_slot = self._slot("decision", self.epoch, 0, -1)
        rejected_before = self.rejected["decision"] + self.rejected["decided"]
        start = time.monotonic()
        deadline, repost_at = start + timeout_s, start + _REPOST_EVERY_S
        hard = deadline + _DECISION_GRACE_S
        spoiled_at: float | None = None  # when the shared key was first found holding a bad value
        # The coordinator reads every vote at every poll (it decides on them); any other rank
        # only needs a "no" among them (or a copy of the decision, should its key be deleted
        # after some rank read it), read every ``_SCAN_S``: a refit's store load grows with
        # the world size, not with its square.
        coordinator, scan_at = self.rank == COORDINATOR, start
        while True:
            raw = self._read(decision_slot)
            if raw is not None:
                decided = self._open_decision(decision_slot, raw)
                if decided is not None:
                    return decided
                spoiled_at = spoiled_at or time.monotonic()
                decided = self._read_copies()
                if decided is not None:
                    return decided
            else:
                if coordinator or time.monotonic() >= scan_at:
                    self._read_votes(votes)
                    if not coordinator:
                        scan_at = time.monotonic() + _SCAN_S
                        decided = self._read_copies()
                        if decided is not None:
                            return decided
                proposal = self._proposal(votes, deadline, timeout_s)
                if proposal is not None:
                    decided = self._read_copies()  # the shared key was deleted after some rank read it
                    if decided is not None:
                        return decided
                    if not proposal["commit"] and not self._posted_abort:
                        # ranks still inside their transfer watch the abort hint, not the decision
                        self.post_abort("; ".join(proposal["errors"])[:500])
                    raw = self._store("compare_set", decision_slot, "", self._sign("decision", 0, proposal))
                    decided = self._open_decision(decision_slot, raw)
                    if decided is not None:
                        return decided
                    spoiled_at = spoiled_at or time.monotonic()
            now = time.monotonic()
            if now > hard or (spoiled_at is not None and now - spoiled_at > _ECHO_WAIT_S):
                n = self.rejected["decision"] + self.rejected["decided"] - rejected_before
                if n:
                    what = self.last_rejected.get("decision") or self.last_rejected.get("decided")
                    return (f"could not learn the refit's decision: its key holds a value that does not verify "
                            f"({n} rejected; {what}) and no rank's signed copy of it arrived within "
                            f"{now - (spoiled_at or start):.1f}s")
                return (f"could not learn the refit's decision within {now - start:.1f}s: it was never written "
                        f"where this rank could read it (deleted, or no rank could write it)")
            if now > repost_at:
                self._repost(vote_slot, vote)
                self._repost_abort()
                repost_at = now + _REPOST_EVERY_S
            time.sleep(_poll_pause(start))

    def _read_copies(self) -> dict | None:
        """The first authentic signed copy of the decision that any rank posted, or None."""
        for r in range(self.world_size):
            ok, value = self._read_msg("decided", 0, r)
            if ok:
                return value
        return None

    def _other_refusals(self, votes: dict[int, Any], named: list[str]) -> list[str]:
        """After an abort with refusals: every other rank's refusal too, where its "no" arrives
        within ``_REFUSALS_WAIT_S`` (every refusing rank is named, not only the first). Not
        waited for when no rank refused (a death or a timeout decided it)."""
        end = time.monotonic() + _REFUSALS_WAIT_S
        while True:
            self._read_votes(votes)
            refused = any(not v["ok"] for v in votes.values())
            waiting = len(votes) + len([r for r in self.dead_peers() if r not in votes]) < self.world_size
            if not refused or not waiting or time.monotonic() > end:
                break
            time.sleep(_POLL_S * 4)
        return [v["error"] for _, v in sorted(votes.items())
                if not v["ok"] and v["error"] and not any(v["error"] in e for e in named)]

    def _read_votes(self, votes: dict[int, Any]) -> None:
        for r in range(self.world_size):
            ok, value = self._read_msg("vote", 0, r) if r not in votes else (False, None)
            if ok:
                votes[r] = value

    def _proposal(self, votes: dict[int, Any], deadline: float, timeout_s: float) -> dict | None:
        """What this rank may decide now, or None while it must keep waiting: the module
        docstring's rule. Any "no" (this rank's own included) is an abort anyone may write;
        all "ok" is a commit only the coordinator writes; an abort signal, a peer known dead or
        the deadline make the coordinator abort, while any other rank (it voted "ok") asks
        the coordinator to, once, and keeps waiting for the decision."""
        errors = [v["error"] or f"{self.rank_map.name_at(r)}: voted no"
                  for r, v in sorted(votes.items()) if not v["ok"]]
        if errors:
            return {"commit": False, "errors": errors}
        coordinator = self.rank == COORDINATOR
        if len(votes) == self.world_size:
            return {"commit": True, "errors": []} if coordinator else None
        why = self.abort_message()
        if self.store_dead:
            raise StoreGone(why or "the refit store is unreachable")
        if why is not None:
            if not coordinator:
                return None  # the coordinator reads the same signal and decides
            # The rank that posted the abort votes "no" with its full error a moment later:
            # wait briefly for it, so the decision names the failure as that rank saw it.
            if self._abort_seen is None:
                self._abort_seen = time.monotonic()
            if time.monotonic() - self._abort_seen < _VOTE_AFTER_ABORT_S:
                return None
            return {"commit": False, "errors": [why]}
        if time.monotonic() > deadline:
            silent = [f"{self.rank_map.name_at(r)}: no vote within {timeout_s}s (dead or silent)"
                      for r in range(self.world_size) if r not in votes]
            if coordinator:
                return {"commit": False, "errors": silent}
            if not self._posted_abort:
                self.post_abort("; ".join(silent)[:500])  # asks the coordinator to abort
        return None
