"""The driver's side of a vLLM engine: what one is (size, dtype, destination layout) and how a
call to one ends (the grace after the trainers, closing a failed update session, vLLM's words
for a dead engine).

Apart from the driver so that it stays orchestration only. ``adapters.vllm.engine`` imports
vLLM at load: it is imported inside the functions, never here.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from typing import TYPE_CHECKING

from ..adapters.vllm.lora_rules import vllm_lora_layout
from ..adapters.vllm.rules import vllm_layout
from ..layout import LocalParam, ModelSpec, Piece, SideLayout
from ..layout.lora import PeftConfig, adapter_tensors, with_adapter
from ..wire.protocol import first_error_line

__all__ = ["engine_world", "engine_dtype", "dst_layout_of", "ENGINE_GRACE_S", "EngineCalls", "EngineCallers",
           "engine_is_dead", "finish_quietly", "finish_update", "adapter_slots_of"]

if TYPE_CHECKING:
    from ..adapters.vllm.engine import EngineInfo

_log = logging.getLogger("mcore_reshard.refit.driver")


def engine_world(llm: Any) -> int:
    """Workers of one engine (tp * pp * dp)."""
    from ..adapters.vllm.engine import engine_info

    return engine_info(llm).world_size


def engine_dtype(llm: Any) -> str:
    """The element type an engine serves (``torch.bfloat16`` -> ``"bfloat16"``)."""
    from ..adapters.vllm.engine import engine_info

    return engine_info(llm).dtype


def _restamp(params: Sequence[LocalParam], offset: int) -> list[LocalParam]:
    """The same pieces on destination rank ``offset + local rank`` (engine ``e`` of several)."""
    if not offset:
        return list(params)
    out = []
    for p in params:
        r = p.rank + offset
        out.append(replace(p, rank=r, pieces=tuple(Piece(r, q.local_name, q.canonical, q.box, q.view) for q in p.pieces)))
    return out


def dst_layout_of(engines: Sequence[Any], spec: ModelSpec, name: str = "vllm") -> SideLayout:
    """Every engine's destination pieces, ranks offset per engine: what its workers recorded
    (diagnostics extension), else the rules' layout for its parallel sizes (a plain engine,
    which refuses at init a slice that does not match what it holds). ``spec`` is in the
    engines' dtype."""
    from ..adapters.vllm.engine import describe, engine_info

    params: list[LocalParam] = []
    offset = 0
    for llm in engines:
        info = engine_info(llm)
        if info.diagnostics:
            per_worker = describe(llm)
        else:
            rules = vllm_layout(spec, replace(info.parallel, replicas=1))
            per_worker = [rules.for_rank(r) for r in range(rules.world_size)]
        for worker_params in per_worker:
            params.extend(_restamp(worker_params, offset))
        offset += len(per_worker)
    return SideLayout(name, offset, tuple(params), spec.tensor_table())


def adapter_slots_of(dst: SideLayout, infos: Sequence["EngineInfo"], spec: ModelSpec, peft: PeftConfig) -> SideLayout:
    """``dst`` plus every engine's refit adapter slots (``lora_rules``), ranks offset per
    engine: what each worker installs and checks against its live slots at init
    (``lora_slots``), before any of it is described by the worker."""
    params: list[LocalParam] = []
    offset = 0
    scale: tuple = ()
    for info in infos:
        slots = vllm_lora_layout(spec, replace(info.parallel, replicas=1), peft)
        params.extend(_restamp(slots.params, offset))
        scale = slots.scale
        offset += info.world_size
    return with_adapter(dst, params, adapter_tensors(spec, peft), scale)


#: Seconds an engine may take to answer ``update_weights`` after every trainer is done.
ENGINE_GRACE_S = 10.0


def finish_quietly(llm: Any) -> None:
    """Close the weight-update session after a failed update (one left open wedges the next
    refit); its own error adds nothing to the update's."""
    try:
        llm.finish_weight_update()
    except Exception:  # noqa: BLE001
        pass


def finish_update(llm: Any) -> None:
    """``finish_weight_update``: the commit (or roll back) of what ``update_weights`` received
    and voted on. When it did not commit it raises on the engine's last worker, whose session
    vLLM then leaves open (it closes a session only when the engine's finish returns); the
    others closed theirs. To close that one without an error from any other worker (which
    would poison vLLM's next call): ``start_weight_update`` opens a session on every worker
    but the last (which refuses: the error comes from the last worker only), then
    ``finish_weight_update`` closes all."""
    try:
        llm.finish_weight_update()
    except BaseException as exc:
        if not engine_is_dead(exc):
            try:
                llm.start_weight_update()
            except Exception:  # noqa: BLE001 - the last worker's "already active": expected
                pass
            finish_quietly(llm)
        raise


