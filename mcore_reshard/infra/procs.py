"""Process starts that do not import the heavy libraries again: ``MCORE_RESHARD_FAST_START=1``.

Why: every process a local job starts -- a megatron training rank, a vLLM engine core and its
workers -- is started with ``spawn`` (CUDA and OpenMP are not safe across ``fork`` once a
process has used them), so each imports torch, megatron-core or vLLM anew: 5 s for a training
rank, 7-8 s for an engine core and again for each worker, most of an engine's 17-20 s start on
this machine. With the variable set, those processes come from one ``forkserver``: a server
process that imported ``PRELOAD`` once and has run nothing else, forked for each start.

- A child runs with its parent's environment as of ``start()`` (a fork-server child would
  otherwise see the server's, frozen when it started).
- A child knows it is one (``in_child()``): an engine core started this way forks its vLLM
  workers (``adapters/vllm/fast_start.py``): it has imported vLLM and run no model step or
  OpenMP region when vLLM's executor starts them.

Off (the default) nothing changes. The same code runs in the same processes either way; only
how a process begins differs.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from multiprocessing.context import BaseContext, ForkServerContext, ForkServerProcess
from typing import Any

__all__ = ["ENV", "PRELOAD", "enabled", "in_child", "context", "process_context"]

ENV = "MCORE_RESHARD_FAST_START"

#: What the fork server imports once: the modules a training rank and a vLLM engine core and
#: its CPU workers import. One list for both, because a process has one fork server (its first
#: start launches it, whichever kind that start is); a module missing from this install is
#: skipped (multiprocessing ignores an ``ImportError`` there).
PRELOAD = (
    "torch",
    "megatron.core",
    "mcore_reshard.adapters.megatron.endpoint",
    "mcore_reshard.adapters.megatron.train",
    "mcore_reshard.training.pool",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "mcore_reshard.adapters.vllm.plugin",
)

_STATE: dict[str, Any] = {"child": False, "ctx": None}


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def in_child() -> bool:
    """Whether this process was started by the fork server."""
    return bool(_STATE["child"])


class _EnvProcess(ForkServerProcess):
    """A fork-server child that runs with its parent's environment as of ``start()``."""

    def start(self) -> None:
        self._mr_env = dict(os.environ)
        super().start()

    def run(self) -> None:
        # What the server imported is never garbage: its objects leave the collector's view, so
        # no full collection here walks (and, touching their headers, copies) the pages of
        # torch, megatron-core and vLLM this child shares with the server (``gc.freeze``).
        gc.freeze()
        os.environ.clear()
        os.environ.update(self._mr_env)
        _STATE["child"] = True
        super().run()


class _Context(ForkServerContext):
    Process = _EnvProcess


def context() -> ForkServerContext:
    """The fork-server context (one per process; its server starts with the first child)."""
    ctx = _STATE["ctx"]
    if ctx is None:
        ctx = _STATE["ctx"] = _Context()
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def process_context(fallback: str = "spawn") -> BaseContext:
    """Where a process this library starts comes from: the fork server when the fast start is
    on, else ``fallback``."""
    return context() if enabled() else multiprocessing.get_context(fallback)
