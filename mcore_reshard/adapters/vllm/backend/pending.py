"""The refit between ``update_weights`` and ``finish_weight_update`` on one engine worker.

vLLM's three calls split a refit at its vote: ``update_weights`` receives, prepares and votes;
``finish_weight_update`` commits or rolls back as voted. In between the refit is pending:
voted in the foreground (:class:`Voted`), or -- an overlapped request -- receiving and voting
on a thread of its own while the engine keeps running model steps on the live weights
(:class:`Background`). Either way ``join`` gives what the receive left (:class:`Received`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from vllm.config import set_current_vllm_config

from ....transport.participant import Outcome
from ....wire.protocol import EngineUpdateInfo, RefitRequest, first_error_line
from ..apply import VllmApplier

__all__ = ["Received", "Unreadable", "Voted", "Background", "wants_overlap", "BACKGROUND_GRACE_S"]

#: Seconds past a request's timeout that ``finish_weight_update`` waits for its background refit.
BACKGROUND_GRACE_S = 30.0


@dataclass(frozen=True)
class Unreadable:
    """An ``update_info`` this worker could not read: its vote is "no" with ``error`` (raising
    from ``update_weights`` on one worker would poison vLLM's next call)."""

    error: str


@dataclass(frozen=True)
class Received:
    """What one receive left: the request and the participant that took it (both None when the
    request was refused before a byte moved), and the vote's outcome."""

    request: RefitRequest | None
    applier: VllmApplier | None
    outcome: Outcome

    @classmethod
    def refused(cls, error: str, **outcome: Any) -> "Received":
        """A refit this worker refused before it began: its "no", with ``error``."""
        return cls(None, None, Outcome(False, [], [error], **outcome))


def wants_overlap(update_info: EngineUpdateInfo | Unreadable) -> bool:
    """Whether the request asks for an overlapped refit (an unreadable one is refused in the
    foreground)."""
    return isinstance(update_info, EngineUpdateInfo) and update_info.request.overlap and update_info.request.atomic


@dataclass(frozen=True)
class Voted:
    """A refit that voted in the foreground (``update_weights``), waiting for its commit."""

    received: Received

    def join(self) -> Received:
        return self.received


class Background:
    """One overlapped refit on its own thread: ``receive`` (into shadow weights, and vote)
    runs there under the engine's vLLM config, while the worker's main thread keeps running
    model steps on the live weights (``local_rank``: the worker's rank in its engine)."""

    def __init__(self, receive: Callable[[], Received], vllm_config: Any, timeout_s: float, local_rank: int) -> None:
        who = f"vLLM worker {local_rank}"
        self.timeout_s, self.who = float(timeout_s), who
        self.received: Received | None = None

        def run() -> None:
            try:
                with set_current_vllm_config(vllm_config):
                    self.received = receive()
            except BaseException as exc:  # noqa: BLE001 - kept as this worker's outcome
                self.received = Received.refused(f"{who}: background refit failed: {first_error_line(exc)}")

        self.thread = threading.Thread(target=run, daemon=True, name=f"mcore-reshard-refit-{local_rank}")
        self.thread.start()

    def join(self) -> Received:
        """The thread's result, waiting at most the request's timeout and a grace: the vote
        has deadlines of its own, so a thread still running then is stuck. Its shadows are
        never swapped in (the outcome says so; the engine keeps its weights)."""
        wait = self.timeout_s + BACKGROUND_GRACE_S
        self.thread.join(wait)
        if self.thread.is_alive() or self.received is None:
            return Received.refused(f"{self.who}: the background refit did not end within {wait:.0f}s; its shadows "
                                    f"are dropped", known=False)
        return self.received