def engine_is_dead(exc: BaseException) -> bool:
    """vLLM's words for an engine that will never answer again (a worker or the core died)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(w in text for w in ("EngineDeadError", "Executor failed", "EngineCore encountered an issue",
                                   "engine core process died", "died during"))


@dataclass
class EngineCalls:
    """One call started on some engines (``RefitDriver.start_on_engines``)."""

    what: str
    threads: dict[int, threading.Thread]
    results: dict[int, BaseException | None]
    asked: list[int]
    started: float = 0.0  # time.monotonic() when the calls began


class EngineCallers:
    """Calls on a driver's engines, each on its own daemon thread with a deadline, and which
    engines are refused (``dead``): one whose core or a worker died, until it is replaced; one
    that missed a deadline (unresponsive), until the call it left running returns -- vLLM
    answers one call at a time, so anything sent meanwhile would queue behind that call and
    could take its reply -- and then a probe answers (``readmit``)."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.dead: dict[int, str] = {}
        self._waiting: set[int] = set()  # unresponsive, not dead: readmitted once it answers
        self._left: dict[int, EngineCalls] = {}  # the call each unresponsive engine left running

    def on(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *, what: str = "call",
           deadline_s: float = 300.0, only: int | None = None) -> list[str]:
        """Run ``fn(llm, arg)`` on every engine (or engine ``only``) at once; one error line per
        failure. An engine that misses ``deadline_s`` is unresponsive from then on."""
        return self.wait(self.start(fn, args, what=what, only=only), deadline_s)

    def start(self, fn: Callable[[Any, Any], Any], args: Sequence[Any] | None = None, *,
              what: str = "call", only: int | None = None) -> EngineCalls:
        """Start ``fn(llm, arg)`` on the engines not refused (daemon threads); ``wait`` collects them."""
        from ..adapters.vllm.engine import unanswered

        idx = [only] if only is not None else list(range(len(self.engines)))
        args = list(args) if args is not None else [None] * len(self.engines)
        results: dict[int, BaseException | None] = {}
        for e in idx:
            busy = None if e in self.dead else unanswered(self.engines[e])
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
        """One error line per engine that failed or missed ``deadline_s`` (then unresponsive)."""
        from ..adapters.vllm.engine import left_waiting

        idx, threads, results, what = calls.asked, calls.threads, calls.results, calls.what
        deadline = time.monotonic() + deadline_s
        errors = [self.line(e) for e in idx if e in self.dead and e not in threads]
        for e, t in threads.items():
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.dead[e] = f"no answer to {what} within {deadline_s:.0f}s (a dead, stopped or hung worker)"
                self._waiting.add(e)
                self._left[e] = calls
                left_waiting(self.engines[e], t, what, calls.started)  # nothing more is sent until it returns
                errors.append(self.line(e))
            elif results.get(e) is not None:
                exc = results[e]
                if engine_is_dead(exc):
                    self._died(e, exc)
                    errors.append(self.line(e))
                else:
                    errors.append(f"engine {e}: {first_error_line(exc)}")
        return errors

    def _died(self, e: int, exc: BaseException) -> None:
        self.dead[e] = f"its engine core or a worker died: {first_error_line(exc)}"
        self._waiting.discard(e)

    def line(self, e: int) -> str:
        """One line for a refused engine."""
        if e in self._waiting:
            return (f"engine {e} is unresponsive ({self.dead[e]}): refused until it answers again (then readmitted, "
                    f"gated until a refit commits), or replace it")
        return f"engine {e} is dead ({self.dead[e]}): replace it"

    def readmit(self, probe: Callable[[Any, int], None]) -> list[int]:
        """Take back every unresponsive engine whose left call has returned and that answers
        ``probe(llm, e)``; one whose left call ended with vLLM's dead-engine error is dead.
        Returns the engines taken back."""
        from ..adapters.vllm.engine import unanswered

        back = []
        for e in sorted(self._waiting):
            llm = self.engines[e]
            if unanswered(llm) is not None:
                continue
            left = self._left.pop(e, None)
            exc = left.results.get(e) if left is not None else None
            if exc is not None and engine_is_dead(exc):
                self._died(e, exc)
                continue
            try:
                probe(llm, e)
            except Exception:  # noqa: BLE001 - not back yet
                continue
            why = self.dead.pop(e)
            self._waiting.discard(e)
            _log.warning("engine %d answers again after %s: readmitted, gated until a refit commits", e, why)
            back.append(e)
        return back
