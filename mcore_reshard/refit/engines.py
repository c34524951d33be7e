"""The driver's side of its engines: each as a refit destination, what one holds (its
workers' pieces, ranks offset per engine), its LoRA refit-adapter slots, and how long an engine
may take once the trainers are done.

Apart from the driver so that it stays orchestration only. The vLLM adapters import vLLM at
load: they are imported inside the functions, never here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from ..adapters.vllm.lora_rules import vllm_lora_layout
from ..layout import LocalParam, ModelSpec, Piece, SideLayout
from ..layout.lora import PeftConfig, adapter_tensors
from ..layout.quant import held_tensors
from ..transport.destination import Described, DestinationInfo

__all__ = ["as_destination", "engine_world", "engine_dtype", "dst_layout_of", "ENGINE_GRACE_S", "adapter_slots_of"]


def as_destination(engine: Any) -> Any:
    """``engine`` as a refit destination: a destination as it is (its class has ``transfer`` and
    ``conclude``), anything else -- an ``LLM``, an ``AsyncEngine``, a handle that forwards their
    calls -- wrapped in ``adapters.vllm.destination.VllmEngine`` (imported only then)."""
    kind = type(engine)  # the class, not the object: a forwarding handle answers every attribute
    if callable(getattr(kind, "transfer", None)) and callable(getattr(kind, "conclude", None)):
        return engine
    from ..adapters.vllm.destination import VllmEngine

    return VllmEngine(engine)


def engine_world(engine: Any) -> int:
    """Workers of one engine (tp * pp * dp)."""
    return as_destination(engine).info().world_size


def engine_dtype(engine: Any) -> str:
    """The element type an engine serves (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return as_destination(engine).info().dtype


def _restamp(params: Sequence[LocalParam], offset: int) -> list[LocalParam]:
    """The same pieces on destination rank ``offset + local rank`` (engine ``e`` of several)."""
    if not offset:
        return list(params)
    out = []
    for p in params:
        r = p.rank + offset
        out.append(replace(p, rank=r, pieces=tuple(Piece(r, q.local_name, q.canonical, q.box, q.view) for q in p.pieces)))
    return out


def dst_layout_of(described: Sequence[Described], spec: ModelSpec, name: str = "vllm") -> SideLayout:
    """Every engine's destination pieces (``Destination.describe``), ranks offset per engine.
    ``spec`` is in the engines' dtype."""
    params: list[LocalParam] = []
    offset = 0
    for d in described:
        for worker_params in d.params:
            params.extend(_restamp(worker_params, offset))
        offset += len(d.params)
    # An FP8 engine's workers describe codes and scales: the table says so too.
    return SideLayout(name, offset, tuple(params), held_tensors(spec.tensor_table(), params))


def adapter_slots_of(infos: Sequence[DestinationInfo], spec: ModelSpec, peft: PeftConfig) -> SideLayout:
    """Every engine's refit adapter slots (``lora_rules``), ranks offset per engine: what each
    worker installs and checks against its live slots at init (``lora_slots``), before any of
    it is described by the worker. ``plan.refit_plans.plan_refit`` adds them to the engines' side."""
    params: list[LocalParam] = []
    offset = 0
    scale: tuple = ()
    for info in infos:
        slots = vllm_lora_layout(spec, replace(info.parallel, replicas=1), peft)
        params.extend(_restamp(slots.params, offset))
        scale = slots.scale
        offset += info.world_size
    return SideLayout("vllm-lora", offset, tuple(params), adapter_tensors(spec, peft), scale=scale)


#: Seconds an engine may take to answer ``update_weights`` after every trainer is done.
ENGINE_GRACE_S = 10.0
