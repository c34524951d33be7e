"""One refit on its destinations: the engine side of every refit, whichever entry point runs it.

A driver (``refit.driver``), an HTTP controller (``refit.servers``) and vLLM's trainer-side API
(``adapters.vllm.backend``) all run this one sequence on their ``Destination`` objects; they
differ only in who the trainers are and how long to wait for them. Each step is one round over
every destination at once, each call with a deadline (``EngineCallers``)::

    blocking:    pause -> [join] -> begin -> transfer ........ the trainers send meanwhile
                 ... the trainers are done (the caller waited) -> conclude
    overlapped:  [join] -> begin -> transfer (returns at once) .. the engines keep serving
                 ... the trainers are done -> pause (freeze for the swap) -> conclude
    then:        status -> resume (the new weights, or the old ones whole) or stay gated

A refit that some destination cannot pause, join or begin never starts: the sessions that
opened are closed, the destinations paused for it resume (one gated before stays gated), and
``RefitNotStarted`` names why. After the conclusion each destination is confirmed by what its
workers hold (``status``; one that cannot be asked is confirmed by the refit's own outcome)
and resumes only when all of its workers hold this refit -- or, after a failure, all still
hold one same earlier refit and it was not gated before; otherwise it stays **gated** (paused)
until a refit commits on all of its workers. What makes an engine unsafe (an ``unsure`` or
torn worker, workers holding different refits) lives in its workers, so the next caller
reaches the same verdict.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import EngineDead, RefitFailed
from ..wire.protocol import WorkerStatus, first_error_line
from .destination import EngineCallers, EngineCalls

__all__ = ["EngineRun", "EngineRefit", "RefitNotStarted", "BEGIN_DEADLINE_S"]

#: Seconds a destination may take to pause, open its session, swap, resume.
BEGIN_DEADLINE_S = 60.0


class RefitNotStarted(RefitFailed):
    """A destination could not pause, join or begin: no weights changed anywhere, every
    destination paused for the refit serves again."""


@dataclass(frozen=True)
class EngineRun:
    """One refit as its destinations run it.

    ``update``: what every destination's ``transfer`` takes (``EngineUpdateInfo``, or its wire
    form); ``version``: the label of the refit's weights; ``refit``: its identity (what a
    worker that committed it holds: ``WorkerStatus.refit``); ``grace_s``: how long a
    destination's transfer may still take once the trainers are done (it read the decision by
    then, or is stuck); ``recompute``: preempt running requests when dropping the old weights'
    cached KV; ``encoders``: the refit changed a multimodal encoder's weights (drop its cached
    outputs too); ``kind``: what the destinations are called in messages ("engines", "servers")."""

    update: Any
    version: str
    refit: str = ""
    overlap: bool = False
    grace_s: float = 10.0
    recompute: bool = False
    encoders: bool = False
    kind: str = "engines"


@dataclass
class EngineRefit:
    """``run`` on the destinations of ``calls``: ``start`` (pause, join, begin, transfer), then --
    once the caller has waited for the trainers -- ``finish`` (conclude, confirm, resume or
    gate). ``gated``: the destinations a caller keeps paused across refits (index -> why),
    updated. ``abort``: tells the trainers to stop at once when a destination's transfer fails
    before it could vote (a caller whose trainers are its peers, e.g. vLLM's trainer API)."""

    calls: EngineCallers
    run: EngineRun
    gated: dict[int, str] = field(default_factory=dict)
    abort: Callable[[str], None] | None = None
    notes: list[str] = field(default_factory=list)
    _transfers: EngineCalls | None = None
    _open: list[int] = field(default_factory=list)  # destinations whose session opened
    #: A blocking transfer's end, per destination: "returned", or "late" -- ``finish`` moved on
    #: without it (unresponsive), so its thread concludes the session itself once it returns
    #: (the next refit's ``begin`` would find it still open).
    _ends: dict[int, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, joins: Sequence[Any] | None = None) -> list[str]:
        """Pause (a blocking refit), join (``joins``: one init info per destination, for a new
        refit group), open every session, start every transfer. Raises ``RefitNotStarted`` when
        a destination could not pause, join or begin. Returns the errors of an overlapped
        refit's transfers (they return at once; a blocking refit's come at ``finish``)."""
        run, calls = self.run, self.calls
        paused: list[int] = []
        if not run.overlap:
            paused, failed = self._round(lambda d, _: d.pause(False), "pause")
            if failed:
                self._unwind(paused, failed)
        if joins is not None:
            _, failed = self._round(lambda d, init: d.join(init), "init_weight_transfer_engine", list(joins),
                                    deadline_s=run.grace_s + BEGIN_DEADLINE_S)
            if failed:
                self._unwind(paused, failed)
        self._open, failed = self._round(lambda d, _: d.begin(), "start_weight_update")
        if failed:
            self._unwind(paused, failed)
        if run.overlap:
            return calls.on(lambda d, _: self._transfer(d), what="update_weights (overlapped)",
                            deadline_s=BEGIN_DEADLINE_S)
        self._transfers = calls.start(self._blocking_transfer, list(range(len(calls.engines))), what="update_weights")
        return []

    def _round(self, fn: Callable[[Any, Any], Any], what: str, args: list[Any] | None = None,
               deadline_s: float = BEGIN_DEADLINE_S) -> tuple[list[int], list[str]]:
        """``fn`` on every destination at once: (the ones it succeeded on, the error lines)."""
        calls = self.calls.start(fn, args, what=what)
        errors = self.calls.wait(calls, deadline_s)
        return [e for e, r in calls.results.items() if r is None], errors

    def _unwind(self, paused: list[int], failed: list[str]) -> None:
        """Nothing was received anywhere: close every session that opened, resume every
        destination paused for this refit (one gated before stays gated); raise."""
        opened, self._open = self._open, []
        for e in opened:
            self.calls.on(lambda d, _: d.conclude(None), only=e, what="finish_weight_update", deadline_s=BEGIN_DEADLINE_S)
        self._each([e for e in paused if e not in self.gated], lambda d, _: d.resume(), "resume")
        raise RefitNotStarted(f"{'; '.join(failed)} (refit not started: no weights changed, {self.run.kind} resumed)")

    def _blocking_transfer(self, d: Any, e: int) -> None:
        try:
            self._transfer(d)
        finally:
            with self._lock:
                late = self._ends.get(e) == "late"
                self._ends[e] = "returned"
            if late:  # the refit concluded without it: close its session as it voted
                d.conclude(None)

    def _transfer(self, d: Any) -> None:
        try:
            d.transfer(self.run.update)
        except BaseException as exc:
            if self.abort is not None:  # the trainers wait for this engine's vote: stop them now
                self.abort(f"the engine's call failed: {first_error_line(exc)}")
            raise

    def finish(self, trusted: bool, serve: bool = True) -> list[str]:
        """After the trainers' side is done (``trusted``: it committed, every trainer said so):
        wait for the transfers (blocking: within the grace), conclude every open session --
        commit or roll back as voted; one whose transfer failed is closed all the same, so the
        next refit can begin; an overlapped refit pauses first, for the swap -- then confirm
        each destination and resume it or keep it gated (``serve`` False: a whole one stays
        paused too, for the caller to look first). Returns one line per destination that
        failed, is gated or dead."""
        run, calls = self.run, self.calls
        errors: list[str] = []
        failed: set[int] = set()
        if self._transfers is not None:
            errors += calls.wait(self._transfers, run.grace_s)
            failed = {e for e, r in self._transfers.results.items() if r is not None}
            with self._lock:
                for e, t in self._transfers.threads.items():
                    if self._ends.get(e) != "returned":
                        self._ends[e] = "late"
        elif run.overlap:
            errors += calls.on(lambda d, _: d.pause(True), what="pause (swap)", deadline_s=BEGIN_DEADLINE_S)
        version = [None if e in failed else run.version for e in range(len(calls.engines))]
        live = [e for e in self._open if e not in calls.dead and not isinstance(
            self._transfers.results.get(e) if self._transfers is not None else None, EngineDead)]
        for e in live:  # one at a time is fine: every engine already voted
            got = calls.on(lambda d, v: d.conclude(v), version, only=e, what="finish_weight_update",
                           deadline_s=run.grace_s + 30.0)
            errors += [] if e in failed else got  # a closed failed session's own refusal adds nothing
        return errors + self.settle(trusted and not errors, serve)

    def settle(self, trusted: bool, serve: bool = True) -> list[str]:
        """Confirm each destination's workers, then -- one round each over the whole ones --
        drop the old weights' cached KV and label the new weights (``refresh``), and resume;
        keep the others gated. A gated one resumes only on "new": this refit committed on all
        of its workers."""
        out: list[str] = []
        calls = self.calls
        whole: dict[int, str] = {}
        for e, dest in enumerate(calls.engines):
            if e in calls.dead:
                continue
            verdict = self._confirm(e, dest, trusted)
            if e in calls.dead:  # it died or stopped answering meanwhile: nothing to resume
                out.append(calls.line(e))
                continue
            if verdict == "old" and e in self.gated:
                verdict = self.gated[e]  # gated earlier: only "new" resumes it
            if verdict in ("new", "old"):
                self.gated.pop(e, None)
                whole[e] = verdict
            else:
                self.gated[e] = verdict
                out.append(f"engine {e} is gated (paused, serving nothing) until a refit succeeds: {verdict}")
        if not serve:
            return out
        notes: dict[int, str] = {}
        new = [e for e, v in whole.items() if v == "new"]
        out += self._each(new, lambda d, e: notes.__setitem__(e, d.refresh(self.run.version, self.run.recompute,
                                                                                self.run.encoders)),
                          "refresh")
        out += self._each(list(whole), lambda d, _: d.resume(), "resume")
        for e, n in sorted(notes.items()):
            label = getattr(calls.engines[e], "label", "")
            if n:
                self.notes.append(n if label and n.startswith(label) else f"engine {e}: {n}")
        return out

    def _each(self, idx: list[int], fn: Callable[[Any, int], Any], what: str) -> list[str]:
        """``fn(dest, e)`` on destinations ``idx`` at once: one round."""
        if not idx:
            return []
        return self.calls.on(fn, list(range(len(self.calls.engines))), what=what, deadline_s=BEGIN_DEADLINE_S, only=idx)

    def _confirm(self, e: int, dest: Any, trusted: bool) -> str:
        """"new" when every worker holds this refit whole, "old" when (the refit failed and)
        every worker holds one same earlier refit whole, else why not (one line)."""
        got: list[list[WorkerStatus] | None] = []
        errs = self.calls.on(lambda d, _: got.append(d.status()), only=e, what="confirm", deadline_s=30.0)
        states = got[0] if got else None
        if errs or states is None:
            if e in self.calls.dead:
                return self.calls.dead[e]
            # It cannot be asked (or did not answer): the refit's own success is the only evidence.
            return "new" if trusted else "its workers cannot be asked which weights they hold"
        bad = [f"worker {w}: {st.state} ({st.reason[:200]})" for w, st in enumerate(states) if st.state != "serving"]
        if bad:
            return "; ".join(bad)
        held = {st.refit for st in states}
        if len(held) != 1:
            return "its workers hold the weights of different refits: " + ", ".join(
                f"worker {w}: {st.version or 'as loaded'} (refit {st.refit or 'none'})" for w, st in enumerate(states))
        holds = held.pop()
        if holds == self.run.refit:
            return "new"
        return "old" if not trusted else f"its workers hold refit {holds or 'none (as loaded)'}, not {self.run.refit}"
