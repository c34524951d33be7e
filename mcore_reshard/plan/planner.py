"""The planner: intersect source and destination pieces into a minimal-bytes transfer plan.

Pure and deterministic: it imports neither megatron nor vllm and works on descriptors alone,
so full-size plans can be computed and checked anywhere. Phases, in the spirit of DCP's
planner (local plan -> global plan -> finish), one module each:

0. named passes   ``fp8`` (``layout.quant.fp8_sides``: what the senders quantize), ``casts``
                  and ``reinterpret`` (``validate``: dtypes that differ, tensors carried as
                  their bits) read both sides first; each adds a typed record to the plan
                  (``plan.extensions``) only where it finds something. ``placement`` and
                  ``relays`` run on a made plan (``plan.placed``).
1. ``validate``   both sides describe the same canonical tensors (casts only where allowed),
                  one element type on the wire, source boxes tile every tensor, destination
                  pieces lie inside their tensors and never overlap.
2. ``fragments``  destination box x source box intersections, one sender per fragment chosen
                  among the replicas by bytes already assigned (largest first); with a
                  ``link_cost`` the cheapest link to the destination first (a holder on the
                  same device, then the same node, then any).
3. ``fragments``  adjacent fragments between the same pair of local tensors merge into one.
4. ``buckets``    fragments split to the byte budget and packed into buckets so no rank
                  sends or receives more than ``bucket_bytes`` in one bucket.

``plan_senders`` stops before phase 4 (``SendersChosen``): which bytes cross between which
ranks is known there, and ``finish()`` makes the plan ``build_plan`` makes. The placement's
relay choice reads a candidate's bytes per link there and finishes only the chosen one.

Cost: a full-size MoE plan has ~300k transfers. Local tensors repeated across ranks
(``param_kinds``) are checked and intersected once, and checked once across layers too;
fragments travel in blocks, are keyed, sorted and gathered column-wise; sender choice walks
fragments one by one only where there is a choice, merge only sees local tensors that get
several fragments of one canonical tensor, and the cycle collector is paused while planning
(the plan then goes to its oldest generation unscanned). The plan is the same as the
straightforward one-sort-per-phase version: ``tests/test_plan_speed.py`` pins digests.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import gc
import itertools
import math
import operator
import time
from typing import Callable, Iterable, Iterator

from ..layout.descriptor import DTYPE_BYTES, SideLayout, contiguous_strides
from ..layout.quant import fp8_sides, scale_name
from .buckets import Charges, Keys, bucket, split_fragment
from .extensions import Casts, Quantized, Reinterpreted, Scaled
from .fragments import Blocks, add_moves, choose_senders, fragment, merge
from .types import PlanError, TransferPlan
from .validate import (check_dest, check_sides, check_whole_elements, first_uncovered, index_sources, param_kinds,
                       reinterpreted, wire_dtype)

__all__ = ["build_plan", "plan_senders", "SendersChosen", "check_sides", "index_sources", "check_dest", "param_kinds",
           "gc_paused"]

_SRC, _BOX, _RANK, _NUMEL = (operator.attrgetter(a) for a in ("src", "box", "rank", "numel"))


def build_plan(
    src: SideLayout,
    dst: SideLayout,
    *,
    bucket_bytes: int = 1 << 28,
    allow_cast: bool = False,
    not_direct: Iterable[tuple[str, str]] = (),
    link_cost: Callable[[int, int], int] | None = None,
    charges: Iterable[tuple[int, str, tuple[int, ...]]] = (),
) -> TransferPlan:
    """Plan a refit from ``src`` (training) to ``dst`` (inference). See module docstring.

    ``link_cost(src rank, dst rank)``: a small integer per link class (e.g. 0 same device,
    1 same node, 2 other node); among a fragment's replicas the cheapest link wins, then the
    least loaded. None: load only (plans bit-identical to those made before it existed).
    ``charges``: (destination rank, local tensor, other destination ranks) -- what that
    tensor receives also counts against those ranks' bucket budgets (fan-out relays: their
    members receive it too, forwarded)."""
    return plan_senders(src, dst, bucket_bytes=bucket_bytes, allow_cast=allow_cast, not_direct=not_direct,
                        link_cost=link_cost, charges=charges).finish()


def plan_senders(
    src: SideLayout,
    dst: SideLayout,
    *,
    bucket_bytes: int = 1 << 28,
    allow_cast: bool = False,
    not_direct: Iterable[tuple[str, str]] = (),
    link_cost: Callable[[int, int], int] | None = None,
    charges: Iterable[tuple[int, str, tuple[int, ...]]] = (),
) -> "SendersChosen":
    """:func:`build_plan` up to its last phase: every check, every fragment with its sender,
    merged -- what decides which bytes cross which link -- but no buckets and no transfers
    yet. ``SendersChosen.link_bytes`` is then exactly the finished plan's bytes per (source,
    destination) pair, and ``finish()`` the plan ``build_plan`` returns. Why: a placement's
    relay choice compares the direct plan's modelled time with the relayed plan's, and the
    direct plan's time needs only its senders -- its buckets (most of a full-size plan's
    cost) are made only where the direct plan is the one chosen."""
    t0 = time.perf_counter()
    with gc_paused():
        chosen = _choose(src, dst, bucket_bytes, allow_cast, not_direct, link_cost,
                         {(r, n): tuple(o) for r, n, o in charges})
    chosen.seconds = time.perf_counter() - t0
    return chosen


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Planning allocates a few objects per transfer and frees none of them: the cycle
    collector would rescan them all again and again (about 40% of a full-size plan). What
    walks a plan's transfers after it is made (relays, reports) allocates as much: the
    placement's plan and the CLI's commands pause it too; nested pauses do nothing.

    On the way out the survivors -- the plan, one object per transfer, kept for every refit --
    go straight to the oldest generation (``freeze`` + ``unfreeze``, no scan): the next young
    collection would otherwise walk all of them once more for nothing (~10% of a full-size
    plan). Skipped when someone froze objects, whose ``unfreeze`` this would be.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


class SendersChosen:
    """A plan with its senders chosen, before buckets (:func:`plan_senders`): the
    fragments as ``Blocks`` (sender, destination sites) and what the last phase needs.
    ``finish()`` makes the plan once; a planner's intermediate state, not a value to keep."""

    def __init__(self, src: SideLayout, dst: SideLayout, num_dst: int, blocks: Blocks, first_numel: dict[int, int],
                 itemsize: int, charges: Charges | None, reinterpret: tuple, records: tuple, shell: TransferPlan):
        self.src, self.dst = src, dst  # (in wire units where tensors are carried as their bits)
        self.num_dst = num_dst  # destination rank slots (a rank past world_size still gets one)
        self.blocks, self.first_numel, self.itemsize = blocks, first_numel, itemsize
        self.charges, self.reinterpret = charges, reinterpret
        self._records = records  # ``_side_records``' arguments: its refusal comes after the buckets'
        #: The plan's fields but its transfers, buckets, records (and ``plan_seconds``).
        self.shell = shell
        self.bucket_bytes = shell.bucket_bytes
        self.seconds = 0.0  # time spent choosing
        self._plan: TransferPlan | None = None

    @property
    def bytes_min(self) -> int:
        return self.shell.bytes_min

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """(source rank, destination rank) -> bytes the finished plan moves between them:
        every fragment's bytes (buckets split fragments but keep their bytes and ranks).
        Raises what ``finish()`` would raise (:meth:`check`)."""
        self.check()
        senders, counts, sites = self.blocks
        itemsize, width = self.itemsize, self.num_dst
        # per site its block's (source, bytes), gathered C-level; summed per pair as one int
        src = itertools.chain.from_iterable(map(itertools.repeat, map(_SRC, senders), counts))
        nbytes = itertools.chain.from_iterable(map(itertools.repeat, [b.numel * itemsize for b in map(_BOX, senders)],
                                                   counts))
        pairs: dict[int, int] = {}
        get = pairs.get
        for s, d, nb in zip(src, map(_RANK, sites), nbytes):
            k = s * width + d
            pairs[k] = get(k, 0) + nb
        return {divmod(k, width): nb for k, nb in pairs.items()}

    def check(self) -> None:
        """Raise what ``finish()`` would raise (by finishing: the same error), so that a plan
        never finished is refused as the finished one would be."""
        if self._plan is None and self._refused():
            self.finish()

    def _refused(self) -> bool:
        """Whether ``finish()`` raises: an element over the budget, a bucket split cutting an
        element carried as bits, records that conflict, or bytes other than the destination holds."""
        senders, counts, sites = self.blocks
        planned = sum(map(operator.mul, map(_NUMEL, map(_BOX, senders)), counts)) * self.itemsize
        if (self.itemsize > self.bucket_bytes and sites) or planned != self.bytes_min:
            return True
        try:
            _side_records(*self._records)
        except PlanError:
            return True
        if not self.reinterpret:
            return False
        real, budget, counts = dict(self.reinterpret), self.bucket_bytes, self.blocks.counts
        first = itertools.accumulate(counts, initial=0)  # each block's first site
        parts = [part for s, n, i in zip(senders, counts, first) if n and s.canonical in real
                 for part, _ in split_fragment(s, sites[i], self.itemsize, budget)]  # (a block's sites split alike)
        try:
            check_whole_elements(parts, real, self.shell.dtype, budget)
        except PlanError:
            return True
        return False

    def finish(self) -> TransferPlan:
        """The plan (made once): fragments split to the budget and packed into buckets."""
        if self._plan is None:
            t0 = time.perf_counter()
            with gc_paused():
                plan = self._finish()
            self._plan = replace(plan, plan_seconds=self.seconds + time.perf_counter() - t0)
            self.blocks = Blocks([], [], [])  # (their memory is the plan's now)
        return self._plan

    def _finish(self) -> TransferPlan:
        shell, dst = self.shell, self.dst
        transfers, num_buckets, planned = bucket(self.blocks, self.first_numel, self.itemsize, self.bucket_bytes,
                                                 _keys(dst, self.src.world_size, self.num_dst), self.charges)
        if self.reinterpret:
            check_whole_elements(transfers, dict(self.reinterpret), shell.dtype, self.bucket_bytes)
        plan = replace(shell, transfers=tuple(transfers), num_buckets=num_buckets,
                       extensions=_side_records(*self._records))
        if planned != plan.bytes_min:
            raise PlanError(
                f"planned {planned} bytes but the destination holds {plan.bytes_min}: coverage is not exact "
                f"({first_uncovered(dst, plan)})"
            )
        return plan


