"""Where a refit's boxes go on a vLLM worker: :class:`VllmSink`, and what a request wraps around it.

``VllmSink`` is the worker's ``transport.sink.Sink`` (DCP's ``resolve_tensor`` /
``commit_tensor``): ``resolve`` gives the tensor a box goes into -- the live one, a staged copy
or its layer's shadow (``shadows.py``, held by the refit's participant, ``apply.VllmApplier``)
--, ``commit_box`` counts the box and processes a layer it completes (streaming: also swaps it
in), and ``baseline`` gives what the worker serves now for a delta, from the delta baselines it
holds (``baselines.py``). The refit's own commit is the participant's.

Around it, when a request asks: ``verify=full``'s copy (the transport's ``Mirror``) and a
fault's exit after n boxes (``ExitAfterBoxes``), both through the sink's calls; and
``AlteredBaseline``, the participant altering a delta's baseline as the refit opens (fault
injection).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import RefitIncomplete
from ...layout.descriptor import LayoutError, LocalParam, View
from ...transport.participant import Participant, Prepared
from ...transport.injection import ExitAfterBoxes
from ...transport.sink import Mirror
from ...transport.views import TORCH_DTYPES, copy_unless_same, local_view, zero_padding
from ...wire.faults import EngineFault
from ...wire.protocol import RefitRequest
from .baselines import ModelFormatCopies
from .gate import Serving
from .layers import DIRECT, RELOAD, ParamTable
from .shadows import LayerShadow, Shadows

__all__ = ["VllmSink", "AlteredBaseline", "refit_sink"]


class VllmSink:
    """One worker's sink (see the module docstring): each box's tensor, the count of what
    arrived, and the model-format copies a delta starts from (``baselines``).

    A box committed without being resolved was left unchanged by a delta: where its parameter
    already has a staged copy or shadow its values are copied in, else none is made for it
    (``_kept``: a module a delta left alone is neither copied nor reprocessed; should another
    box of the parameter (direct) or of its module (reload) need one, they are copied in then)."""

    def __init__(self, table: ParamTable, shadows: Shadows, serving: Serving) -> None:
        self.table, self.shadows, self.serving = table, shadows, serving
        self.params = table.params  # the executor reads the wire dtype from here
        #: Delta refits: the model-format values of every reload-mode parameter as last
        #: committed (its live tensor is kernel format, so a delta cannot start from it). Kept
        #: only while refits ask for deltas (``keep_baselines``).
        self.baselines = ModelFormatCopies()
        self.begin()

    def begin(self) -> None:
        """A refit (or a load) starts: nothing counted, kept or handed out yet."""
        self._written: dict[str, int] = {}
        self._kept: dict[str, list[View]] = {}
        self._resolved: set[tuple[str, View]] = set()  # boxes handed out and not committed yet
        self.baselines.begin()

    # -- ``transport.sink.Sink`` --------------------------------------------------------------
    def resolve(self, name: str, view: View) -> torch.Tensor:
        """Where the box at ``view`` goes: the live tensor (direct, streaming), its staged copy
        (direct, atomic) or its module's model-format shadow (reload)."""
        self._check(name, view)
        self._resolved.add((name, view))
        return local_view(self._target(name), view)

    def commit_box(self, name: str, view: View) -> None:
        """The box is in place: counted, and a layer it completes processed (streaming: also
        swapped in). A box never resolved in this refit was kept by a delta (class docstring)."""
        if (name, view) in self._resolved:
            self._resolved.discard((name, view))
            self.baselines.wrote_whole(name)
        else:
            self._check(name, view)
            if not self.shadows.holds(name):
                self._count(name, math.prod(view.shape))
                self._kept.setdefault(name, []).append(view)
                return
            copy_unless_same(local_view(self._target(name), view), self.baseline(name, view))
        self._placed(name, math.prod(view.shape))

    def baseline(self, name: str, view: View) -> torch.Tensor:
        """What the engine serves at ``view`` now, in model format (a delta refit's baseline):
        the live tensor of a direct parameter, the last committed model-format copy of a
        reload-mode one."""
        lp = self._check(name, view)
        if self.table.modes[name] == DIRECT:
            live = local_view(self.table.live(name), view)
            want = TORCH_DTYPES[lp.dtype]  # a widened live tensor (``Shadows.widened``): in model format
            return live if live.dtype == want else live.to(want)
        base = self.baselines.committed.get(name)
        if base is None:
            raise RefitIncomplete(f"{name}: no model-format baseline for a delta refit")
        return local_view(base, view)

    # -- what the participant asks at its steps ------------------------------------------------
    def check_complete(self) -> None:
        """Every box arrived: raise naming the touched parameters not fully written, then zero
        the padding of the direct parameters' tensors."""
        t = self.table
        touched = dict.fromkeys(self.shadows.touched())
        if not self.shadows.atomic:
            touched.update(dict.fromkeys(n for n in self._written if t.modes[n] == DIRECT))
        for n in self._kept:  # kept boxes only: the whole module (reload) or parameter was sent
            touched.update(dict.fromkeys((n, *(t.module_params(n) if t.modes[n] == RELOAD else ()))))
        missing = [(n, self._written.get(n, 0), t.expected(n)) for n in touched
                   if self._written.get(n, 0) != t.expected(n)]
        if missing:
            desc = ", ".join(f"{n} ({w}/{e} elements)" for n, w, e in missing[:5])
            raise LayoutError(f"refit incomplete: touched parameters not fully written: {desc}")
        for name in self._written:
            lp = t.params[name]
            if t.modes[name] == DIRECT and lp.padding and self.shadows.holds(name):
                zero_padding(self.shadows.target(name), lp)

    def process_rest(self) -> None:
        """vLLM's processing of every shadow not processed yet (atomic, before the vote)."""
        for st in self.shadows.unprocessed():
            self._process(st)

    def refit_committed(self) -> None:
        """The refit committed: the copies are what the engine now serves."""
        self.baselines.commit()
        self._kept = {}

    def refit_dropped(self, live_changed: bool) -> None:
        """The refit failed: nothing of it is kept; if live weights changed, no copy is current."""
        self._kept = {}
        self.baselines.drop(live_changed)

    # -- the delta baselines -------------------------------------------------------------------
    def keep_baselines(self, keep: bool) -> None:
        """Whether refits ask for deltas (else no model-format copy is kept)."""
        self.baselines.keep = keep

    def baselines_ready(self) -> bool:
        """Whether every reload-mode parameter has a model-format copy from a committed refit
        (and refits keep them): a delta can start from what this worker holds."""
        return self.baselines.keep and all(
            n in self.baselines.committed for n, m in self.table.modes.items() if m == RELOAD)

    def alter_baseline(self, name: str) -> None:
        """Fault injection (tests): add 1 to the first element a delta of ``name`` would start
        from -- its live tensor, or its model-format copy."""
        if name not in self.table.modes:
            raise LayoutError(f"alter_baseline: {name} is not a parameter of this worker")
        if self.table.modes[name] == DIRECT:
            self.table.live(name).view(-1)[0] += 1
        elif name in self.baselines.committed:
            self.baselines.committed[name].view(-1)[0] += 1

    def forget_baselines(self) -> None:
        """The weights changed outside a refit: no model-format copy is current any more."""
        self.baselines.committed.clear()

    def baseline_bytes(self) -> int:
        """Bytes of model-format copies kept for delta refits (``delta_state_bytes``)."""
        return self.baselines.nbytes

    # -- internals -------------------------------------------------------------------------------
    def _check(self, name: str, view: View) -> LocalParam:
        if self.serving.state != "updating":
            raise RuntimeError(f"write({name}) outside begin()/finish() (state {self.serving.state})")
        lp = self.table.params.get(name)
        if lp is None:
            raise LayoutError(f"{name}: not a parameter of this worker")
        if view.offset < 0 or (math.prod(view.shape) and view.extent()[1] > lp.numel):
            raise LayoutError(f"{name}: view {view} leaves the local tensor of {lp.numel} elements")
        return lp

    def _target(self, name: str) -> torch.Tensor:
        """``shadows.target``, and a staged copy or shadow made just now takes the boxes kept
        for its parameters."""
        made = not self.shadows.holds(name)
        target = self.shadows.target(name)
        if made:
            for n in self.shadows.made_with(name):
                views = self._kept.pop(n, ())
                if views:
                    into = self.shadows.target(n)
                    for view in views:
                        local_view(into, view).copy_(self.baseline(n, view))
        return target

    def _count(self, name: str, n: int) -> None:
        done = self._written.get(name, 0) + n
        expected = self.table.expected(name)
        if done > expected:
            raise LayoutError(f"{name}: {done} elements written, only {expected} expected (overlapping writes?)")
        self._written[name] = done

    def _placed(self, name: str, n: int) -> None:
        self._count(name, n)
        if self.table.modes[name] == RELOAD:
            st = self.shadows.layer_of(name)
            if all(self._written.get(p, 0) == self.table.expected(p) for p in st.names.values()):
                # Processed as soon as it is complete, while later buckets are on the wire;
                # atomic mode swaps it in only after the vote (nothing live changes here).
                self._process(st)
                if not self.shadows.atomic:
                    self.shadows.commit_layer(st)

    def _process(self, st: LayerShadow) -> None:
        self.shadows.process(st, self.baselines.before_processing)


