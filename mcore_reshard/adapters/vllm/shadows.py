"""What a refit writes into beside the live weights, until its commit swaps it in.

Per local parameter, by its mode (``layers.select_modes``):

* direct, atomic: a **staged copy** of the live tensor, swapped in at the commit;
* direct, streaming: the live tensor itself (nothing held; the live weights change at once);
* reload: the **shadow** of its module -- a shallow copy put back into model format
  (``layers.open_shadow``), processed by vLLM once complete (``process_shadow``), then its
  processed tensors swapped into the live layer (``commit_shadow``) and MLA's absorbed weights
  rebuilt (``reabsorb``).

:class:`Shadows` holds them for the refit's participant (``apply.VllmApplier``), which decides
when they are swapped in or dropped; the sink (``sinks.VllmSink``) writes into them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from ...transport.views import TORCH_DTYPES
from .layers import (DIRECT, ParamTable, aliased, carried, commit_shadow, mla_absorbers, open_shadow, process_dependent,
                     process_shadow, reabsorb, swap_into, tied_dependents, viewed_storages)

__all__ = ["Shadows", "LayerShadow"]


def _point(param: torch.Tensor, data: torch.Tensor) -> Callable[[], None]:
    """Point ``param``'s data at ``data`` (the object stays, so whatever holds it reads the new
    values); returns what points it back."""
    old = param.data
    param.data = data
    return lambda: setattr(param, "data", old)


def _saved(module: torch.nn.Module) -> Callable[[], None]:
    """What puts ``module``'s parameter, buffer and attribute entries back as they are now."""
    state = (dict(module._parameters), dict(module._buffers), dict(module.__dict__))

    def back() -> None:
        for now, then in zip((module._parameters, module._buffers, module.__dict__), state):
            now.clear()
            now.update(then)

    return back


@dataclass
class LayerShadow:
    """Progress of one reload-mode module (the unit vLLM processes): the live module, and the
    shadow copy that receives and is processed until the commit."""

    layer: torch.nn.Module
    shadow: torch.nn.Module
    names: dict[str, str]  # param attribute -> local name
    processed: bool = False
    committed: bool = False
    #: Modules with kernel state of their own over this layer's parameters (a tied LM head,
    #: ``layers.tied_dependents``), each with its shadow processed from the new values.
    dependents: list[tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=list)


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


