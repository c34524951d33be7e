"""The driver's side of a vLLM engine: what one is (size, dtype, destination layout) and how a
call to one ends (the grace after the trainers, closing a failed update session, vLLM's words
for a dead engine).

Apart from the driver so that it stays orchestration only. ``adapters.vllm.engine`` imports
vLLM at load: it is imported inside the functions, never here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Sequence

from .adapters.vllm.rules import vllm_layout
from .layout import LocalParam, ModelSpec, Piece, SideLayout

__all__ = ["engine_world", "engine_dtype", "dst_layout_of", "ENGINE_GRACE_S", "EngineCalls", "engine_is_dead",
           "finish_quietly", "finish_overlapped"]


def engine_world(llm: Any) -> int:
    """Workers of one engine (tp * pp * dp)."""
    from .adapters.vllm.engine import engine_info

    return engine_info(llm).world_size


def engine_dtype(llm: Any) -> str:
    """The element type an engine serves (``torch.bfloat16`` -> ``"bfloat16"``)."""
    from .adapters.vllm.engine import engine_info

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
    from .adapters.vllm.engine import describe, engine_info

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


#: Seconds an engine may take to answer ``update_weights`` after every trainer is done.
ENGINE_GRACE_S = 10.0


def finish_quietly(llm: Any) -> None:
    """Close the weight-update session after a failed update (one left open wedges the next
    refit); its own error adds nothing to the update's."""
    try:
        llm.finish_weight_update()
    except Exception:  # noqa: BLE001
        pass


def finish_overlapped(llm: Any) -> None:
    """``finish_weight_update`` of an overlapped refit (the swap). When it did not commit it
    raises on the engine's last worker, whose session vLLM then leaves open (it closes a
    session only when the engine's finish returns); the others closed theirs. To close that
    one without an error from any other worker (which would poison vLLM's next call):
    ``start_weight_update`` opens a session on every worker but the last (which refuses:
    the error comes from the last worker only), then ``finish_weight_update`` closes all."""
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
