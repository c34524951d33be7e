"""vLLM's side of ``MCORE_RESHARD_FAST_START=1`` (``mcore_reshard.infra.procs``): engine starts
that do not import vLLM again.

vLLM's CPU platform starts every process with ``spawn`` (``platforms/cpu.py`` forces
``VLLM_WORKER_MULTIPROC_METHOD=spawn``): an engine start imports vLLM anew in its engine-core
process, then again in each worker, one after the other (17-20 s of a tiny model's start here).
With the variable set, vLLM's ``get_mp_context`` gives:

- in a process that starts engines (a job, a test session): the fork server of
  ``mcore_reshard.infra.procs``, which imported vLLM once;
- in an engine core that fork server started: ``fork``, for its workers (it has imported vLLM
  and run no model step or OpenMP region when vLLM's executor starts them).

An engine then starts in 2-3 s. Inside a Ray actor (GRPO's engine actors) the same holds: the
fork server is a fresh process the actor starts, so no Ray thread is forked; a tiny GRPO run's
engine starts 14 s sooner. Off (the default) and on a GPU platform (``fork`` after CUDA's start
is unsafe), vLLM decides as before.
``install`` runs from the ``vllm.general_plugins`` entry point (``plugin.register``), which vLLM
calls in every process before it starts children.
"""

from __future__ import annotations

import importlib
import multiprocessing
from typing import Any

from ...infra import procs

__all__ = ["install"]

#: Modules holding their own reference to vLLM's ``get_mp_context``.
_USERS = ("vllm.utils.system_utils", "vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor",
          "vllm.v1.engine.coordinator")

_ORIGINAL: list[Any] = []


def _get_mp_context() -> Any:
    """vLLM's own function runs first in every case (for the environment it prepares for
    children); its context is kept where the fast start is off or does not apply."""
    ctx = _ORIGINAL[0]()
    if not procs.enabled():
        return ctx
    return multiprocessing.get_context("fork") if procs.in_child() else procs.context()


def install() -> None:
    """Route vLLM's ``get_mp_context`` through ``_get_mp_context`` on a CPU platform
    (idempotent). The variable is read at each start, not here: a process may turn the fast
    start on or off between engines."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for name in _USERS:
        mod = importlib.import_module(name)
        current = getattr(mod, "get_mp_context", None)
        if current is None or current is _get_mp_context:
            continue
        if not _ORIGINAL:
            _ORIGINAL.append(current)
        mod.get_mp_context = _get_mp_context