def refit_sink(sink: VllmSink, full_copy: bool, fault: EngineFault | None) -> tuple[Any, dict | None]:
    """(the sink a refit's boxes go to, the ``verify=full`` copies or None)."""
    out: Any = sink
    copies = None
    if full_copy:
        copies = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in sink.params.values()}
        out = Mirror(out, copies)
    if fault is not None and fault.exit_after_writes is not None:
        out = ExitAfterBoxes(out, fault.exit_after_writes)
    return out, copies


class AlteredBaseline:
    """Fault injection: a refit's participant which, as the refit opens, adds 1 to the first
    element a delta of ``name`` would start from (``VllmSink.alter_baseline``; a name the
    worker does not hold is its "no" vote)."""

    def __init__(self, participant: Participant, sink: VllmSink, name: str) -> None:
        self.participant, self.sink, self.name = participant, sink, name

    def open(self, request: RefitRequest) -> bool:
        ready = self.participant.open(request)
        self.sink.alter_baseline(self.name)
        return ready

    def prepare(self) -> Prepared:
        return self.participant.prepare()

    def check(self, canary: Any) -> None:
        self.participant.check(canary)

    def commit(self) -> None:
        self.participant.commit()

    def abort(self, reason: str) -> None:
        self.participant.abort(reason)
