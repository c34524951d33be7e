"""``run_world`` on warm megatron worlds: the same contract as
``mcore_reshard.testing.worlds.run_world`` (``fn(WorldCtx, *args)`` on every rank,
results by rank, a failing rank's traceback raised), but the rank processes stay up between
jobs, so megatron-core, torch and the model code are imported once per rank instead of once
per test (most of a small job's time on this machine).

Each job still gets its own ``torch.distributed`` world (a new rendezvous port) and its own
megatron parallel state: after every job each rank destroys megatron's model-parallel groups
and the default process group (what a process exit did before). Every job seeds the RNGs
itself (``init_megatron`` / ``build_policy``), so results do not depend on what ran before.
A job that fails, times out or loses a rank kills its world; the next job of that size starts
a new one. Worlds are keyed by size; ``close_all`` (called by ``conftest.py``) stops them.

Not for jobs that take multiprocessing queues or other inherited handles as arguments (they
can only reach a process at its start): use the package's ``run_world`` for those.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
import queue as queue_mod
import time
import traceback
from typing import Any, Callable, Sequence

from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.infra.ports import free_port

__all__ = ["run_world", "prestart", "close_all", "stats"]


def _reset_rank() -> None:
    """What a process exit used to do between jobs: no megatron groups, no default group."""
    import gc

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - nothing initialised
        pass
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def _rank_loop(rank: int, commands: Any, replies: Any, log: str) -> None:
    """One warm rank: import the heavy modules once, then run jobs until told to stop. Its
    output goes to ``log`` (it outlives any one test's captured output)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    try:
        import megatron.core  # noqa: F401 - imported once per warm rank
        import mcore_reshard.adapters.megatron.train  # noqa: F401
    except Exception:  # noqa: BLE001 - the job's own import reports it
        pass
    while True:
        item = commands.get()
        if item is None:
            return
        seq, fn, ctx, args, threads = item
        torch.set_num_threads(threads)
        try:
            # Pickled by value here: torch's queue would share tensors by fd.
            replies.put((seq, rank, True, pickle.dumps(fn(ctx, *args))))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            replies.put((seq, rank, False, traceback.format_exc()))
        finally:
            _reset_rank()


class _WarmWorld:
    def __init__(self, world: int) -> None:
        import torch.multiprocessing  # noqa: F401 - torch's tensor reductions on the queues
        from mcore_reshard.infra.procs import process_context

        ctx = process_context("spawn")  # the fork server with MCORE_RESHARD_FAST_START=1
        self.world = world
        self.replies = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_rank_loop, args=(r, self.commands[r], self.replies, LOG), daemon=True,
                                  name=f"warm-megatron-{world}-{r}") for r in range(world)]
        for p in self.procs:
            p.start()
        self.seq = 0
        self.jobs = 0

    def run(self, fn: Callable[..., Any], args: Sequence[Any], timeout_s: float, threads: int) -> list[Any]:
        self.seq += 1
        seq, port = self.seq, free_port()
        for r in range(self.world):
            self.commands[r].put((seq, fn, WorldCtx(r, self.world, "127.0.0.1", port), tuple(args), threads))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"run_world timed out after {timeout_s:.0f}s; finished ranks: {sorted(results)}")
            try:
                got_seq, rank, ok, value = self.replies.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in results and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {self.procs[dead[0]].exitcode}") from None
                continue
            if got_seq != seq:
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed (ranks' output: {LOG}):\n{value}")
            results[rank] = pickle.loads(value)
        self.jobs += 1
        return [results[r] for r in range(self.world)]

    def close(self, grace_s: float = 1.0) -> None:
        for q in self.commands:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in (*self.commands, self.replies):
            q.close()


_WORLDS: dict[int, _WarmWorld] = {}
#: Where warm ranks write their stdout and stderr.
LOG = os.environ.get("MR_TEST_WARM_LOG") or os.path.join(tempfile.gettempdir(), f"mr_warm_megatron_{os.getpid()}.log")
_STATS = {"jobs": 0, "worlds": 0}


_LOCK = threading.Lock()


def _world(world: int) -> _WarmWorld:
    with _LOCK:
        w = _WORLDS.get(world)
        if w is None or not all(p.is_alive() for p in w.procs):
            if w is not None:
                w.kill()
            w = _WORLDS[world] = _WarmWorld(world)
            _STATS["worlds"] += 1
        return w


def prestart(sizes: Sequence[int]) -> None:
    """Start warm worlds of these sizes now, on a daemon thread (their ranks import megatron
    in the background; with the fast start, the first one waits for the fork server to import
    torch, megatron-core and vLLM, which must not hold up the tests)."""
    from . import PROCESS_STARTS

    def start() -> None:
        for n in sizes:
            with PROCESS_STARTS:
                _world(n)

    threading.Thread(target=start, name="warm-megatron-worlds", daemon=True).start()


def run_world(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), *, timeout_s: float = 300.0,
              threads: int = 1) -> list[Any]:
    """Run ``fn(WorldCtx, *args)`` on every rank of the warm world of ``world`` ranks (started
    on first use); return results by rank. Raises RuntimeError naming the rank and its
    traceback when any rank fails or dies; the world is then killed, never reused."""
    if os.environ.get("MR_TEST_COLD_WORLDS") == "1":  # the package's one-shot processes
        from mcore_reshard.testing.worlds import run_world as cold

        return cold(fn, world, args, timeout_s=timeout_s, threads=threads)
    w = _world(world)
    try:
        out = w.run(fn, args, timeout_s, threads)
    except BaseException:
        _WORLDS.pop(world, None)
        w.kill()
        raise
    _STATS["jobs"] += 1
    return out


def stats() -> dict[str, int]:
    """Jobs run and warm worlds started so far."""
    return dict(_STATS)


def close_all() -> None:
    with _LOCK:
        while _WORLDS:
            _, w = _WORLDS.popitem()
            w.close()
