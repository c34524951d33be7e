"""The receiving side of a refit: write model-format pieces into a live vLLM model.

Two modes per local parameter, chosen by :func:`select_modes` and exposed as data:

* ``"direct"``: kernel format == model format (CUDA unquantized dense, Triton MoE, norms;
  on CPU only with the plain-linear mode); pieces are copied straight into the live tensor.
* ``"reload"``: vLLM's layerwise-reload lifecycle, driven piecewise on a **shadow** of the
  layer: at its first write a shallow copy of the module (its own parameter dicts and
  attributes, the live tensors untouched) is put back into model format
  (``restore_layer_on_meta`` + ``materialize_layer``), pieces are scattered into those tensors,
  and once every element arrived the shadow runs ``process_weights_after_loading`` (on CPU a
  new ``cpu_linear`` handle, the MoE prepack vLLM 0.32 forgets on reload). The commit copies
  the shadow's processed tensors into the live kernel tensors in place, as vLLM's
  ``_copy_and_restore_kernel_tensors`` does (storage addresses kept: CUDA graphs stay valid)
  -- or, on a CPU engine run eagerly, where nothing holds the storages, rebinds each live
  tensor to its shadow's storage (``rebind``: O(1) per tensor) -- and carries over the
  attributes processing set (kernel handles). Until then nothing a
  forward pass reads has changed, so a model step may run while a refit receives.

MLA (DeepSeek-V2/V3): the attention kernel does not read ``kv_b_proj`` but W_UK / W_UV that
``MLAAttention.process_weights_after_loading`` splits out of it after loading. ``kv_b_proj``
is therefore always a reload-mode parameter, and committing it re-runs that absorption (in
place, ``replace_parameter(prefer_copy=True)``), as vLLM's own reload does for deferred
attention layers in ``finalize_layerwise_processing``.

Atomicity: with ``atomic=True`` nothing live changes before :meth:`VllmApplier.finish` has
checked that every touched parameter is complete (direct parameters are staged, reload layers
live in their shadows); :meth:`abort` drops the staged copies and shadows and the old weights
keep serving. With ``atomic=False`` (streaming, no extra memory) completed layers are committed
as they complete; an abort or failure after a commit marks the applier ``not_serving``, and
its model steps raise :class:`RefitIncomplete` -- never a silent half-written model.
"""

from __future__ import annotations

import functools
import time

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ...errors import RefitIncomplete
from ...layout.descriptor import LayoutError, LocalParam, View
from ...transport.endpoint import Prepared
from ...transport.views import copy_unless_same, local_view, zero_padding
from ...wire.protocol import RefitRequest
from .baselines import ModelFormatCopies
from .layers import (DIRECT, MLA_NOTE, RELOAD, aliased, commit_shadow, guarded, mla_absorbers, open_shadow, owner,
                     plain_linear_enabled, process_shadow, reabsorb, reprepack_cpu_moe, select_modes, swap_into,
                     viewed_storages)

__all__ = ["VllmApplier", "RefitIncomplete", "select_modes", "plain_linear_enabled", "mla_absorbers", "DIRECT",
           "RELOAD", "MLA_NOTE", "reprepack_cpu_moe"]

@dataclass
class _LayerState:
    """Progress of one reload-mode module (the unit vLLM processes): the live module, and the
    shadow copy that receives and is processed until the commit."""

    layer: torch.nn.Module
    shadow: torch.nn.Module
    names: dict[str, str]  # param attribute -> local name
    processed: bool = False
    committed: bool = False


