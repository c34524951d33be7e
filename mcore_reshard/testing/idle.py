"""Whether processes are idle: the CPU each thread used over a window.

A failed refit must leave nothing running behind it: a gloo event loop woken forever by bytes
nobody reads costs a full core and starves whatever shares it (the retry's trainers, once).
``busy`` names every thread above a threshold; tests and ``scripts/soak.py --faults`` call it
on every surviving process once a failure has settled.
"""

from __future__ import annotations

import time
from typing import Iterable

__all__ = ["IDLE_CORES", "busy"]

#: Above this share of a core over the window a thread is busy, not idle. vLLM's workers poll
#: their queue for a second after each message; the window starts later than that.
IDLE_CORES = 0.25


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    import psutil

    out = {}
    for t in psutil.Process(pid).threads():
        try:
            with open(f"/proc/{pid}/task/{t.id}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = "?"
        out[t.id] = (name, t.user_time + t.system_time)
    return out


def busy(pids: Iterable[int], seconds: float = 2.0, threshold: float = IDLE_CORES) -> dict[str, float]:
    """``{"pid <p> thread <name>": cores}`` for every thread of ``pids`` that used more than
    ``threshold`` of a core over the next ``seconds`` (processes that exit meanwhile are skipped)."""
    import psutil

    before: dict[int, dict[int, tuple[str, float]]] = {}
    for pid in pids:
        try:
            before[pid] = _threads(pid)
        except psutil.Error:
            pass
    time.sleep(seconds)
    out: dict[str, float] = {}
    for pid, threads in before.items():
        try:
            after = _threads(pid)
        except psutil.Error:
            continue
        for tid, (name, used) in after.items():
            cores = (used - threads.get(tid, (name, 0.0))[1]) / seconds
            if cores > threshold:
                out[f"pid {pid} thread {name} ({tid})"] = round(cores, 3)
    return out
