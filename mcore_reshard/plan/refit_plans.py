"""A policy's refit plans from the two sides as each entry point knows them: one pure function.

The driver knows its engines by what their workers describe; vLLM's trainer-side API
(``adapters/vllm/backend/trainer.py``) lays its engine out by the rules. Both then extend the
two sides the same way and plan the same plans here, so a LoRA, MTP or FP8 refit is planned
alike whichever entry point runs it:

- **LoRA** (``peft``): the adapter's canonical tensors join the training side's table, the
  adapter matrices the trainers hold are checked against ``peft.dim`` (one line before anything
  is planned), the engines' refit adapter slots join the destination side, and a second plan
  moves the adapter only (``adapter_plan``: every refit after the first commit);
- **MTP**: the draft's canonical tensors join a side's table where that side holds any of
  them (megatron's MTP block, an engine that drafts), so target and draft are one plan, one vote;
- **FP8**: a destination that holds tensors in block FP8 is quantized at the senders by the
  planner itself (``layout.quant.fp8_sides``, the planner's first pass): nothing to add here;
- **frozen weights** (``frozen``: a vision-language policy's frozen tower, ``ModelSpec.frozen_tensors``):
  a second plan without them (``frozen_plan``), every refit after the first commit -- the first
  moves them once, as a LoRA policy's first refit moves its base weights.

Metadata only (layout and plan): the callers compute what needs their libraries (the
engines' slot layout, the draft's pieces) and pass it in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ConfigError
from ..layout import ModelSpec, SideLayout
from ..layout.lora import PeftConfig, adapter_tensors, adapters_only, with_adapter
from ..layout.mtp import draft_tensors
from .cache import get_plan
from .placed import Links, plan_for_placement
from .types import TransferPlan

__all__ = ["RefitPlans", "plan_refit", "with_draft_tensors", "check_adapter_shapes", "moves_encoder"]


@dataclass(frozen=True)
class RefitPlans:
    """Both sides, the plan of a full refit, and a LoRA policy's adapter-only plan (None: not
    a LoRA policy)."""

    src: SideLayout
    dst: SideLayout
    plan: TransferPlan
    adapter_plan: TransferPlan | None = None
    #: A policy with frozen weights: the plan of every refit after the first, without them.
    frozen_plan: TransferPlan | None = None
    frozen: frozenset[str] = frozenset()

    @property
    def later(self) -> TransferPlan | None:
        """The plan of every refit after the first commit, where it moves less (None: ``plan``)."""
        return self.adapter_plan if self.adapter_plan is not None else self.frozen_plan

    def after_commit(self, plan: TransferPlan) -> TransferPlan:
        """The plan of the refit after ``plan`` committed on every rank: a LoRA policy's base
        weights (a frozen tower) are in the engines after its first full refit, so the adapter
        only (all but the tower) from then on."""
        later = self.later
        if later is not None and plan.digest() == self.plan.digest() != later.digest():
            return later
        return plan

    def sides(self, plan: TransferPlan) -> tuple[SideLayout, SideLayout]:
        """The two sides ``plan`` was planned from (the adapter plan's: the adapter only; the
        frozen plan's: all but the frozen tensors)."""
        if self.adapter_plan is not None and plan is self.adapter_plan:
            return adapters_only(self.src), adapters_only(self.dst)
        if self.frozen_plan is not None and plan is self.frozen_plan:
            return without_tensors(self.src, self.frozen), without_tensors(self.dst, self.frozen)
        return self.src, self.dst


def plan_refit(src: SideLayout, dst: SideLayout, spec: ModelSpec, engine_spec: ModelSpec, *,
               peft: PeftConfig | None = None, slots: SideLayout | None = None, extend_dst: bool = True,
               bucket_bytes: int, allow_cast: bool = False, not_direct: tuple[tuple[str, str], ...] = (),
               placement: Any = None, links: Links | None = None, frozen: frozenset[str] = frozenset()) -> RefitPlans:
    """``src`` (the training ranks' pieces) and ``dst`` (the engines' pieces, in the engines'
    dtype ``engine_spec``) extended for the policy's features (the module docstring), and
    their plans. ``slots``: the engines' refit adapter slots (a LoRA policy; ranks offset per
    engine); ``extend_dst=False``: ``dst`` is complete as given (a caller's own layout).
    ``placement`` / ``links``: plan for where every rank sits (``plan.placed``)."""
    peft = peft if peft is not None and peft.enabled else None
    if peft is not None:
        tensors = adapter_tensors(spec, peft)
        src = replace(src, tensors={**src.tensors, **{n: t for n, t in tensors.items() if n not in src.tensors}})
        check_adapter_shapes(src, tensors, peft)
    src = with_draft_tensors(src, spec)
    if extend_dst:
        if peft is not None:
            if slots is None:
                raise ConfigError("peft.enabled: the engines' refit adapter slots are not given")
            # The slots are the rules' whatever the engine described: a worker whose refit adapter
            # is installed already (a driver restarted, a second session) also describes them.
            ours = {(p.rank, p.name) for p in slots.params}
            dst = replace(dst, params=tuple(p for p in dst.params if (p.rank, p.name) not in ours))
            dst = with_adapter(dst, slots.params, adapter_tensors(engine_spec, peft), slots.scale)
        dst = with_draft_tensors(dst, engine_spec)
    tower = spec.tower_tensors()
    if tower and not any(q.canonical in tower for q in dst.pieces()):
        raise ConfigError(f"{spec.family.title} policy: the engines hold no vision tower ({dst.name}: a text-only "
                          f"engine?), so its tower and projector would never be refit; serve the checkpoint's own "
                          f"architecture ({', '.join(spec.family.architectures)})")
    if placement is not None:
        plan = plan_for_placement(src, dst, placement, links or Links(), bucket_bytes=bucket_bytes,
                                  allow_cast=allow_cast, not_direct=not_direct)
    else:
        plan = get_plan(src, dst, bucket_bytes=bucket_bytes, allow_cast=allow_cast, not_direct=not_direct)
    adapter_plan = frozen_plan = None
    if peft is not None:
        adapter_plan = get_plan(adapters_only(src), adapters_only(dst), bucket_bytes=bucket_bytes,
                                allow_cast=allow_cast)
    frozen = frozenset(frozen) & frozenset(dst.tensors)
    if frozen and peft is None:
        frozen_plan = get_plan(without_tensors(src, frozen), without_tensors(dst, frozen), bucket_bytes=bucket_bytes,
                               allow_cast=allow_cast, not_direct=not_direct)
    return RefitPlans(src, dst, plan, adapter_plan, frozen_plan, frozen)


def without_tensors(side: SideLayout, names: frozenset[str]) -> SideLayout:
    """``side`` without the canonical tensors ``names``: their pieces, the local tensors left
    with none, their table entries (a frozen tower's later refits plan the rest)."""
    params = []
    for p in side.params:
        pieces = tuple(q for q in p.pieces if q.canonical not in names)
        if pieces or not p.pieces:
            params.append(p if len(pieces) == len(p.pieces) else replace(p, pieces=pieces))
    return replace(side, name=f"{side.name} (frozen left out)", params=tuple(params),
                   tensors={n: t for n, t in side.tensors.items() if n not in names},
                   quantize=tuple(q for q in side.quantize if q[0] not in names))


def moves_encoder(plan: TransferPlan, spec: ModelSpec) -> bool:
    """Whether ``plan`` writes any weight a multimodal encoder computes with (the vision tower,
    the projector): the engines then drop their cached encoder outputs when it commits
    (``RefitRequest.encoders``). A frozen tower's later refits move none of it: the cache stays."""
    tower = spec.tower_tensors()
    return bool(tower) and any(t.canonical in tower for t in plan.transfers)


def with_draft_tensors(side: SideLayout, spec: ModelSpec) -> SideLayout:
    """``side`` with the MTP layers' canonical tensors in its table where it holds any of them
    (a trainer built with megatron's MTP block, an engine that runs the draft)."""
    if not spec.mtp_layers:
        return side
    draft = draft_tensors(spec)
    if not any(q.canonical in draft for q in side.pieces()):
        return side
    return replace(side, tensors={**side.tensors, **draft})


def check_adapter_shapes(src: SideLayout, tensors: dict, peft: PeftConfig) -> None:
    """Every adapter matrix the training ranks hold has the shape ``peft`` gives it (``dim``):
    one line naming the first that does not, before anything is planned."""
    extent: dict[str, list[int]] = {}
    for q in src.pieces():
        if q.canonical in tensors:
            e = extent.setdefault(q.canonical, [0] * len(q.box.offsets))
            for i, (o, n) in enumerate(zip(q.box.offsets, q.box.sizes)):
                e[i] = max(e[i], o + n)
    for name, held in extent.items():
        want = list(tensors[name][0])
        if held != want:
            raise ConfigError(f"peft.dim={peft.dim}: the training ranks hold {name} as {held}, the settings say {want}")