def _timed(phase: str):
    """Add a method's wall time to ``self.timings[phase]`` (a perf_counter pair per layer)."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                self.timings[phase] += time.perf_counter() - t0

        return inner

    return wrap


class VllmApplier:
    """Applies a refit's boxes to one worker's model: a small state machine per parameter --
    direct (into the live tensor), staged (a copy, swapped in at the commit) or shadow (a
    model-format copy of its module, processed by vLLM and swapped in).

    A refit drives it as its participant (``open``, ``prepare``, then ``commit`` or
    ``abort``: ``transport.endpoint.Participant``) and hands it every box through
    :attr:`sink` (``resolve``, then the box's ``commit``; ``baseline`` for deltas); a loader
    as ``begin()`` -> ``write(...)`` * n -> ``finish()``, ``abort()`` on failure. ``state`` is
    one of ``idle | updating | serving | not_serving``.
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[LocalParam], *,
                 modes: Mapping[str, str] | None = None, atomic: bool = False,
                 device: torch.device | str = "cpu", rebind: bool = False) -> None:
        self.model = model
        #: Commit by rebinding each live tensor's data to its shadow's (O(1) per tensor) instead
        #: of copying into it: only where nothing captured the live storages -- a CPU engine
        #: run eagerly (no CUDA graphs, no compiled graph holding the weights).
        self.rebind = rebind
        self.params = {p.name: p for p in params}
        #: Each parameter's owning module and attribute (looked up once: several calls per box).
        self._owners = {n: owner(model, n) for n in self.params}
        #: Each module's name (its first, as ``named_modules`` gives it), and the parameters
        #: named under each module name: attribute -> local name (one shadow takes them).
        self._prefix = {id(m): name for name, m in model.named_modules()}
        self._names_under: dict[str, dict[str, str]] = {}
        for n in self.params:
            prefix, _, attr = n.rpartition(".")
            self._names_under.setdefault(prefix, {})[attr] = n
        self.modes = dict(modes) if modes is not None else select_modes(model, params)
        self.atomic = atomic
        #: A refit opened this applier (``open``) and has not concluded; it is overlapped (its
        #: shadows are held while the engine serves).
        self._opened = self._overlap = False
        self.device = torch.device(device)
        self.state = "idle"
        self.reason = ""
        #: Why this worker could not learn a refit's decision (set by its engine until a refit
        #: commits here): its model steps are refused too, since its engine's other workers may
        #: hold the new weights (a caller without a pause, e.g. vLLM's trainer-side API).
        self.unsure = ""
        self._torn = False
        self._absorbers = mla_absorbers(model)
        self._viewed = viewed_storages(model)
        #: Delta refits: the model-format values of every reload-mode parameter as last
        #: committed (its live tensor is kernel format, so a delta cannot start from it). Kept
        #: only while refits ask for deltas (``copies.keep``).
        self.copies = ModelFormatCopies()
        self._reset()
        # The engine-level gate (a paused scheduler) keeps requests from reaching a torn
        # model; this is its backstop in the worker, for a caller that resumes by hand (a
        # server's /resume): a model step on torn weights raises instead of computing. On
        # every module that owns a parameter written here, not the top model: vLLM's
        # compile decorator calls the top model's ``forward`` directly, skipping its hooks.
        owners = {id(guarded(m)): guarded(m) for m, _ in self._owners.values()}
        self._gate = [m.register_forward_pre_hook(self._refuse_if_torn) for m in owners.values()]

    def _refuse_if_torn(self, module: torch.nn.Module, args: Any) -> None:
        if self.state == "not_serving":
            raise RefitIncomplete(f"model step refused: {self.reason}")
        if self.unsure:
            raise RefitIncomplete(f"model step refused: this worker does not know whether its engine's other "
                                  f"workers committed the last refit ({self.unsure[:300]})")

    def close(self) -> None:
        """Remove this applier's gate (a new applier takes over the model)."""
        for handle in self._gate:
            handle.remove()

    def inherit(self, old: "VllmApplier") -> None:
        """Take over ``old``'s model: torn weights stay torn until a whole refit commits."""
        if old.state == "not_serving":
            self.state, self.reason = old.state, old.reason
        self.copies, self.unsure = old.copies, old.unsure
        old.close()

    def _reset(self) -> None:
        #: Seconds spent per apply phase in the current refit (reported with the refit metrics).
        self.timings = {"open": 0.0, "process": 0.0, "commit": 0.0}
        self._written: dict[str, int] = {}
        self._layers: dict[int, _LayerState] = {}
        self._staged: dict[str, torch.Tensor] = {}  # atomic direct writes
        #: Delta refits: boxes left unchanged whose parameter has no staged copy or shadow yet
        #: -- none is made for them (a module a delta left alone is neither copied nor
        #: reprocessed); should another box of the parameter (direct) or of its module (reload)
        #: need one, they are copied in then.
        self._kept: dict[str, list[View]] = {}
        self._resolved: set[tuple[str, View]] = set()  # boxes handed out and not committed yet
        self.copies.begin()
        self._live_changed = False
        self._prepared = False

    # -- the refit's participant (``transport.endpoint.Participant``) ------------------------
    def open(self, request: RefitRequest) -> bool:
        """A refit starts: a refit that never reached its end here is dropped first. Returns
        whether every parameter can rebuild a box from what it holds (``delta_ready``)."""
        if self.state == "updating":
            self._fail("superseded by a new refit")
        self.begin()
        self._opened, self._overlap = True, request.overlap
        ready = self.delta_ready()
        self.copies.keep = request.delta != "off"
        return ready

    def prepare(self) -> Prepared:
        """Every byte arrived. Atomic: complete and processed in the shadows, nothing live
        changed (``stage``). Streaming: layers were committed as they completed; the rest now."""
        t0 = time.perf_counter()
        self.stage() if self.atomic else self.finish()
        phases = {f"apply_{k}": v for k, v in self.timings.items()} | {"apply_finish": time.perf_counter() - t0}
        return Prepared(phases, baseline_bytes=self.baseline_bytes(),
                        held_bytes=self.shadow_bytes() if self._overlap else 0)

    def commit(self) -> None:
        """Everyone staged and verified: swap in together (atomic; a streaming refit committed
        at ``prepare``)."""
        self._opened = False
        if self.atomic:
            self.finish()

    def abort(self, reason: str = "aborted") -> None:
        """Undo what was not committed; if live weights already changed (a streaming refit,
        here or one this worker finished and another rank failed), stop serving. Never
        raises: ``state`` and ``reason`` say what is left."""
        opened, self._opened = self._opened, False
        if self.state == "updating":
            self._fail(reason)
        elif opened:
            self.invalidate(reason)

    # -- lifecycle (a loader's: ``begin`` -> ``write`` * n -> ``finish``) -------------------
    def begin(self) -> None:
        if self.state == "updating":
            raise RuntimeError("refit already in progress; finish() or abort() it first")
        self._torn = self.state == "not_serving"  # only a whole refit's finish() heals it
        self._reset()
        self.state = "updating"

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        """A loader's write: ``tensor`` (shape == view.shape) into ``local_name`` at ``view``,
        through the same two calls a refit's boxes take."""
        self.resolve(local_name, view).copy_(tensor)
        self.commit_box(local_name, view)

    # -- the refit's sink (``transport.sink.Sink``, as ``self.sink``) ------------------------
    @property
    def sink(self) -> "_Boxes":
        """This applier as the refit's ``Sink``: ``resolve``, ``commit`` (of one box: this
        applier's own ``commit`` is the refit's) and ``baseline``."""
        return _Boxes(self)

    def resolve(self, local_name: str, view: View) -> torch.Tensor:
        """Where the box at ``view`` goes: the live tensor (direct, streaming), its staged copy
        (direct, atomic) or its module's model-format shadow (reload)."""
        lp = self._check(local_name, view, tuple(view.shape))
        self._resolved.add((local_name, view))
        return local_view(self._target(local_name, lp), view)

    def commit_box(self, local_name: str, view: View) -> None:
        """The box is in place: counted, and a layer it completes processed (streaming: also
        committed). A box never resolved in this refit was left unchanged by a delta: where
        its parameter already has a staged copy or shadow its values are copied in, else none
        is made for it (``_kept``)."""
        lp = self.params[local_name]
        if (local_name, view) in self._resolved:
            self._resolved.discard((local_name, view))
            self.copies.wrote_whole(local_name)
        else:
            self._check(local_name, view, tuple(view.shape))
            if not self._has_target(local_name):
                self._count(local_name, lp, math.prod(view.shape))
                self._kept.setdefault(local_name, []).append(view)
                return
            copy_unless_same(local_view(self._target(local_name, lp), view), self.baseline(local_name, view))
        self._placed(local_name, lp, math.prod(view.shape))

    def baseline(self, local_name: str, view: View) -> torch.Tensor:
        """What the engine serves at ``view`` now, in model format (a delta refit's baseline):
        the live tensor of a direct parameter, the last committed model-format copy of a
        reload-mode one."""
        self._check(local_name, view, tuple(view.shape))
        if self.modes[local_name] == DIRECT:
            layer, pname = self._owners[local_name]
            return local_view(getattr(layer, pname).data, view)
        base = self.copies.committed.get(local_name)
        if base is None:
            raise RefitIncomplete(f"{local_name}: no model-format baseline for a delta refit")
        return local_view(base, view)

    def _check(self, local_name: str, view: View, shape: tuple[int, ...]) -> LocalParam:
        if self.state != "updating":
            raise RuntimeError(f"write({local_name}) outside begin()/finish() (state {self.state})")
        lp = self.params.get(local_name)
        if lp is None:
            raise LayoutError(f"{local_name}: not a parameter of this worker")
        if shape != tuple(view.shape):
            raise LayoutError(f"{local_name}: tensor shape {shape} != view shape {view.shape}")
        if view.offset < 0 or (math.prod(view.shape) and view.extent()[1] > lp.numel):
            raise LayoutError(f"{local_name}: view {view} leaves the local tensor of {lp.numel} elements")
        return lp

    def _count(self, local_name: str, lp: LocalParam, n: int) -> None:
        done = self._written.get(local_name, 0) + n
        expected = lp.numel - lp.padding
        if done > expected:
            raise LayoutError(f"{local_name}: {done} elements written, only {expected} expected (overlapping writes?)")
        self._written[local_name] = done

    def _placed(self, local_name: str, lp: LocalParam, n: int) -> None:
        self._count(local_name, lp, n)
        if self.modes[local_name] == RELOAD:
            st = self._layers[id(self._owners[local_name][0])]
            if self._layer_complete(st):
                # Processed as soon as it is complete, while later buckets are on the wire;
                # atomic mode commits only after the vote (nothing live changes here).
                self._process(st)
                if not self.atomic:
                    self._commit(st)

    def stage(self) -> None:
        """Phase one of an atomic commit: check completeness and run vLLM's processing on the
        staged layers; nothing live changes (``abort`` still restores everything). A worker
        votes to commit only after this succeeded. Streaming mode: same as ``finish``'s checks."""
        if self.state != "updating":
            raise RuntimeError(f"stage() without begin() (state {self.state})")
        if self._prepared:
            return
        try:
            self._check_complete()
            for name in self._written:
                if self.modes[name] == DIRECT and self.params[name].padding and self._has_target(name):
                    zero_padding(self._target(name, self.params[name]), self.params[name])
            if self.atomic:
                for st in self._layers.values():
                    if not st.processed:
                        self._process(st)
        except BaseException as exc:
            self._fail(f"staging failed: {exc}")
            raise
        self._prepared = True

    def finish(self) -> None:
        """Check completeness, commit what is pending, and go back to serving."""
        if self.state != "updating":
            raise RuntimeError(f"finish() without begin() (state {self.state})")
        self.stage()
        try:
            if self.atomic:
                for name, staged in self._staged.items():
                    layer, pname = self._owners[name]
                    self._live_changed = True
                    swap_into(getattr(layer, pname), staged, self.rebind and not aliased(layer, pname))
                for st in self._layers.values():
                    self._commit(st)
        except BaseException as exc:
            self._fail(f"finish() failed: {exc}")
            raise
        self._staged.clear()
        self.copies.commit()
        self._kept = {}
        self.state, self.reason = "serving", ""  # an earlier failure's text is not this worker's state

    def invalidate(self, reason: str) -> None:
        """A refit this worker finished (streaming) was aborted by another rank: if it changed
        live weights, the engine now mixes two models, so this worker stops serving."""
        if self._live_changed:
            self.state = "not_serving"
            self.reason = f"refit {reason}; this worker had already committed new weights"

    def shadow_bytes(self) -> int:
        """Bytes held beside the live weights until the commit: staged direct parameters and
        the reload layers' shadow tensors."""
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        staged = sum(t.numel() * t.element_size() for t in self._staged.values())
        shadows = sum(t.numel() * t.element_size() for st in self._layers.values() if not st.committed
                      for name, t in get_layer_tensors(st.shadow).items()
                      if getattr(st.layer, name, None) is not t)
        return staged + shadows

    def check_serving(self) -> None:
        if self.state == "not_serving":
            raise RefitIncomplete(self.reason)

    # -- internals ---------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        # Uncommitted layers changed only their shadows: dropping them is the whole undo.
        self._layers = {k: st for k, st in self._layers.items() if st.committed}
        self._staged.clear()
        self._kept = {}
        self.copies.drop(self._live_changed)  # committed layers changed without their copies: start over
        if self._live_changed:
            self.state = "not_serving"
            self.reason = (f"refit {reason} after live weights were partly replaced; "
                           "this engine must not serve until a complete refit succeeds")
        elif self._torn:
            self.state = "not_serving"
            self.reason = f"refit {reason}; the weights were already torn by an earlier refit"
        else:  # every caller runs while "updating"; a torn model is ``_torn`` above
            self.state = "serving"
            self.reason = reason

    def _has_target(self, local_name: str) -> bool:
        """Whether writes to ``local_name`` already have their tensor: the live one (direct,
        streaming), its staged copy (direct, atomic) or its module's shadow (reload)."""
        if self.modes[local_name] == DIRECT:
            return not self.atomic or local_name in self._staged
        return id(self._owners[local_name][0]) in self._layers

    def _copy_kept(self, names: Sequence[str]) -> None:
        """The kept boxes of ``names`` into their staged copy or shadow, just made."""
        for name in names:
            views = self._kept.pop(name, ())
            if views:
                target = self._target(name, self.params[name])
                for view in views:
                    local_view(target, view).copy_(self.baseline(name, view))

    def delta_ready(self) -> bool:
        """Whether every parameter can rebuild a box from what it holds (``baseline``): the
        reload-mode ones need a model-format copy from a committed refit."""
        return self.copies.keep and not self._torn and self.state != "not_serving" and all(
            n in self.copies.committed for n, m in self.modes.items() if m == RELOAD)

    def alter_baseline(self, local_name: str) -> None:
        """Fault injection (tests): add 1 to the first element a delta of ``local_name``
        would start from -- its live tensor, or its model-format copy."""
        if local_name not in self.modes:
            raise LayoutError(f"alter_baseline: {local_name} is not a parameter of this worker")
        if self.modes[local_name] == DIRECT:
            layer, pname = self._owners[local_name]
            getattr(layer, pname).data.view(-1)[0] += 1
        elif local_name in self.copies.committed:
            self.copies.committed[local_name].view(-1)[0] += 1

    def forget_baselines(self) -> None:
        """The weights changed outside a refit: no model-format copy is current any more."""
        self.copies.committed.clear()

    def baseline_bytes(self) -> int:
        """Bytes of model-format copies kept for delta refits (``delta_state_bytes``)."""
        return self.copies.nbytes

    def _target(self, local_name: str, lp: LocalParam) -> torch.Tensor:
        """The model-format tensor that receives writes for ``local_name``."""
        layer, pname = self._owners[local_name]
        if self.modes[local_name] == DIRECT:
            live = getattr(layer, pname).data
            if not self.atomic:
                self._live_changed = True
                return live
            if local_name not in self._staged:
                # Every element is written before the commit (``_check_complete``; padding is
                # zeroed in ``prepare``), so the staged copy starts empty, not as a clone.
                self._staged[local_name] = torch.empty_like(live)
                self._copy_kept([local_name])
            return self._staged[local_name]
        st = self._layers.get(id(layer))
        if st is None:
            st = self._open_layer(layer)
            self._copy_kept(list(st.names.values()))
        return getattr(st.shadow, pname).data

    @_timed("open")
    def _open_layer(self, layer: torch.nn.Module) -> _LayerState:
        """A shadow of ``layer`` in (zeroed) model format; the live layer is not touched."""
        prefix = self._prefix[id(layer)]
        shadow, names = open_shadow(layer, prefix, self._names_under.get(prefix, {}), self.params, self.modes,
                                    self.device)
        st = self._layers[id(layer)] = _LayerState(layer, shadow, names)
        return st

    def _layer_complete(self, st: _LayerState) -> bool:
        return all(self._written.get(n, 0) == self.params[n].numel - self.params[n].padding
                   for n in st.names.values())

    def _check_complete(self) -> None:
        want = {n: lp.numel - lp.padding for n, lp in self.params.items()}
        touched = dict.fromkeys(n for st in self._layers.values() for n in st.names.values())
        touched.update(dict.fromkeys(self._staged))
        if not self.atomic:
            touched.update(dict.fromkeys(n for n in self._written if self.modes[n] == DIRECT))
        for n in self._kept:  # kept boxes only: the whole module (reload) or parameter was sent
            touched.update(dict.fromkeys((n, *(self._module_params(n) if self.modes[n] == RELOAD else ()))))
        missing = [(n, self._written.get(n, 0), want[n]) for n in touched if self._written.get(n, 0) != want[n]]
        if missing:
            desc = ", ".join(f"{n} ({w}/{e} elements)" for n, w, e in missing[:5])
            raise LayoutError(f"refit incomplete: touched parameters not fully written: {desc}")

    def _module_params(self, local_name: str) -> list[str]:
        """The reload-mode parameters of ``local_name``'s module (one shadow, one processing)."""
        names = self._names_under.get(self._prefix[id(self._owners[local_name][0])], {})
        return [n for n in names.values() if self.modes[n] == RELOAD]

    @_timed("process")
    def _process(self, st: _LayerState) -> None:
        """vLLM's per-layer processing, on the shadow's model-format tensors."""
        st.processed = True
        self.copies.before_processing({local: getattr(st.shadow, attr).data for attr, local in st.names.items()})
        process_shadow(st.shadow, self.device)

    @_timed("commit")
    def _commit(self, st: _LayerState) -> None:
        """The shadow's processed tensors into the live layer (``commit_shadow``), then MLA's
        absorbed weights rebuilt from the new ``kv_b_proj``."""
        self._live_changed = True
        commit_shadow(st.layer, st.shadow, set(st.names), self.rebind, self._viewed)
        st.committed = True
        st.shadow = st.layer  # the shadow's tensors are released with it
        with self.device:
            for attn in self._absorbers.get(id(st.layer), ()):
                reabsorb(attn)


class _Boxes:
    """A ``VllmApplier`` as a refit's ``Sink``: its box calls under the sink's names (the
    applier's own ``commit`` concludes the refit)."""

    __slots__ = ("resolve", "commit", "baseline", "params")

    def __init__(self, applier: VllmApplier) -> None:
        self.resolve, self.commit, self.baseline = applier.resolve, applier.commit_box, applier.baseline
        self.params = applier.params  # the executor reads the wire dtype from here
