"""The model-format values a vLLM worker keeps for delta refits.

A delta's box is rebuilt from what the worker holds now. For a parameter vLLM repacks after
loading (``reload`` mode) the live tensor is kernel format, so the worker keeps its model-format
values as last committed -- the copy a delta starts from (``sinks.VllmSink.baseline``: the
sink holds these copies). The copy changes only at a commit: a parameter written whole takes a
clone of its shadow just before vLLM repacks it; one a delta only patched takes the same
changes, O(changed), instead of a clone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...layout.descriptor import View
from ...transport.views import local_view, scatter_flat

__all__ = ["ModelFormatCopies"]


@dataclass
class ModelFormatCopies:
    """Per local parameter name: the committed model-format copy, and what the refit under way
    will make of it. ``keep``: refits ask for deltas (else nothing is kept)."""

    keep: bool = False
    committed: dict[str, torch.Tensor] = field(default_factory=dict)
    _clones: dict[str, torch.Tensor] = field(default_factory=dict)
    _patches: dict[str, list[tuple[View, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    _whole: set[str] = field(default_factory=set)

    def begin(self) -> None:
        self._clones, self._patches, self._whole = {}, {}, set()

    def wrote_whole(self, name: str) -> None:
        """A box of ``name`` arrived whole (not a delta's changes): its copy will be a clone."""
        self._whole.add(name)

    def patched(self, name: str, view: View, positions: torch.Tensor, values: torch.Tensor) -> None:
        """A delta changed ``values`` at ``positions`` of ``name``'s box at ``view`` (``values``
        may be a slice of a receive buffer: copied)."""
        if self.keep:
            self._patches.setdefault(name, []).append((view, positions, values.clone()))

    def before_processing(self, tensors: dict[str, torch.Tensor]) -> None:
        """A layer's model-format tensors (by local name), complete, about to be repacked."""
        if self.keep:
            for name, t in tensors.items():
                if name in self._whole or name not in self.committed:
                    self._clones[name] = t.clone()

    def commit(self) -> None:
        """The refit committed: the copies are what the engine now serves."""
        if self.keep:
            for name, patches in self._patches.items():
                if name not in self._clones:
                    for view, positions, values in patches:
                        scatter_flat(local_view(self.committed[name], view), positions, values)
            self.committed.update(self._clones)
        else:
            self.committed.clear()
        self.begin()

    def drop(self, live_changed: bool) -> None:
        """The refit failed: nothing of it is kept; if live weights changed, neither is the rest."""
        self.begin()
        if live_changed:
            self.committed.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.committed.values())
