"""What one engine worker holds after its refits: the version, the refit, and whether it knows.

The engine end's bookkeeping (``engine.ReshardWeightTransferEngine``), apart from its
lifecycle: every refit's conclusion updates it, and ``status()`` reads it -- the driver reads
``status()`` to confirm an engine is whole (vLLM's engine API has no other channel back).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....transport.participant import Outcome
from ....wire.protocol import RefitRequest, WorkerStatus
from ..apply import VllmApplier

__all__ = ["Standing"]


@dataclass
class Standing:
    """One worker's standing (see the module docstring)."""

    #: The version label of this worker's weights (``RefitRequest.label``; "" = as loaded).
    version: str = ""
    #: The identity of the refit whose weights this worker holds (``Outcome.refit``; "" = as loaded).
    refit: str = ""
    #: Why this worker could not learn a refit's decision; kept until a refit commits here,
    #: so every later refit and driver sees this worker ``unsure`` until then.
    unsure: str = ""
    #: Why this worker refused its plan slice at init (its first refit votes no with it).
    init_error: str = ""
    #: The agreed outcome of the last refit (diagnostics).
    last_outcome: Outcome | None = None

    def concluded(self, request: RefitRequest | None, outcome: Outcome) -> None:
        """A refit ended here with ``outcome`` (``request`` None: refused before it began)."""
        if request is not None and outcome.commit and outcome.known:  # this worker now holds it, whole
            self.version, self.refit, self.unsure = request.label(outcome.refit), outcome.refit, ""
        self.last_outcome = outcome
        if not outcome.known:
            self.unsure = "; ".join(outcome.errors)[:500] or "the decision of a refit is unknown here"

    def status(self, applier: VllmApplier | None) -> WorkerStatus:
        """This worker's serving state, the version it holds and the last refit's outcome.

        ``state``: ``serving`` (whole weights of ``version``), ``not_serving`` (a streaming
        refit committed part of the weights and then failed), ``unsure`` (this worker could
        not learn the last refit's decision; it kept its old weights, but others may not)."""
        ap = applier
        state, reason = ("serving", "") if ap is None else (ap.state if ap.state != "updating" else "serving", ap.reason)
        out = self.last_outcome
        if self.unsure and state == "serving":
            state, reason = "unsure", self.unsure
        return WorkerStatus(state, reason, self.version, None if out is None else bool(out.commit and out.known),
                            None if out is None else out.known, () if out is None else tuple(out.errors),
                            self.init_error, self.refit)
