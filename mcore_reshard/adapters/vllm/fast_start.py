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

An engine then starts in 2-3 s. vLLM also inspects each model class it has not seen (its
``modelinfos`` cache, empty on a fresh machine) in a fresh interpreter, ``python -m
vllm.model_executor.models.registry``, which imports vLLM again: 7-9 CPU-seconds per
architecture. With the variable set, that inspection -- vLLM's own function, the same
``_ModelInfo.from_model_cls`` -- runs in a child of the same fork server (in an engine core: a
forked child), and its result lands in vLLM's cache as before.

Inside a Ray actor (GRPO's engine actors) the same holds: the fork server is a fresh process
the actor starts, so no Ray thread is forked; a tiny GRPO run's engine starts 14 s sooner. Off
(the default) and on a GPU platform (``fork`` after CUDA's start is unsafe), vLLM decides as
before.
``install`` runs from the ``vllm.general_plugins`` entry point (``plugin.register``), which vLLM
calls in every process before it starts children.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import tempfile
from typing import Any, Callable, TypeVar

from ...infra import procs

__all__ = ["install"]

#: Modules holding their own reference to vLLM's ``get_mp_context``.
_USERS = ("vllm.utils.system_utils", "vllm.v1.engine.utils", "vllm.v1.executor.multiproc_executor",
          "vllm.v1.engine.coordinator")

_ORIGINAL: list[Any] = []
_ORIGINAL_INSPECT: list[Any] = []

#: How long a model class's inspection may take before it is an error (it imports one model
#: module: a second or two here).
INSPECT_TIMEOUT_S = 300.0

_T = TypeVar("_T")


def _get_mp_context() -> Any:
    """vLLM's own function runs first in every case (for the environment it prepares for
    children); its context is kept where the fast start is off or does not apply."""
    ctx = _ORIGINAL[0]()
    return _fast_context() if procs.enabled() else ctx


def _fast_context() -> Any:
    """Where a child comes from under the fast start: forked in a fork-server child (it has
    imported vLLM and run no model step), else from this process's fork server."""
    return multiprocessing.get_context("fork") if procs.in_child() else procs.context()


def _inspect_child(blob: bytes, out: str) -> None:
    """In the child: vLLM's inspection function, its result pickled to ``out`` (what vLLM's
    ``registry._run`` does in its subprocess)."""
    import cloudpickle

    result = cloudpickle.loads(blob)()
    with open(out, "wb") as f:
        pickle.dump(result, f)


def _run_in_subprocess(fn: Callable[[], _T]) -> _T:
    """vLLM's ``registry._run_in_subprocess`` (a model class inspected in a child, never in the
    process that starts engines), its child a fork-server child instead of a new interpreter.
    The function and its result travel as vLLM's do: cloudpickled in, pickled back through a
    file, between this process and its own child."""
    if not procs.enabled():
        return _ORIGINAL_INSPECT[0](fn)
    import cloudpickle

    ctx = _fast_context()
    with tempfile.TemporaryDirectory(prefix="mr_modelinfo_") as tmp:
        out = os.path.join(tmp, "modelinfo.pkl")
        proc = ctx.Process(target=_inspect_child, args=(cloudpickle.dumps(fn), out), name="mr-modelinfo")
        proc.start()
        proc.join(INSPECT_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
            raise RuntimeError(f"vLLM's model inspection did not finish within {INSPECT_TIMEOUT_S:.0f} s")
        if proc.exitcode != 0:
            raise RuntimeError(f"vLLM's model inspection failed in its child (exit code {proc.exitcode}; "
                               "its traceback is above)")
        with open(out, "rb") as f:
            return pickle.load(f)


def install() -> None:
    """Route vLLM's ``get_mp_context`` through ``_get_mp_context`` and its model inspection
    through ``_run_in_subprocess`` on a CPU platform (idempotent). The variable is read at each
    start, not here: a process may turn the fast start on or off between engines."""
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
    registry = importlib.import_module("vllm.model_executor.models.registry")
    if registry._run_in_subprocess is not _run_in_subprocess:
        _ORIGINAL_INSPECT[:] = [registry._run_in_subprocess]
        registry._run_in_subprocess = _run_in_subprocess
