"""A refit's destination: one inference engine, as the refit's orchestration talks to it.

DCP writes a checkpoint through a ``StorageWriter`` and vLLM's trainer API reaches an engine
through a ``VLLMWeightSyncClient``; a refit reaches an engine through a :class:`Destination`.
Its calls follow the refit, in order::

    describe  -> what each worker holds (its pieces), what the engine is (DestinationInfo)
    join      -> the refit group, once per group (its plan slices by digest)
    pause     -> pause the engine's scheduling (a blocking refit; an overlapped one's swap)
    begin     -> open a weight-update session
    transfer  -> receive this refit's boxes and vote (returns once voted; overlapped: at once)
    conclude  -> commit or roll back, as the vote decided
    status    -> what each worker holds now (None: it cannot be asked)
    refresh   -> after a refit that committed: drop the old weights' cached KV, label the new ones
    resume    -> serve again; not called: the destination stays gated
    close     -> leave the refit group

The orchestration (``transport.sequence``) is the same for every kind of engine and every entry
point (a driver, an HTTP controller, vLLM's trainer-side API); an engine kind is one adapter
package that implements this protocol (``adapters/vllm``: an engine in this process, a server
over HTTP, an engine behind vLLM's weight-sync client; a Ray actor holding one). No code above
the adapters names an engine's own methods.

Every call has a deadline (``EngineCallers``): an engine that misses one is refused until the
call it left running returns, since an engine answers one call at a time and a later call
would take the stuck one's reply.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..errors import EngineDead
from ..layout import LocalParam, ModelSpec
from ..wire.protocol import WorkerStatus, first_error_line

__all__ = ["Destination", "DestinationInfo", "Described", "EngineCalls", "EngineCallers", "stuck", "mark_stuck"]

_log = logging.getLogger("mcore_reshard.refit.driver")


@dataclass(frozen=True)
class DestinationInfo:
    """What a destination is, known before a refit is planned."""

    #: Its workers: destination ranks of the refit group (tp * pp * dp for vLLM).
    world_size: int
    #: The element type it serves ("bfloat16").
    dtype: str
    #: Its parallel sizes, in its adapter's own type (the rules' layout of an engine that
    #: cannot be asked; LoRA slots).
    parallel: Any = None
    #: Its workers answer ``describe`` from what they record and ``status`` (else the rules
    #: describe it and only the refit's own outcome confirms it).
    reports: bool = False
    #: ``begin(pause=True)`` pauses a scheduler every client path meets; ``resume`` restarts it.
    can_pause: bool = False
    #: It runs a speculative-decoding draft that moves with the target.
    draft: bool = False
    #: For messages ("engine 0", a URL).
    name: str = ""


@dataclass(frozen=True)
class Described:
    """What a destination's workers hold: each worker's pieces (rank 0 of the engine first),
    and the parameters not written in place (``{local name: why}``: the plan report's
    ``not_direct``; None: it cannot be asked)."""

    params: tuple[tuple[LocalParam, ...], ...]
    not_direct: tuple[tuple[str, str], ...] | None = None


class Destination(Protocol):
    """One inference engine of a refit (see the module docstring)."""

    def info(self) -> DestinationInfo: ...

    def describe(self, spec: ModelSpec) -> Described:
        """The pieces each worker holds for a refit of ``spec`` (in the engine's dtype); an
        engine that drafts learns its draft first and describes it beside the target."""

    def join(self, init: Any) -> None:
        """Join a refit group (``wire.protocol.EngineInitInfo``)."""

    def pause(self, swap: bool) -> None:
        """Pause scheduling, where the engine can (``DestinationInfo.can_pause``): new requests
        wait, every client path meets it. ``swap``: an overlapped refit's swap (running
        requests freeze where they are); else a blocking refit's pause, in the engine's own
        mode (an in-process engine keeps running requests frozen, a server lets them finish)."""

    def begin(self) -> None:
        """Open a weight-update session."""

    def transfer(self, update: Any) -> None:
        """Receive and vote (``wire.protocol.EngineUpdateInfo``, or its wire form): returns once
        this engine voted; an overlapped refit's returns at once (its workers receive on their
        own threads)."""

    def conclude(self, version: str | None) -> None:
        """Commit or roll back as the vote decided, and close the session; raises when the
        refit did not commit here. ``version`` labels the new weights where the engine cannot
        be asked (its finish sets it; None: no label, e.g. closing a failed session); one that
        can be asked is labelled at ``resume``, once confirmed."""

    def status(self) -> list[WorkerStatus] | None:
        """Every worker's state and the refit it holds (None: it cannot be asked)."""

    def refresh(self, version: str, recompute: bool = False, encoders: bool = False) -> str:
        """After a refit that committed here: drop the KV cached under the old weights
        (``recompute``: preempting running requests) -- and, ``encoders``, the outputs of a
        multimodal encoder whose weights changed -- and label the new weights ``version``.
        Returns a note ("" when none), e.g. a cache the engine would not drop."""

    def resume(self) -> None:
        """Serve again (not called: the destination stays gated)."""

    def close(self) -> None:
        """Leave the refit group."""


# ------------------------------------------------------------------------- deadlines


def stuck(target: Any) -> str | None:
    """Why no call may be sent to ``target`` now: an earlier call that missed its deadline has
    not returned (an engine answers one call at a time: a new call would take its reply)."""
    left = getattr(target, "__dict__", {}).get("_mr_unanswered")
    if left is None:
        return None
    thread, what, since = left
    if not thread.is_alive():
        target.__dict__.pop("_mr_unanswered", None)
        return None
    return f"it has not answered {what} for {time.monotonic() - since:.0f}s (a worker stopped, hung or dead)"


