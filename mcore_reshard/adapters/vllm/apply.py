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

import contextlib
import time
from typing import Callable, Sequence, Mapping

import torch

from ...errors import RefitIncomplete
from ...layout.descriptor import LocalParam, View
from ...transport.participant import Prepared
from ...wire.protocol import Canary, RefitRequest
from .canary import CanaryFailed
from .gate import ForwardGate, Serving
from .layers import DIRECT, MLA_NOTE, RELOAD, ParamTable, mla_absorbers, plain_linear_enabled, reprepack_cpu_moe, select_modes
from .shadows import Shadows
from .sinks import VllmSink

__all__ = ["VllmApplier", "VllmSink", "RefitIncomplete", "select_modes", "plain_linear_enabled", "mla_absorbers",
           "DIRECT", "RELOAD", "MLA_NOTE", "reprepack_cpu_moe"]


class VllmApplier:
    """The refit's participant on one vLLM worker (``transport.participant.Participant``): its
    lifecycle -- ``open``, ``prepare``, then ``commit`` or ``abort`` -- over a small state
    machine per parameter: direct (into the live tensor), staged (a copy, swapped in at the
    commit) or shadow (a model-format copy of its module, processed by vLLM and swapped in).

    Its parts: ``shadows`` (the staged copies and layer shadows, ``shadows.py``), ``gate`` (the
    forward hooks that refuse a model step on torn weights, ``gate.py``) and ``sink`` (where
    each box goes, holding the delta baselines: ``sinks.VllmSink``, the refit's
    ``transport.sink.Sink``). A loader drives it as ``begin()`` -> ``write(...)`` * n ->
    ``finish()``, ``abort()`` on failure. ``state`` is one of ``idle | updating | serving |
    not_serving``.
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[LocalParam], *,
                 modes: Mapping[str, str] | None = None, atomic: bool = False,
                 device: torch.device | str = "cpu", rebind: bool = False,
                 probe: Callable[..., None] | None = None) -> None:
        self.model = model
        self.table = ParamTable.of(model, params, modes)
        self.params, self.modes = self.table.params, self.table.modes
        self.atomic = atomic
        self.device = torch.device(device)
        #: Commit by rebinding each live tensor's data to its shadow's (O(1) per tensor) instead
        #: of copying into it: only where nothing captured the live storages -- a CPU engine
        #: run eagerly (no CUDA graphs, no compiled graph holding the weights).
        self.rebind = rebind
        self.serving = Serving()
        self.shadows = Shadows(self.table, atomic, self.device, rebind)
        self.sink = VllmSink(self.table, self.shadows, self.serving)
        self.gate = ForwardGate(self.table.guarded(), self.serving)
        #: A refit opened this applier (``open``) and has not concluded; it is overlapped (its
        #: shadows are held while the engine serves).
        self._opened = self._overlap = False
        #: The weights were torn when this refit began: only a whole refit's ``finish`` heals them.
        self._torn = False
        self._prepared = False
        #: The canary's forward on this worker (``canary.py``): ``probe(canary, every)`` raises
        #: when the engine's logprobs on the weights a forward now reads fail the canary (on the
        #: engine's first worker, or on ``every`` one); ``probe(None)`` only says whether this
        #: engine can run one (raises why not). None: it cannot.
        self.probe = probe
        self._canary: Canary | None = None

    # -- what the worker serves (``gate.Serving``, shared with the gate and the sink) ------------
    @property
    def state(self) -> str:
        return self.serving.state

    @property
    def reason(self) -> str:
        return self.serving.reason

    @property
    def unsure(self) -> str:
        """Why this worker could not learn a refit's decision (set by its engine until a refit
        commits here): its model steps are refused too, since its engine's other workers may
        hold the new weights (a caller without a pause, e.g. vLLM's trainer-side API)."""
        return self.serving.unsure

    @unsure.setter
    def unsure(self, why: str) -> None:
        self.serving.unsure = why

    def _serve(self, state: str, reason: str) -> None:
        self.serving.state, self.serving.reason = state, reason

    def close(self) -> None:
        """Remove this applier's gate (a new applier takes over the model)."""
        self.gate.close()

    def inherit(self, old: "VllmApplier") -> None:
        """Take over ``old``'s model: torn weights stay torn until a whole refit commits."""
        if old.state == "not_serving":
            self._serve(old.state, old.reason)
        self.sink.baselines, self.unsure = old.sink.baselines, old.unsure
        old.close()

    def check_serving(self) -> None:
        if self.state == "not_serving":
            raise RefitIncomplete(self.reason)

    # -- the refit's participant (``transport.participant.Participant``) ------------------------
    def open(self, request: RefitRequest) -> bool:
        """A refit starts: a refit that never reached its end here is dropped first. Returns
        whether every parameter can rebuild a box from what it holds (``delta_ready``)."""
        if self.state == "updating":
            self._fail("superseded by a new refit")
        self.begin()
        self._opened, self._overlap = True, request.overlap
        self._canary = request.canary
        if self._canary is not None:  # an engine that cannot run it refuses before a byte moves
            if self.probe is None:
                raise CanaryFailed("refit.canary: this worker has no canary forward")
            self.probe(None)
        ready = self.delta_ready()
        self.sink.keep_baselines(request.delta != "off")
        return ready

    def prepare(self) -> Prepared:
        """Every byte arrived. Atomic: complete and processed in the shadows, nothing live
        changed (``stage``). Streaming: layers were committed as they completed; the rest now."""
        t0 = time.perf_counter()
        self.stage() if self.atomic else self.finish()
        phases = {f"apply_{k}": v for k, v in self.shadows.timings.items()} | {"apply_finish": time.perf_counter() - t0}
        return Prepared(phases, baseline_bytes=self.sink.baseline_bytes(),
                        held_bytes=self.shadows.nbytes() if self._overlap else 0)

    def check(self, canary: Canary) -> None:
        """The canary vote, after ``prepare`` (``canary`` complete: a deferred one's reference
        arrived from the trainers). A blocking refit runs it now: the engine's forward on what
        it would serve -- the staged weights (atomic: the live ones are untouched, and kept for
        the rollback), or the live ones a streaming refit already wrote -- against the trainers'
        logprobs; raises (this worker's "no") when it fails. An overlapped refit keeps it for
        its swap (:meth:`commit`): the engine serves the old weights until then."""
        self._canary = canary
        if not self._overlap:
            self._run_canary(canary)

    def _run_canary(self, canary: Canary, every: bool = False) -> None:
        with self.shadows.trial() if self.atomic else contextlib.nullcontext():
            self.probe(canary, every)

    def commit(self) -> None:
        """Everyone staged and verified: swap in together (atomic; a streaming refit committed
        at ``prepare``). An overlapped refit's canary runs here, on the shadows, before the
        swap (the engine is paused for it), on every worker: when it fails nothing is swapped
        in, the old weights stay whole, and this raises (the engine serves the old weights; one
        whose workers disagree is gated by the driver's confirmation)."""
        self._opened = False
        if self.atomic and self._overlap and self._canary is not None and self.state == "updating":
            try:
                if self._canary.deferred:  # never completed: no rank should have voted yes
                    raise CanaryFailed("the canary's reference never arrived from the trainers")
                self._run_canary(self._canary, every=True)
            except BaseException as exc:
                self._fail(f"canary failed: {exc}")
                raise
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

    def delta_ready(self) -> bool:
        """Whether every parameter can rebuild a box from what it holds (the sink's
        ``baseline``): not on torn weights, and the reload-mode ones need a model-format copy
        from a committed refit."""
        return not self._torn and self.state != "not_serving" and self.sink.baselines_ready()

    # -- lifecycle (a loader's: ``begin`` -> ``write`` * n -> ``finish``) -------------------
    def begin(self) -> None:
        if self.state == "updating":
            raise RuntimeError("refit already in progress; finish() or abort() it first")
        self._torn = self.state == "not_serving"  # only a whole refit's finish() heals it
        self.shadows.reset()
        self.sink.begin()
        self._prepared = False
        self.serving.state = "updating"

    def write(self, local_name: str, view: View, tensor: torch.Tensor) -> None:
        """A loader's write: ``tensor`` (shape == view.shape) into ``local_name`` at ``view``,
        through the same two calls a refit's boxes take."""
        self.sink.resolve(local_name, view).copy_(tensor)
        self.sink.commit_box(local_name, view)

    def stage(self) -> None:
        """Phase one of an atomic commit: check completeness and run vLLM's processing on the
        staged layers; nothing live changes (``abort`` still restores everything). A worker
        votes to commit only after this succeeded. Streaming mode: same as ``finish``'s checks."""
        if self.state != "updating":
            raise RuntimeError(f"stage() without begin() (state {self.state})")
        if self._prepared:
            return
        try:
            self.sink.check_complete()
            if self.atomic:
                self.sink.process_rest()
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
                self.shadows.swap_in()
            else:  # only what is held in another dtype than it arrives in is staged (``Shadows.widened``)
                self.shadows.swap_staged()
        except BaseException as exc:
            self._fail(f"finish() failed: {exc}")
            raise
        self.sink.refit_committed()
        self._serve("serving", "")  # an earlier failure's text is not this worker's state

    def invalidate(self, reason: str) -> None:
        """A refit this worker finished (streaming) was aborted by another rank: if it changed
        live weights, the engine now mixes two models, so this worker stops serving."""
        if self.shadows.live_changed:
            self._serve("not_serving", f"refit {reason}; this worker had already committed new weights")

    def _fail(self, reason: str) -> None:
        live_changed = self.shadows.live_changed
        self.shadows.drop()
        self.sink.refit_dropped(live_changed)  # committed layers changed without their copies: start over
        if live_changed:
            self._serve("not_serving", f"refit {reason} after live weights were partly replaced; "
                                       "this engine must not serve until a complete refit succeeds")
        elif self._torn:
            self._serve("not_serving", f"refit {reason}; the weights were already torn by an earlier refit")
        else:  # every caller runs while "updating"; a torn model is ``_torn`` above
            self._serve("serving", reason)
