"""``MCORE_RESHARD_VLLM_SPIN_S``: how long vLLM's shared-memory queue readers spin after a message.

vLLM's engine core and its workers talk through shared-memory ring buffers
(``distributed/device_communicators/shm_broadcast.py``). After each message a reader keeps
polling the buffer with ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s) before it
sleeps on a socket until the next write: the right trade on a host whose cores serve the engine
alone (the next decode step's message is picked up at once). On a CPU host shared by trainers
and engines (the CPU recipes, the test suite) that second of spinning follows every step and
every RPC, in the engine core and in each worker, and takes the cores the trainers and the
other engines need: about a quarter of the CPU time of the live refit tests here.

Set to a number of seconds, every reader in the process spins that long instead (a few
hundredths keep a running decode loop spinning: its messages come milliseconds apart). Unset
(the default), vLLM's own value stands. Read when the plugin loads (``plugin.register``, in
every vLLM process before it builds a queue); the workers an engine core forks inherit it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ...errors import ConfigError

__all__ = ["ENV", "install"]

ENV = "MCORE_RESHARD_VLLM_SPIN_S"

_INSTALLED: dict[str, Any] = {}


def spin_seconds() -> float | None:
    """The variable's value in seconds, None where it is unset or empty."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ConfigError(f"{ENV}={raw!r}: expected a number of seconds >= 0")
    return seconds


def install() -> None:
    """Make ``spin_seconds()`` the readers' spin where the variable is set (idempotent; a later
    call with another value takes it)."""
    seconds = spin_seconds()
    if seconds is None:
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    _INSTALLED["seconds"] = seconds
    if "init" in _INSTALLED:
        return
    original = _INSTALLED["init"] = SpinCondition.__init__

    def __init__(self: Any, is_reader: bool, context: Any, notify_address: str, *args: Any, **kw: Any) -> None:
        if not args and "busy_loop_s" not in kw:  # vLLM's default: ours instead
            kw["busy_loop_s"] = _INSTALLED["seconds"]
        original(self, is_reader, context, notify_address, *args, **kw)

    SpinCondition.__init__ = __init__
