"""A small multi-process harness for tests and scripts: ``run_world`` starts one process per
rank (spawned, or forked by ``procs``' fork server with ``MCORE_RESHARD_FAST_START=1``), runs
``fn(WorldCtx, *args)`` on each and returns the results by rank. Production code never
imports ``mcore_reshard.testing`` (import-linter)."""

from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..infra.ports import free_port

__all__ = ["WorldCtx", "join_or_kill", "run_world"]


@dataclass(frozen=True)
class WorldCtx:
    """What a spawned rank needs to join the default process group."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def _entry(fn: Callable, ctx: WorldCtx, args: tuple, queue, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        # Pickled by value here: torch's queue would share tensors by fd, which dies with us.
        queue.put((ctx.rank, True, pickle.dumps(fn(ctx, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((ctx.rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def run_world(fn: Callable[..., Any], world: int, args: Sequence[Any] = (), *, timeout_s: float = 300.0,
              threads: int = 1, may_exit: Sequence[int] = ()) -> list[Any]:
    """Run ``fn(WorldCtx, *args)`` in ``world`` spawned processes; return results by rank.

    ``fn`` must be importable (module level). Raises RuntimeError naming the rank and its
    traceback when any rank fails or dies, and kills every rank on failure or timeout. A rank
    in ``may_exit`` (a fault test kills it on purpose) may die without a result: its result is
    None and the others run on.
    """
    import queue as queue_mod

    import torch.multiprocessing  # noqa: F401 - torch's tensor reductions on the queues
    from ..infra.procs import process_context

    ctx = process_context("spawn")  # the fork server with MCORE_RESHARD_FAST_START=1
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, WorldCtx(r, world, "127.0.0.1", port), tuple(args), q, threads),
                    daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"run_world timed out after {timeout_s:.0f}s; finished ranks: {sorted(results)}")
            try:
                rank, ok, value = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                for r in [r for r in dead if r in may_exit]:
                    results[r] = None
                    dead.remove(r)
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
        join_or_kill(procs, deadline, least_s=1.0)  # every rank reported: let each exit
    finally:
        join_or_kill(procs, 0.0, least_s=0.0)  # a failure: kill the rest now
        q.close()
    return [results[r] for r in range(world)]


def join_or_kill(procs: Sequence[Any], deadline: float, *, least_s: float = 0.1) -> None:
    """Join every process until ``deadline`` (monotonic; at least ``least_s`` each), then kill
    the ones still alive: a test's ranks never outlive it."""
    for p in procs:
        p.join(timeout=max(least_s, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


