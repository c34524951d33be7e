"""The HF-conversion broadcast path: the baseline every benchmark compares with.

What RL stacks ship today, in its reasonably efficient form: the training ranks gather every
tensor whole in HF names and layout on training rank 0 (here through a gather plan, which is
cheaper than the per-tensor all-gathers of an HF export, so the baseline is not handicapped),
rank 0 broadcasts bucket after bucket of full tensors to every vLLM worker, and each worker
lets vLLM's own loaders cut out its part inside vLLM's layerwise reload. Every inference rank
receives the whole model.

It is a second transport behind the driver's one interface:

* the driver end, :class:`HFBroadcastTransport` (``driver.refit(transport=...)``);
* the trainer end, rank tasks the training ranks run through the rank protocol
  (:class:`JoinBroadcast`, :class:`SendBroadcast`, :class:`LeaveBroadcast`): gather over the
  refit group, then training rank 0 broadcasts;
* the data path both ends share, ``transport.broadcast``; the engine end, for engines started
  with ``worker_extension_cls=HF_BROADCAST_EXTENSION``, is ``adapters.vllm.hf_baseline``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

#: The ``refit.driver.RefitDriver`` that runs a transport. Transports never import the driver
#: (its module imports them), not even for type checking: the layer contract counts that too.
RefitDriver = Any
from ...adapters.vllm.hf_baseline import HF_BROADCAST_EXTENSION, hf_join, hf_leave, hf_receive, runs_baseline
from ...errors import RefitFailed
from ...wire.faults import Faults
from ..metrics import RefitMetrics
from ...transport.broadcast import HF_PREFIX, BroadcastJoin, BroadcastStats, broadcast_send, gather_layout
from ...transport.views import TORCH_DTYPES
from ...plan import get_plan
from ...plan.types import TransferPlan
from ...wire.protocol import RankMap, RefitRequest
from ...training.ranks import TrainerRank
from ...transport.executor import TransferOptions, execute_plan
from ...transport.group import RefitGroup

__all__ = ["SendStats", "JoinBroadcast", "SendBroadcast", "LeaveBroadcast", "HFBroadcastTransport",
           "HF_BROADCAST_EXTENSION"]


# ---------------------------------------------------------------------------- trainer end


@dataclass(frozen=True)
class SendStats:
    """A training rank's part of one baseline refit: its gather, and on rank 0 the broadcast."""

    gather_bytes: int
    gather_seconds: float
    seconds: float
    peak_extra_bytes: int


class _Group:
    """The broadcast group as a rank resource (closed with the rank, without a barrier)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def close(self) -> None:
        self.group.close(barrier=False)


@dataclass(frozen=True)
class JoinBroadcast:
    """Trainer end: training rank 0 roots the broadcast group (the other ranks only gather)."""

    host: str
    port: int
    world: int
    timeout_s: float
    secret: str

    def run(self, rank: TrainerRank) -> None:
        LeaveBroadcast().run(rank)
        if rank.rank == 0:
            rank.resources[HF_PREFIX] = _Group(RefitGroup.create(self.host, self.port, 0, self.world, self.timeout_s,
                                                                 is_master=True, prefix=HF_PREFIX, secret=self.secret))


@dataclass(frozen=True)
class SendBroadcast:
    """Trainer end of one refit, on every training rank: gather every tensor whole on rank 0
    (HF names and layout) over the refit group, then rank 0 broadcasts them bucket by bucket to
    every vLLM worker."""

    gather_plan: TransferPlan
    buffer_bytes: int
    timeout_s: float

    def run(self, rank: TrainerRank) -> SendStats:
        t0 = time.perf_counter()
        tensors = rank.spec.tensor_table()
        plan, me = self.gather_plan, rank.rank
        full = None
        if me == 0:
            full = {n: torch.empty(shape, dtype=TORCH_DTYPES[dt]) for n, (shape, dt) in tensors.items()}
        gather = execute_plan(plan.for_rank("src", me), plan.for_rank("dst", 0) if full is not None else None,
                              rank.synced_tensors(), full, rank.refit_group(),
                              TransferOptions(self.timeout_s, verify=False,
                                              rank_map=RankMap(tuple(range(plan.num_src)), (0,))))
        peak = gather.peak_extra_bytes
        if full is not None:
            sent = broadcast_send(full, tensors, rank.resources[HF_PREFIX].group, buffer_bytes=self.buffer_bytes,
                                  timeout_s=self.timeout_s)
            peak += sent.peak_extra_bytes + sum(t.numel() * t.element_size() for t in full.values())
        return SendStats(gather.bytes_received, gather.seconds, time.perf_counter() - t0, peak)


@dataclass(frozen=True)
class LeaveBroadcast:
    """Trainer end: close this rank's broadcast group, if any."""

    def run(self, rank: TrainerRank) -> None:
        group = rank.resources.pop(HF_PREFIX, None)
        if group is not None:
            group.close()


