"""The HF-conversion broadcast path: the baseline every benchmark compares with.

What RL stacks ship today, in its reasonably efficient form: the training ranks gather every
tensor whole in HF names and layout on training rank 0 (here through a gather plan, which is
cheaper than the per-tensor all-gathers of an HF export, so the baseline is not handicapped),
rank 0 broadcasts bucket after bucket of full tensors to every vLLM worker, and each worker
lets vLLM's own loaders cut out its part inside vLLM's layerwise reload. Every inference rank
receives the whole model.

It is a second transport behind the driver's one interface, with every end here:

* the driver end, :class:`HFBroadcastTransport` (``driver.refit(transport=...)``);
* the trainer end, rank tasks the training ranks run through the rank protocol
  (:class:`JoinBroadcast`, :class:`SendBroadcast`, :class:`LeaveBroadcast`): gather over the
  refit group, then training rank 0 broadcasts;
* the engine end, :class:`HFBroadcastWorkerExtension`: the diagnostics worker extension plus
  the broadcast group's calls, for engines started to run the baseline
  (``worker_extension_cls=HF_BROADCAST_EXTENSION``), with the one vLLM patch the reload needs
  on CPU (:func:`reload_weights`).

Every message between them is typed (:class:`BroadcastJoin`, :class:`BroadcastStats`,
:class:`SendStats`).
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ...adapters.vllm.layers import reprepack_cpu_moe
from ...adapters.vllm.worker import ReshardWorkerExtension
#: The ``refit.driver.RefitDriver`` that runs a transport. Transports never import the driver
#: (its module imports them), not even for type checking: the layer contract counts that too.
RefitDriver = Any
from ...errors import RefitFailed
from ...wire.faults import Faults
from ...layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from ..metrics import RefitMetrics
from ...transport.views import TORCH_DTYPES
from ...plan import get_plan
from ...plan.types import TransferPlan
from ...wire.protocol import RankMap, RefitRequest
from ...training.ranks import TrainerRank
from ...transport.executor import TransferOptions, execute_plan
from ...transport.group import RefitGroup

__all__ = ["gather_layout", "hf_buckets", "BroadcastStats", "broadcast_send", "broadcast_receive", "BroadcastJoin",
           "SendStats", "JoinBroadcast", "SendBroadcast", "LeaveBroadcast", "HFBroadcastWorkerExtension",
           "HFBroadcastTransport", "HF_BROADCAST_EXTENSION", "HF_PREFIX", "reload_weights"]

HF_PREFIX = "mcore_reshard/hf"

#: The worker extension of an engine that runs the baseline (and every diagnostic).
HF_BROADCAST_EXTENSION = "mcore_reshard.refit.transports.hf_broadcast.HFBroadcastWorkerExtension"


def gather_layout(tensors: Mapping[str, tuple[tuple[int, ...], str]]) -> SideLayout:
    """Destination layout "rank 0 holds every canonical tensor whole" (the HF export target)."""
    params = []
    for name, (shape, dtype) in tensors.items():
        shape = tuple(shape)
        piece = Piece(0, name, name, Box.full(shape), View(0, shape, contiguous_strides(shape)))
        params.append(LocalParam(0, name, shape, dtype, (piece,)))
    return SideLayout("hf-gather", 1, tuple(params), dict(tensors))


def hf_buckets(tensors: Mapping[str, tuple[tuple[int, ...], str]], buffer_bytes: int) -> list[list[str]]:
    """Canonical names in model order, grouped into buckets of at most ``buffer_bytes``
    (a tensor larger than that travels alone) and of one dtype (a bucket is one flat tensor:
    DeepSeek's fp32 router bias in a bf16 model starts a bucket of its own). Both ends derive
    the same buckets."""
    buckets: list[list[str]] = [[]]
    used, current = 0, None
    for name, (shape, dtype) in tensors.items():
        n = _nbytes(shape, dtype)
        if buckets[-1] and (used + n > buffer_bytes or dtype != current):
            buckets.append([])
            used = 0
        current = dtype
        buckets[-1].append(name)
        used += n
    return [b for b in buckets if b]


def _nbytes(shape, dtype: str) -> int:
    return math.prod(shape) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class BroadcastStats:
    """One end's share of a broadcast (a vLLM worker's reply to ``mr_hf_receive``)."""

    bytes_sent: int  # by the root, counted once per receiver (what the wire carries)
    bytes_received: int
    buckets: int
    seconds: float
    peak_extra_bytes: int

    def to_wire(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "BroadcastStats":
        return BroadcastStats(int(d["bytes_sent"]), int(d["bytes_received"]), int(d["buckets"]), float(d["seconds"]),
                              int(d["peak_extra_bytes"]))


def broadcast_send(full: Mapping[str, torch.Tensor], tensors: Mapping[str, tuple[tuple[int, ...], str]], group,
                   *, buffer_bytes: int, timeout_s: float) -> BroadcastStats:
    """Root side: broadcast every full tensor, bucket by bucket, to every other group rank."""
    t0 = time.perf_counter()
    sent = peak = 0
    buckets = hf_buckets(tensors, buffer_bytes)
    for names in buckets:
        flat = torch.cat([full[n].reshape(-1) for n in names])
        peak = max(peak, flat.numel() * flat.element_size())
        group.broadcast(flat, root=group.rank, timeout_s=timeout_s)
        sent += flat.numel() * flat.element_size() * (group.world_size - 1)
    return BroadcastStats(sent, 0, len(buckets), time.perf_counter() - t0, peak)


def broadcast_receive(tensors: Mapping[str, tuple[tuple[int, ...], str]], group, root: int,
                      consume: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                      *, buffer_bytes: int, timeout_s: float) -> BroadcastStats:
    """Receiver side: hand ``consume`` a stream of (HF name, full tensor) as buckets land.

    Each bucket gets a fresh buffer: vLLM's layerwise reload keeps references to loaded
    tensors until their layer is complete.
    """
    t0 = time.perf_counter()
    stats = {"bytes": 0, "buckets": 0, "peak": 0}

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for names in hf_buckets(tensors, buffer_bytes):
            dtype = TORCH_DTYPES[tensors[names[0]][1]]
            numel = sum(math.prod(tensors[n][0]) for n in names)
            flat = torch.empty(numel, dtype=dtype)
            group.broadcast(flat, root=root, timeout_s=timeout_s)
            stats["bytes"] += flat.numel() * flat.element_size()
            stats["buckets"] += 1
            stats["peak"] = max(stats["peak"], flat.numel() * flat.element_size())
            pos = 0
            for n in names:
                shape = tuple(tensors[n][0])
                k = math.prod(shape)
                yield n, flat[pos : pos + k].view(shape)
                pos += k

    consume(stream())
    return BroadcastStats(0, stats["bytes"], stats["buckets"], time.perf_counter() - t0, stats["peak"])


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


# ---------------------------------------------------------------------------- engine end


@dataclass(frozen=True)
class BroadcastJoin:
    """Where a vLLM worker joins the broadcast group: training rank 0 is group rank 0, engine
    ``e``'s workers follow from ``dst_offset`` (its first destination rank)."""

    host: str
    port: int
    world: int
    timeout_s: float
    dst_offset: int = 0
    secret: str = ""

    def to_wire(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> "BroadcastJoin":
        return BroadcastJoin(str(d["host"]), int(d["port"]), int(d["world"]), float(d["timeout_s"]),
                             int(d.get("dst_offset", 0)), str(d.get("secret", "")))


def reload_weights(worker: Any, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load (HF name, full tensor) pairs through vLLM's layerwise reload, its own loaders cutting
    this worker's part. vLLM 0.32 CPU forgets the MoE pad + prepack on reload: it must run on
    the rebuilt model-format layer before the copy into the (padded, prepacked) kernel tensors,
    so the copy is patched for the duration of this reload only."""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise
    from vllm.config import set_current_vllm_config

    original = layerwise._copy_and_restore_kernel_tensors

    def copy_after_prepack(layer: Any, info: Any) -> None:
        reprepack_cpu_moe(layer)  # no-op off CPU and for layers without w13_weight
        original(layer, info)

    layerwise._copy_and_restore_kernel_tensors = copy_after_prepack
    forget = getattr(getattr(worker, "weight_transfer_engine", None), "forget_baselines", None)
    if forget is not None:  # weights change outside a refit: the next refit is full
        forget()
    try:
        with set_current_vllm_config(worker.vllm_config):
            worker.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)
    finally:
        layerwise._copy_and_restore_kernel_tensors = original


class HFBroadcastWorkerExtension(ReshardWorkerExtension):
    """Engine end: the diagnostics extension plus the broadcast group's calls, for engines that
    run the baseline. Mixed into vLLM's worker class; ``self`` is the worker."""

    def mr_hf_join(self, join: dict) -> int:
        """Join the broadcast group (``BroadcastJoin`` on the wire); returns this worker's group rank."""
        j = BroadcastJoin.from_wire(join)
        me = 1 + j.dst_offset + int(self.rank)  # type: ignore[attr-defined]
        self.mr_hf_leave()
        dev = "cuda" if str(self.device).startswith("cuda") else "cpu"  # type: ignore[attr-defined]
        self._mr_hf_group = RefitGroup.create(j.host, j.port, me, j.world, j.timeout_s, is_master=False,
                                              prefix=HF_PREFIX, device=dev, secret=j.secret)
        return me

    def mr_hf_receive(self, buffer_bytes: int, timeout_s: float) -> dict:
        """Receive every full HF tensor and reload through vLLM's loaders (``BroadcastStats``
        on the wire)."""
        from ...adapters.vllm.weight_transfer import canonical_tensors, served_spec

        # vLLM's loaders take the checkpoint's shapes (gpt-oss's interleaved gate/up: the plan
        # addresses the same storage in a finer shape, ``ModelSpec.checkpoint_shapes``)
        shapes = served_spec(self.vllm_config).checkpoint_shapes()  # type: ignore[attr-defined]

        def load(stream: Iterable[tuple[str, torch.Tensor]]) -> None:
            reload_weights(self, ((n, t.view(shapes[n]) if n in shapes else t) for n, t in stream))

        stats = broadcast_receive(canonical_tensors(self.vllm_config), self._mr_hf_group, 0,  # type: ignore[attr-defined]
                                  load, buffer_bytes=buffer_bytes, timeout_s=timeout_s)
        return stats.to_wire()

    def mr_hf_leave(self) -> None:
        g = getattr(self, "_mr_hf_group", None)
        if g is not None:
            g.close(barrier=False)
            self._mr_hf_group = None


# ---------------------------------------------------------------------------- driver end


def _runs_baseline(extension: str) -> bool:
    """Whether an engine's worker extension (qualified name) has the baseline's engine end."""
    mod, _, name = extension.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name) if mod else None
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, HFBroadcastWorkerExtension)


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
        missing = [e for e, info in enumerate(driver.engine_infos) if not _runs_baseline(info.worker_extension)]
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
        errors = driver.on_engines(lambda llm, _: dst_stats.extend(BroadcastStats.from_wire(w) for w in llm.collective_rpc(
            "mr_hf_receive", args=(cfg.buffer_bytes, request.timeout_s))))
        try:
            src_stats = sending.wait()
        except Exception:
            self._joined = None
            raise
        seconds = time.perf_counter() - t0
        if errors:
            self._joined = None
            raise RefitFailed("hf_broadcast: " + "; ".join(errors))
        for llm in driver.engines:
            llm.reset_prefix_cache()
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
        joins = [BroadcastJoin(driver.host, port, world, timeout_s, lo, driver.secret).to_wire()
                 for lo in driver.engine_offsets]
        errors = driver.on_engines(lambda llm, join: llm.collective_rpc("mr_hf_join", args=(join,)), joins)
        joining.wait()
        if errors:
            raise RefitFailed("hf_broadcast join: " + "; ".join(errors))
        self._joined = driver

    def close(self, driver: RefitDriver) -> None:
        """Both ends leave the broadcast group."""
        if self._joined is driver:
            self._joined = None
        driver.on_engines(lambda llm, _: llm.collective_rpc("mr_hf_leave"), what="hf_leave", deadline_s=30.0)
        driver.trainers.run(LeaveBroadcast()).wait()
