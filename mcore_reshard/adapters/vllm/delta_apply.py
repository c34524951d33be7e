"""How a delta refit's boxes apply on a vLLM worker: the delta half of ``VllmApplier``'s sink.

A delta box is unchanged (``keep``) or changed at some positions (``patch``); both start from
what the worker serves now (``current``): the live tensor of a direct parameter, the committed
model-format copy of one vLLM repacks (``baselines.ModelFormatCopies``). An unchanged box gets
no staged copy or shadow of its own: it is counted and hashed where it lies, and copied in only
if another box of its parameter or module needs one (``_kept``). Mixed into ``VllmApplier``,
whose state (``modes``, ``params``, ``copies``, ``atomic``, the refit's staged copies, shadows
and written counts) these methods share.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ...errors import RefitIncomplete
from ...layout.descriptor import LayoutError, View
from ...transport.views import local_view, scatter_flat
from .layers import DIRECT, RELOAD

__all__ = ["DeltaApply"]


class DeltaApply:
    """``current``, ``keep`` and ``patch`` (the ``Sink`` methods of a delta refit), whether a
    worker can take a delta (``delta_ready``), and its baselines' upkeep."""

    def current(self, local_name: str, view: View) -> torch.Tensor:
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

    def keep(self, local_name: str, view: View, hash_fn: Callable[[torch.Tensor], Any] | None) -> Any:
        """A delta left this box unchanged: counted as a write, and ``hash_fn`` of the current
        values. Where the parameter already has a staged copy or shadow, they are copied into
        it; else none is made for this box (``_kept``)."""
        lp = self._check(local_name, view, tuple(view.shape))
        if self._has_target(local_name):
            return self.patch(local_name, view, None, None, hash_fn)
        self._count(local_name, lp, math.prod(view.shape))
        self._kept.setdefault(local_name, []).append(view)
        return hash_fn(self.current(local_name, view)) if hash_fn is not None else None

    def patch(self, local_name: str, view: View, positions: torch.Tensor | None, values: torch.Tensor | None,
              hash_fn: Callable[[torch.Tensor], Any] | None) -> Any:
        """A delta changed ``values`` at box-flat ``positions`` of this box: the staged copy or
        shadow takes the current values and those changes; counted and hashed as a write."""
        lp = self._check(local_name, view, tuple(view.shape))
        dst = local_view(self._target(local_name, lp), view)
        cur = self.current(local_name, view)
        if dst.data_ptr() != cur.data_ptr() or dst.stride() != cur.stride():
            dst.copy_(cur)
        if positions is not None:
            positions, values = positions.to(dst.device), values.to(dst.device)
            scatter_flat(dst, positions, values)
            if self.modes[local_name] == RELOAD:
                self.copies.patched(local_name, view, positions, values)
        return self._landed(local_name, lp, dst, hash_fn)

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
                    local_view(target, view).copy_(self.current(name, view))

    def delta_ready(self) -> bool:
        """Whether every parameter can rebuild a box from what it holds (``current``): the
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
