"""Small gloo worlds of spawned ranks for the transport tests, and what their ranks share.

A test spawns one world (``spawn_ranks``) and runs several checks in it (a process start costs
seconds); every rank reports one dict through a queue (``ship``) and the parent asserts.
Targets must be importable module-level functions ``target(rank, world, *args, q)``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from mcore_reshard.testing.worlds import join_or_kill
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local
from mcore_reshard.transport.executor import TensorSink, TransferOptions, execute_plan, zero_fill_padding
from mcore_reshard.transport.group import RefitError

__all__ = ["T", "T16", "canonical", "locals_of", "expected_equal", "FlippingSink", "refit_once", "ship",
           "spawn_ranks"]

#: Toy canonical tensors: (shape, dtype) by name.
T = {"a": ((12, 8), "float32"), "b": ((8,), "float32"), "c": ((6, 4, 4), "float32")}
T16 = {k: (s, "bfloat16") for k, (s, _) in T.items()}


def canonical(tensors: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(TORCH_DTYPES[d]) for k, (s, d) in tensors.items()}


def locals_of(layout, rank: int, canon: dict | None) -> dict[str, torch.Tensor]:
    """Source locals from ``canon``; destination locals (canon None) full of NaN."""
    return {
        p.name: materialize_local(p, canon) if canon is not None
        else torch.full(p.shape, float("nan"), dtype=TORCH_DTYPES[p.dtype])
        for p in layout.for_rank(rank)
    }


def expected_equal(layout, rank: int, canon: dict, got: dict[str, torch.Tensor]) -> list[str]:
    """Names of local tensors that are not bit-for-bit what the descriptors say (padding 0)."""
    bad = []
    for p in layout.for_rank(rank):
        exp = materialize_local(p, canon)
        if not torch.equal(exp.view(-1).view(_int(exp)), got[p.name].reshape(-1).view(_int(exp))):
            bad.append(p.name)
    return bad


def _int(t: torch.Tensor) -> torch.dtype:
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def refit_once(plan, src, dst, s_rank, d_rank, group, rm, seed: int, *, tensors=T, sink=None,
               digest: str | None = None, progress: bool = False, fault=None) -> dict:
    """One refit of ``canonical(tensors, seed)`` on this rank: its stats or one error line, and
    the destination tensors that are not bit-for-bit what the descriptors say. ``fault``:
    this rank's (e.g. ``Fault(tensor=...)``: a broken write where it receives that tensor)."""
    sp = plan.for_rank("src", s_rank) if s_rank is not None else None
    dp = plan.for_rank("dst", d_rank) if d_rank is not None else None
    canon = canonical(tensors, seed)
    s = locals_of(src, s_rank, canon) if s_rank is not None else {}
    d = locals_of(dst, d_rank, None) if d_rank is not None else {}
    try:
        stats = execute_plan(sp, dp, s, d if sink is None else sink(d), group, TransferOptions(
            20.0, progress=progress, plan_digest=plan.digest() if digest is None else digest, rank_map=rm,
            fault=fault))
        err = None
    except RefitError as e:
        stats, err = None, str(e)
    bad = None
    if d_rank is not None:
        zero_fill_padding(d, dst.for_rank(d_rank))
        bad = expected_equal(dst, d_rank, canon, d)
    return {"stats": stats, "err": err, "bad": bad}


def ship(q: Any, rank: int, out: dict) -> None:
    """Report a worker's results to the parent and exit at once (its group may be broken:
    skip the destructors' waits)."""
    q.put((rank, out))
    q.close()
    q.join_thread()
    os._exit(0)


def spawn_ranks(target, world: int, *args, wait_s: float = 90.0) -> dict[int, dict]:
    """Run ``target(rank, world, *args, q)`` in ``world`` spawned processes; every rank's dict
    by rank. Fails naming the ranks that never reported, or a rank's ``crash`` traceback."""
    import torch.multiprocessing  # noqa: F401 - torch's tensor reductions on the queues
    from mcore_reshard.infra.procs import process_context

    ctx = process_context("spawn")  # the fork server with MCORE_RESHARD_FAST_START=1
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + wait_s
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                r, out = q.get(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 -- queue.Empty
                break
            results[r] = out
    finally:
        join_or_kill(procs, deadline)
    assert len(results) == world, f"workers {sorted(set(range(world)) - set(results))} never reported"
    for r, out in results.items():
        assert "crash" not in out, f"rank {r} crashed:\n{out['crash']}"
    return results
