"""vLLM's weight-update session, closed on a failed finish as vLLM closes it on a failed update.

vLLM's worker keeps one flag per session (``Worker._weight_update_active``): ``update_weights``
clears it when the engine raises, ``finish_weight_update`` only after the engine returned. The
``mcore_reshard`` engine raises from ``finish_weight_update`` on its engine's last worker when a
refit did not commit (so that the caller -- an HTTP controller's ``/finish_weight_update``, a
driver -- sees the failure in one line, and no other worker's error is left queued in vLLM's
RPC replies). That worker's session then stayed open, and the next ``/start_weight_update``
was refused ("already active"): a controller that stopped at that refusal never recovered.

``install`` gives ``finish_weight_update`` the rule ``update_weights`` has, for this backend's
engine only: when the engine raises, the session is closed (and the draft target reset, as a
successful finish does) before the error goes on. After any failed refit every worker of the
engine is then ready for the next ``start_weight_update``. Run from the ``vllm.general_plugins``
entry point (``plugin.register``) in every vLLM process; idempotent.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install"]


def install() -> None:
    from vllm.v1.worker.gpu_worker import Worker  # the CPU worker's base too

    finish = Worker.finish_weight_update
    if getattr(finish, "_closes_failed_sessions", False):
        return

    @functools.wraps(finish)
    def finish_weight_update(self: Any) -> None:
        try:
            finish(self)
        except BaseException:
            engine = getattr(self, "weight_transfer_engine", None)
            if getattr(engine, "closes_failed_sessions", False) and getattr(self, "_weight_update_active", False):
                self._weight_update_active = False
                engine.reset_weight_update_target()
            raise

    finish_weight_update._closes_failed_sessions = True  # type: ignore[attr-defined]
    Worker.finish_weight_update = finish_weight_update