class Shadows:
    """One refit's staged copies and layer shadows on one worker (see the module docstring).

    ``atomic``: direct parameters are staged (else written live); ``rebind``: a commit rebinds
    each live tensor to its shadow's storage (O(1)) instead of copying into it, only where
    nothing captured the live storages (a CPU engine run eagerly). ``timings``: seconds per
    phase (open, process, commit) of the refit under way; ``live_changed``: whether it changed
    what the engine serves yet (a streaming write, a committed layer or a swapped copy)."""

    def __init__(self, table: ParamTable, atomic: bool, device: torch.device, rebind: bool) -> None:
        self.table, self.atomic, self.device, self.rebind = table, atomic, device, rebind
        self._absorbers = mla_absorbers(table.model)
        self._viewed = viewed_storages(table.model)
        self._tied = tied_dependents(table.model)
        #: Fault injection (``EngineFault.skip_processing``, tests only): the layers holding these
        #: local parameters are not processed after loading -- their kernel state stays stale.
        self.skip_processing: frozenset[str] = frozenset()
        #: Fault injection (``EngineFault.skip_absorption``, tests only): MLA's absorbed weights
        #: are not rebuilt from a refit's ``kv_b_proj`` (stale state only decoding reads).
        self.skip_absorption = False
        self.reset()

    def reset(self) -> None:
        """A new refit: nothing held (a failed refit's shadows are dropped with it)."""
        self.timings = {"open": 0.0, "process": 0.0, "commit": 0.0}
        self.staged: dict[str, torch.Tensor] = {}
        self.layers: dict[int, LayerShadow] = {}
        self.live_changed = False

    def holds(self, name: str) -> bool:
        """Whether writes to ``name`` already have their tensor: the live one (direct,
        streaming), its staged copy (direct, atomic, or held in another dtype) or its module's
        shadow (reload)."""
        if self.table.modes[name] == DIRECT:
            return (not self.atomic and not self.widened(name)) or name in self.staged
        return id(self.table.owners[name][0]) in self.layers

    def widened(self, name: str) -> bool:
        """Whether the live tensor of direct parameter ``name`` is held in another dtype than
        its model format (``record._model_dtype``: vLLM's CPU AMX GEMM widens a bf16 bias to
        fp32 in place): written into a staged copy in model format, copied into the live one
        (converted) at the commit, in either mode."""
        return self.table.live(name).dtype != TORCH_DTYPES[self.table.params[name].dtype]

    def target(self, name: str) -> torch.Tensor:
        """The model-format tensor that receives writes for ``name``, made at its first write."""
        layer, pname = self.table.owners[name]
        if self.table.modes[name] == DIRECT:
            live = getattr(layer, pname).data
            widened = self.widened(name)
            if not self.atomic and not widened:
                self.live_changed = True
                return live
            if name not in self.staged:
                # Every element is written before the commit (the sink's ``check_complete``;
                # padding is zeroed at ``prepare``), so the staged copy starts empty, not as a clone.
                self.staged[name] = torch.empty(live.shape, dtype=TORCH_DTYPES[self.table.params[name].dtype],
                                                device=live.device) if widened else torch.empty_like(live)
            return self.staged[name]
        st = self.layers.get(id(layer))
        if st is None:
            st = self._open(layer)
        return getattr(st.shadow, pname).data

    def made_with(self, name: str) -> tuple[str, ...]:
        """The parameters whose tensors ``target(name)`` made: ``name`` alone (a staged copy),
        or every parameter its module's shadow takes."""
        if self.table.modes[name] == DIRECT:
            return (name,)
        return tuple(self.layer_of(name).names.values())

    def layer_of(self, name: str) -> LayerShadow:
        """The shadow of reload-mode parameter ``name``'s module (opened)."""
        return self.layers[id(self.table.owners[name][0])]

    def unprocessed(self) -> list[LayerShadow]:
        return [st for st in self.layers.values() if not st.processed]

    def touched(self) -> Iterator[str]:
        """Every parameter that has a staged copy or a shadow in this refit."""
        yield from (n for st in self.layers.values() for n in st.names.values())
        yield from self.staged

    @_timed("open")
    def _open(self, layer: torch.nn.Module) -> LayerShadow:
        """A shadow of ``layer`` in (zeroed) model format; the live layer is not touched."""
        t = self.table
        prefix = t.prefix[id(layer)]
        shadow, names = open_shadow(layer, prefix, t.names_under.get(prefix, {}), t.params, t.modes, self.device)
        st = self.layers[id(layer)] = LayerShadow(layer, shadow, names)
        return st

    @_timed("process")
    def process(self, st: LayerShadow, before: Callable[[Mapping[str, torch.Tensor]], None]) -> None:
        """vLLM's per-layer processing, on the shadow's model-format tensors; ``before`` sees
        them (by local name) just before vLLM repacks them (the sink's delta baselines)."""
        st.processed = True
        before({local: getattr(st.shadow, attr).data for attr, local in st.names.items()})
        if self.skip_processing.isdisjoint(st.names.values()):
            process_shadow(st.shadow, self.device)
            st.dependents = [(d, process_dependent(d, st.layer, st.shadow, self.device))
                             for d in self._tied.get(id(st.layer), ())]

    @_timed("commit")
    def commit_layer(self, st: LayerShadow) -> None:
        """The shadow's processed tensors into the live layer (``commit_shadow``), then MLA's
        absorbed weights rebuilt from the new ``kv_b_proj``."""
        self.live_changed = True
        commit_shadow(st.layer, st.shadow, set(st.names), self.rebind, self._viewed)
        for dependent, shadow in st.dependents:  # the tied head's kernel state, rebuilt from the new values
            commit_shadow(dependent, shadow, set(), self.rebind, self._viewed)
        st.dependents = []
        st.committed = True
        st.shadow = st.layer  # the shadow's tensors are released with it
        if self.absorbs(st):
            with self.device:
                for attn in self._absorbers.get(id(st.layer), ()):
                    reabsorb(attn)

    def swap_in(self) -> None:
        """The refit's commit (atomic): every staged copy into its live tensor, every shadow
        into its layer. Raises where a swap fails (the participant then stops serving)."""
        self.swap_staged()
        for st in self.layers.values():
            self.commit_layer(st)

    def swap_staged(self) -> None:
        """Every staged copy into its live tensor (a widened one converted into it, its dtype
        kept: what vLLM's kernel reads): the whole commit of direct parameters, atomic; in a
        streaming refit, of the widened ones, which alone are staged."""
        for name, staged in self.staged.items():
            layer, pname = self.table.owners[name]
            live = getattr(layer, pname)
            self.live_changed = True
            if staged.dtype != live.dtype:
                live.data.copy_(staged)
            else:
                swap_into(live, staged, self.rebind and not aliased(layer, pname))
        self.staged.clear()

    @contextlib.contextmanager
    def trial(self) -> Iterator[None]:
        """While inside, a forward of the live model reads what this refit holds (the canary's
        view of the new weights), and the live tensors are untouched: each staged parameter's
        ``data`` points at its staged copy, each processed shadow's tensors and kernel handles
        stand in its live layer (the same module objects, so vLLM's forward context still
        finds them, and the same Parameter objects, their data the shadow's: a module built
        around another's parameter -- vLLM's DeepSeek router holds the gate's
        ``e_score_correction_bias`` -- reads the new values too); on the way out everything live
        is put back as it was. Only where no model step runs meanwhile (the engine paused, the
        worker inside a refit call)."""
        undo: list[Callable[[], None]] = []
        try:
            for name, staged in self.staged.items():
                layer, pname = self.table.owners[name]
                live = getattr(layer, pname)
                undo.append(_point(live, staged if staged.dtype == live.dtype else staged.to(live.dtype)))
            pairs = [(st.layer, st.shadow) for st in self.layers.values() if not st.committed]
            pairs += [pair for st in self.layers.values() if not st.committed for pair in st.dependents]
            for live, shadow in pairs:
                back = _saved(live)
                for k, v in shadow._parameters.items():
                    cur = live._parameters.get(k)
                    if v is None or cur is v:
                        continue
                    if cur is None:
                        live._parameters[k] = v  # put back with the rest of the module's state
                        continue
                    # The live Parameter object stays, its data is the shadow's: modules built
                    # around it hold the object itself (vLLM's DeepSeek router holds the gate's
                    # ``e_score_correction_bias``), and must read the new values through it.
                    undo.append(_point(cur, v.data))
                live._buffers.update({k: v for k, v in shadow._buffers.items() if v is not None})
                live.__dict__.update({k: v for k, v in shadow.__dict__.items() if carried(k)})
                undo.append(back)
            for st in self.layers.values():
                if not st.committed and self.absorbs(st):
                    for attn in self._absorbers.get(id(st.layer), ()):
                        undo.append(self._trial_absorb(attn))
            yield
        finally:
            for fn in reversed(undo):
                fn()

    def absorbs(self, st: LayerShadow) -> bool:
        """Whether MLA's absorbed weights are rebuilt from this layer (fault injection:
        ``skip_absorption``, tests only, leaves them stale -- state only decoding reads)."""
        return not (self.skip_absorption and self._absorbers.get(id(st.layer)))

    def _trial_absorb(self, attn: torch.nn.Module) -> Callable[[], None]:
        """MLA's absorbed ``W_UK``/``W_UV`` of ``attn`` rebuilt from the ``kv_b_proj`` the trial
        view shows, into fresh tensors (vLLM copies into the existing ones: those are the live
        weights, kept for the rollback). Returns what puts the live ones back. Holds one layer's
        absorbed weights beside the live ones while the view lasts."""
        back = _saved(attn)
        live = [_point(q, torch.empty_like(q.data)) for q in attn._parameters.values() if q is not None]

        def undo() -> None:
            back()
            for fn in live:
                fn()

        try:
            with self.device:
                reabsorb(attn)
        except BaseException:
            undo()  # the live absorbed weights, not the empty ones, if the rebuild fails
            raise
        return undo

    def drop(self) -> None:
        """The refit failed: uncommitted layers changed only their shadows, and staged copies
        nothing live, so dropping them is the whole undo."""
        self.layers = {k: st for k, st in self.layers.items() if st.committed}
        self.staged.clear()

    def nbytes(self) -> int:
        """Bytes held beside the live weights until the commit: staged direct parameters and
        the reload layers' shadow tensors."""
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        staged = sum(t.numel() * t.element_size() for t in self.staged.values())
        shadows = sum(t.numel() * t.element_size() for st in self.layers.values() if not st.committed
                      for name, t in get_layer_tensors(st.shadow).items()
                      if getattr(st.layer, name, None) is not t)
        return staged + shadows