def mark_stuck(target: Any, thread: threading.Thread, what: str, since: float) -> None:
    """Record that ``thread``'s call ``what`` on ``target`` missed its deadline and was left running."""
    target.__dict__["_mr_unanswered"] = (thread, what, since)


def _owner(dest: Any) -> Any:
    """Where a destination's stuck call is recorded: the engine object it wraps, so every user
    of that engine (a driver, a helper's ``generate``) sees it."""
    return getattr(dest, "engine", dest)


@dataclass
class EngineCalls:
    """One call started on some destinations (``EngineCallers.start``)."""

    what: str
    threads: dict[int, threading.Thread]
    results: dict[int, BaseException | None]
    asked: list[int]
    started: float = 0.0  # time.monotonic() when the calls began


@dataclass
class EngineCallers:
    """Calls on a refit's destinations, each on its own daemon thread with a deadline, and which
    are refused (``dead``): one whose engine died (``EngineDead``), until it is replaced; one
    that missed a deadline (unresponsive), until the call it left running returns -- and then
    a probe answers (``readmit``)."""

    engines: list[Any]
    dead: dict[int, str] = field(default_factory=dict)
    _waiting: set[int] = field(default_factory=set)  # unresponsive, not dead: readmitted once it answers
    _left: dict[int, EngineCalls] = field(default_factory=dict)  # the call each unresponsive one left running

    def on(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *, what: str = "call",
           deadline_s: float = 300.0, only: int | Sequence[int] | None = None) -> list[str]:
        """Run ``fn(dest, arg)`` on every destination (or those ``only`` names) at once; one error
        line per failure. One that misses ``deadline_s`` is unresponsive from then on."""
        return self.wait(self.start(fn, args, what=what, only=only), deadline_s)

    def start(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *,
              what: str = "call", only: int | Sequence[int] | None = None) -> EngineCalls:
        """Start ``fn(dest, arg)`` on the destinations not refused (daemon threads); ``wait`` collects them."""
        idx = list(range(len(self.engines))) if only is None else [only] if isinstance(only, int) else list(only)
        args = list(args) if args is not None else [None] * len(self.engines)
        results: dict[int, BaseException | None] = {}
        for e in idx:
            busy = None if e in self.dead else stuck(_owner(self.engines[e]))
            if busy is not None:  # an earlier call (a helper's) still waits: a new one would queue behind it
                self.dead[e] = f"unresponsive: {busy}"
                self._waiting.add(e)

        def run(e: int) -> None:
            try:
                fn(self.engines[e], args[e])
                results[e] = None
            except BaseException as exc:  # noqa: BLE001 - collected, raised once by the caller
                results[e] = exc

        threads = {e: threading.Thread(target=run, args=(e,), daemon=True, name=f"engine-{e}-{what}") for e in idx
                   if e not in self.dead}
        for t in threads.values():
            t.start()
        return EngineCalls(what, threads, results, idx, time.monotonic())

    def wait(self, calls: EngineCalls, deadline_s: float) -> list[str]:
        """One error line per destination that failed or missed ``deadline_s`` (then unresponsive)."""
        idx, threads, results, what = calls.asked, calls.threads, calls.results, calls.what
        deadline = time.monotonic() + deadline_s
        errors = [self.line(e) for e in idx if e in self.dead and e not in threads]
        for e, t in threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.dead[e] = f"no answer to {what} within {deadline_s:.0f}s (a dead, stopped or hung worker)"
                self._waiting.add(e)
                self._left[e] = calls
                mark_stuck(_owner(self.engines[e]), t, what, calls.started)  # nothing more is sent until it returns
                errors.append(self.line(e))
            elif results.get(e) is not None:
                exc = results[e]
                if isinstance(exc, EngineDead):
                    self._died(e, exc)
                    errors.append(self.line(e))
                else:
                    line, label = first_error_line(exc), getattr(self.engines[e], "label", "")
                    errors.append(line if label and line.startswith(label) else f"engine {e}: {line}")
        return errors

    def _died(self, e: int, exc: BaseException) -> None:
        self.dead[e] = f"its engine core or a worker died: {first_error_line(exc)}"
        self._waiting.discard(e)

    def line(self, e: int) -> str:
        """One line for a refused destination."""
        if e in self._waiting:
            return (f"engine {e} is unresponsive ({self.dead[e]}): refused until it answers again (then readmitted, "
                    f"gated until a refit commits), or replace it")
        return f"engine {e} is dead ({self.dead[e]}): replace it"

    def readmit(self, probe: Callable[[Any, int], None]) -> list[int]:
        """Take back every unresponsive destination whose left call has returned and that
        answers ``probe(dest, e)``; one whose left call ended with ``EngineDead`` is dead.
        Returns the destinations taken back."""
        back = []
        for e in sorted(self._waiting):
            dest = self.engines[e]
            if stuck(_owner(dest)) is not None:
                continue
            left = self._left.pop(e, None)
            exc = left.results.get(e) if left is not None else None
            if isinstance(exc, EngineDead):
                self._died(e, exc)
                continue
            try:
                probe(dest, e)
            except Exception:  # noqa: BLE001 - not back yet
                continue
            why = self.dead.pop(e)
            self._waiting.discard(e)
            _log.warning("engine %d answers again after %s: readmitted, gated until a refit commits", e, why)
            back.append(e)
        return back