def _choose(
    src: SideLayout, dst: SideLayout, bucket_bytes: int, allow_cast: bool, not_direct: Iterable[tuple[str, str]],
    link_cost: Callable[[int, int], int] | None = None, charges: Charges | None = None,
) -> SendersChosen:
    if bucket_bytes <= 0:
        raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
    scaled = _scaled(dst)  # (before the sides are rewritten below)
    # what the destination holds in block FP8 the senders quantize, but blocks the training
    # layout cuts travel unquantized and the receiver quantizes them (``layout.quant.fp8_sides``)
    src, dst, at_receiver = fp8_sides(src, dst)
    casts = check_sides(src, dst, allow_cast=allow_cast)
    quantized = src.quantize  # (the reinterpreted copies below do not need it)
    dtype, reinterpret = wire_dtype(dst, casts)
    if reinterpret:  # both sides, in wire-dtype units from here on
        real = dict(reinterpret)
        src, dst = reinterpreted(src, real, dtype, "source"), reinterpreted(dst, real, dtype, "destination")
    index = index_sources(src)
    kinds = param_kinds(dst)
    padding = check_dest(dst, kinds)
    itemsize = DTYPE_BYTES[dtype]
    order = {name: i for i, name in enumerate(dst.tensors)}
    num_dst = max(dst.world_size, 1 + max((p.rank for p in dst.params), default=0))

    hits, cut = fragment(dst, index, order, kinds)
    costs = None
    if link_cost is not None:  # by destination rank: a row of per-source costs
        costs = [[link_cost(s, d) for s in range(src.world_size)] for d in range(num_dst)]
    blocks, maybe = choose_senders(hits, cut, src.world_size, itemsize, costs)
    del hits, cut, index  # their memory is reused for the transfers (the index: once no candidate of src needs it)
    merged, first_numel = merge(maybe)
    first_numel = {len(blocks.sites) + i: n for i, n in first_numel.items()}
    add_moves(blocks, merged)

    dst_numel = sum(p.numel for p in dst.params) - sum(n for _, _, n in padding)
    total_elems = sum(math.prod(shape) for shape, _ in dst.tensors.values())
    hf_bytes = total_elems * itemsize
    if quantized or at_receiver:  # the baseline broadcasts the unquantized model (the engine quantizes on load)
        hf_bytes = _hf_unquantized_bytes(dst.tensors, dict(quantized))
    shell = TransferPlan(
        transfers=(),
        num_buckets=0,
        num_src=src.world_size,
        num_dst=dst.world_size,
        dtype=dtype,
        bytes_min=dst_numel * itemsize,
        bytes_hf_broadcast=hf_bytes * dst.world_size,
        bucket_bytes=bucket_bytes,
        padding=tuple(padding),
        not_direct=tuple(not_direct),
        notes=tuple(dict.fromkeys(tuple(src.notes) + tuple(dst.notes))),  # a note both sides make, once
    )
    return SendersChosen(src, dst, num_dst, blocks, first_numel, itemsize, charges, tuple(reinterpret),
                         (casts, reinterpret, quantized, at_receiver, scaled), shell)


