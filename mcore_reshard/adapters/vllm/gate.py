"""A worker's serving state, and the gate that refuses a model step on weights it must not serve.

The engine-level gate (a paused scheduler) keeps requests from reaching a torn model; this is
its backstop in the worker, for a caller that resumes by hand (a server's ``/resume``): a model
step on torn weights raises instead of computing. It also refuses a worker that could not
learn a refit's decision (``unsure``): its engine's other workers may hold the new weights,
and a caller without a pause (vLLM's trainer-side API) would otherwise mix two models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ...errors import RefitIncomplete

__all__ = ["Serving", "ForwardGate"]


@dataclass
class Serving:
    """What a worker's model serves, shared by the applier's parts (the participant changes
    it, the sink checks a box arrives while ``updating``, the gate reads it).

    ``state``: ``idle | updating | serving | not_serving``, and ``reason`` why; ``unsure``: why
    this worker could not learn a refit's decision (set by its engine until a refit commits
    here)."""

    state: str = "idle"
    reason: str = ""
    unsure: str = ""

    def refusal(self) -> str:
        """Why a model step must not run now ("" when it may)."""
        if self.state == "not_serving":
            return f"model step refused: {self.reason}"
        if self.unsure:
            return (f"model step refused: this worker does not know whether its engine's other "
                    f"workers committed the last refit ({self.unsure[:300]})")
        return ""


class ForwardGate:
    """A forward pre-hook on each of ``modules`` that raises ``RefitIncomplete`` while
    ``serving`` refuses model steps. On every module that owns a parameter a refit writes,
    not the top model: vLLM's compile decorator calls the top model's ``forward`` directly,
    skipping its hooks."""

    def __init__(self, modules: Iterable[torch.nn.Module], serving: Serving) -> None:
        self.serving = serving
        self._handles = [m.register_forward_pre_hook(self._refuse) for m in modules]

    def _refuse(self, module: torch.nn.Module, args: Any) -> None:
        s = self.serving
        if s.state == "not_serving" or s.unsure:
            raise RefitIncomplete(s.refusal())

    def close(self) -> None:
        """Remove the hooks (a new applier's gate takes over the model)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
