"""A vLLM engine in this process as a refit destination (``transport.destination.Destination``).

``VllmEngine`` wraps an ``LLM`` or an ``AsyncEngine`` (vLLM's ``AsyncLLM`` on its own loop):
vLLM's own weight-transfer API and the diagnostics extension's RPCs, each step of a refit one
call. (A Ray actor holding one is a destination of its own, ``jobs.grpo.ray_cluster.ActorDestination``,
whose steps the actor runs on this class.) This module (with
``http.py`` and ``backend/``) is where the refit's orchestration meets vLLM's method names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, TypeVar

from ...errors import EngineDead
from ...layout import ModelSpec
from ...layout.quant import FP8, scale_name
from ...transport.destination import Described, DestinationInfo
from ...wire.protocol import EngineInitInfo, EngineUpdateInfo, WorkerStatus, first_error_line
from .engine import STATUS_DEADLINE_S, describe, engine_call, engine_info, reset_encoder_cache, worker_status
from .fp8 import FP8_NOTE
from .rules import vllm_layout

__all__ = ["VllmEngine", "engine_is_dead"]

T = TypeVar("T")

#: The parameters a refit writes through vLLM's layerwise reload, not in place (plan report).
RELOAD_NOTE = "kernel format differs from model format: written through vLLM's layerwise reload"


def engine_is_dead(exc: BaseException) -> bool:
    """vLLM's words for an engine that will never answer again (a worker or the core died)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(w in text for w in ("EngineDeadError", "Executor failed", "EngineCore encountered an issue",
                                   "engine core process died", "died during"))


def _checked(fn: Callable[[], T]) -> T:
    """``fn()``; vLLM's dead-engine errors as ``EngineDead``."""
    try:
        return fn()
    except Exception as exc:
        if engine_is_dead(exc):
            raise EngineDead(first_error_line(exc)) from exc
        raise


class VllmEngine:
    """One vLLM engine as a refit destination (see the module docstring). ``engine`` is what
    it wraps: the object every helper (``engine.prompt_logprobs``, ...) takes, and where a
    call left running past its deadline is recorded for all of them."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __repr__(self) -> str:
        return f"VllmEngine({type(self.engine).__name__})"

    def info(self) -> DestinationInfo:
        i = engine_info(self.engine)
        return DestinationInfo(i.world_size, i.dtype, i.parallel, reports=i.diagnostics, can_pause=True,
                               draft=i.draft)

    def describe(self, spec: ModelSpec) -> Described:
        """Each worker's pieces: recorded by its own loaders (the diagnostics extension), else
        the rules' layout of its parallel sizes (an engine that checks its slice at init).
        ``spec`` is in the engine's dtype. An engine that drafts learns where its draft is
        first, through vLLM's own draft session (nothing sent: ``start_draft_weight_update``
        then ``finish_weight_update``). A LoRA policy's refit adapter slots are the rules'
        (``plan.refit_plans.plan_refit`` adds them; each worker installs and checks them at init)."""
        i = engine_info(self.engine)
        if i.draft:
            _checked(self.engine.start_draft_weight_update)
            _checked(self.engine.finish_weight_update)
        not_direct: tuple[tuple[str, str], ...] | None = None
        if i.diagnostics:
            per_worker = describe(self.engine)
            modes: dict[str, str] = {}
            for rank_modes in engine_call(self.engine, "mr_modes", lambda: self.engine.collective_rpc("mr_modes"),
                                          STATUS_DEADLINE_S):
                modes.update(rank_modes)
            codes = {p.name for w in per_worker for p in w if p.dtype == FP8}
            codes |= {scale_name(n) for n in codes}
            not_direct = tuple(sorted((n, FP8_NOTE if n in codes else RELOAD_NOTE)
                                      for n, m in modes.items() if m != "direct"))
        else:
            rules = vllm_layout(spec, replace(i.parallel, replicas=1))
            per_worker = [list(rules.for_rank(r)) for r in range(rules.world_size)]
        return Described(tuple(tuple(w) for w in per_worker), not_direct)

    def join(self, init: EngineInitInfo) -> None:
        _checked(lambda: self.engine.init_weight_transfer_engine({"init_info": init.to_wire()}))

    def pause(self, swap: bool) -> None:
        """vLLM's own scheduler pause (``sleep(level=0)``): every client path meets it; running
        requests stay, frozen, for a blocking refit and a swap alike."""
        _checked(lambda: self.engine.sleep(level=0, mode="keep"))

    def begin(self) -> None:
        _checked(self.engine.start_weight_update)

    def transfer(self, update: EngineUpdateInfo) -> None:
        _checked(lambda: self.engine.update_weights({"update_info": update.to_wire()}))

    def conclude(self, version: str | None) -> None:
        """``finish_weight_update``: it raises on the engine's last worker only when the refit
        did not commit there; every worker's session is closed either way
        (``adapters.vllm.session``). The label is set at ``resume``, once the workers confirmed."""
        _checked(self.engine.finish_weight_update)

    def status(self) -> list[WorkerStatus] | None:
        if not engine_info(self.engine).diagnostics:
            return None
        return _checked(lambda: worker_status(self.engine))

    def refresh(self, version: str, recompute: bool = False, encoders: bool = False) -> str:
        """vLLM resets its prefix cache only when no request holds blocks (``recompute``
        preempts the running ones, which recompute their KV): a note says when it could not.
        ``encoders`` (the vision tower or projector changed): the running requests are
        preempted and the encoder cache dropped -- the scheduler's and the workers' at once
        (``reset_encoder_cache``; a worker's alone would leave the scheduler pointing at
        outputs that are gone) -- so no request, new or resumed, reuses an image encoded
        under the old weights. Then the weights are labelled."""
        note = ""
        if _checked(lambda: self.engine.reset_prefix_cache(reset_running_requests=recompute or encoders)) is False:
            note = ("prefix cache not reset (requests running across the swap hold KV blocks computed with the "
                    "old weights; refit.recompute_kv_cache_after_weight_updates=false keeps them)")
        if encoders:
            _checked(lambda: reset_encoder_cache(self.engine))
        _checked(lambda: self.engine.update_weight_version(version))
        return note

    def resume(self) -> None:
        _checked(lambda: self.engine.wake_up(tags=["scheduling"]))

    def close(self) -> None:
        _checked(self.engine.shutdown_weight_transfer_engine)