def _scaled(dst: SideLayout) -> tuple[tuple[str, float], ...]:
    """The ``lora`` pass: the destination's scaled tensors (``SideLayout.scale``), checked."""
    out = []
    for name, factor in dst.scale:
        if name not in dst.tensors:
            raise PlanError(f"{name}: scaled by {factor} on the destination, which does not hold it")
        if not (factor > 0 and math.isfinite(factor)):
            raise PlanError(f"{name}: scale factor {factor} must be positive and finite")
        if factor != 1.0:
            out.append((name, float(factor)))
    return tuple(out)


def _side_records(casts: tuple, reinterpret: tuple, quantized: tuple, at_receiver: tuple,
                  scaled: tuple = ()) -> tuple:
    """The records of the passes that read both sides before fragmenting (``fp8``, ``casts``,
    ``reinterpret``, ``lora``; ``plan.extensions``), each only where it found something."""
    out: list = []
    if scaled:
        if quantized or at_receiver:
            raise PlanError("LoRA adapters into an FP8 engine: a scaled tensor cannot also be quantized")
        out.append(Scaled(scaled))
    if quantized or at_receiver:
        out.append(Quantized(tuple(quantized), tuple(at_receiver)))
    if casts:
        out.append(Casts(tuple(casts)))
    if reinterpret:
        out.append(Reinterpreted(tuple(reinterpret)))
    return tuple(out)


def _hf_unquantized_bytes(tensors: dict, held: dict[str, str]) -> int:
    """Bytes of the whole model as the HF baseline sends it into an FP8 engine: quantized
    tensors in the dtype the trainers hold, no scales, the rest as they are."""
    scales = {scale_name(n) for n in held}
    return sum(math.prod(shape) * DTYPE_BYTES[held.get(name, d)] for name, (shape, d) in tensors.items()
               if name not in scales)


def _keys(dst: SideLayout, num_src: int, num_dst: int) -> Keys:
    """Placement keys over the destination's tensors (``buckets.Keys``)."""
    shapes = [shape for shape, _ in dst.tensors.values()]
    strides: dict[tuple[int, ...], tuple[int, ...]] = {}  # by shape: many tensors share one
    return Keys(num_src, num_dst, 1 + max(map(math.prod, shapes), default=0),
                {name: strides.get(tuple(shape)) or strides.setdefault(tuple(shape), contiguous_strides(shape))
                 for name, (shape, _) in dst.tensors.items()})