# ---------------------------------------------------------------------------- driver end


class HFBroadcastTransport:
    """The baseline as a transport: ``driver.refit(transport=HFBroadcastTransport())``. Its
    engines need ``worker_extension_cls=HF_BROADCAST_EXTENSION``; the refit group must exist
    (the gather runs over it). Keeps the broadcast group (and the driver it was formed with)
    and the gather plan between refits."""

    name = "hf_broadcast"
    worker_extension: str | None = HF_BROADCAST_EXTENSION

    def __init__(self) -> None:
        self._gather_plan: TransferPlan | None = None
        self._joined: RefitDriver | None = None  # the driver whose ranks form the broadcast group

    def refit(self, driver: RefitDriver, request: RefitRequest, faults: Faults | None) -> RefitMetrics:
        if faults is not None and (faults.trainer or faults.engine):
            raise RefitFailed("hf_broadcast: fault injection is implemented for the reshard transport only")
        missing = [e for e, d in enumerate(driver.destinations) if not runs_baseline(d)]
        if missing:
            raise RefitFailed(f"hf_broadcast: engine(s) {missing} were not started with "
                              f"worker_extension_cls={HF_BROADCAST_EXTENSION!r}")
        driver.ensure_connected()
        cfg = driver.refit_config
        if self._joined is not driver:  # first refit, after a failed one, or a new driver (restarted trainers)
            self._gather_plan = get_plan(driver.src, gather_layout(driver.src.tensors), bucket_bytes=cfg.bucket_bytes)
            self._join(driver, request.timeout_s)
        t0 = time.perf_counter()
        sending = driver.trainers.run(SendBroadcast(self._gather_plan, cfg.buffer_bytes, request.timeout_s))
        dst_stats: list[BroadcastStats] = []
        errors = driver.calls.on(lambda d, _: dst_stats.extend(hf_receive(d, cfg.buffer_bytes, request.timeout_s)))
        try:
            src_stats = sending.wait()
        except Exception:
            self._joined = None
            raise
        seconds = time.perf_counter() - t0
        if errors:
            self._joined = None
            raise RefitFailed("hf_broadcast: " + "; ".join(errors))
        phases = {"gather": max(s.gather_seconds for s in src_stats), "root": max(s.seconds for s in src_stats),
                  "receive_and_reload": max(s.seconds for s in dst_stats)}
        moved = sum(s.gather_bytes for s in src_stats) + sum(s.bytes_received for s in dst_stats)
        return RefitMetrics(
            transport=self.name,
            bytes_moved=moved,
            bytes_full=moved,  # always whole tensors
            delta_reason="the hf_broadcast baseline sends whole tensors",
            bytes_min=driver.plan.bytes_min,
            seconds=seconds,
            transfer_seconds=max([s.seconds for s in dst_stats] + [s.seconds for s in src_stats]),
            peak_extra_bytes=max([s.peak_extra_bytes for s in dst_stats] + [s.peak_extra_bytes for s in src_stats]),
            verified=False,  # nothing is checksummed on this path, whatever the request asked
            notes=("no checksum verification on the baseline path; checked by logprobs",),
            phases={k: round(v, 6) for k, v in phases.items()},
            pause_seconds=seconds,  # the receive runs inside collective_rpc: no model step meanwhile
        )

    def _join(self, driver: RefitDriver, timeout_s: float) -> None:
        """Training rank 0 and every vLLM worker form the broadcast group; every engine joins at
        once (creating the group is a rendezvous of all its ranks)."""
        port, world = driver.free_port(), 1 + driver.dst.world_size
        joining = driver.trainers.run(JoinBroadcast(driver.host, port, world, timeout_s, driver.secret))
        joins = [BroadcastJoin(driver.host, port, world, timeout_s, lo, driver.secret) for lo in driver.engine_offsets]
        errors = driver.calls.on(hf_join, joins)
        joining.wait()
        if errors:
            raise RefitFailed("hf_broadcast join: " + "; ".join(errors))
        self._joined = driver

    def close(self, driver: RefitDriver) -> None:
        """Both ends leave the broadcast group."""
        if self._joined is driver:
            self._joined = None
        driver.calls.on(lambda d, _: hf_leave(d), what="hf_leave", deadline_s=30.0)
        driver.trainers.run(LeaveBroadcast()).wait()
