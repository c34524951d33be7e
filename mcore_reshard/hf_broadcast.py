"""The HF-conversion broadcast path: the baseline every benchmark compares with.

What RL stacks ship today, in its reasonably efficient form: the training ranks gather every
tensor whole in HF names and layout on training rank 0 (here through a gather plan, which is
cheaper than the per-tensor all-gathers of an HF export, so the baseline is not handicapped),
rank 0 broadcasts bucket after bucket of full tensors to every vLLM worker, and each worker
lets vLLM's own loaders cut out its part inside vLLM's layerwise reload. Every inference rank
receives the whole model.

Both ends live here: :func:`hf_send` runs on every training rank (gather, then rank 0
broadcasts) and :class:`HFBroadcastWorkerMethods` is mixed into the vLLM worker extension
(join the broadcast group, receive, reload through vLLM's own loaders).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from .layout.descriptor import DTYPE_BYTES, Box, LocalParam, Piece, SideLayout, View, contiguous_strides
from .layout.torch_views import TORCH_DTYPES

__all__ = ["gather_layout", "hf_buckets", "BroadcastStats", "broadcast_send", "broadcast_receive", "hf_send",
           "HFBroadcastWorkerMethods", "HF_PREFIX"]

HF_PREFIX = "mcore_reshard/hf"


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
    bytes_sent: int  # by the root, counted once per receiver (what the wire carries)
    bytes_received: int
    buckets: int
    seconds: float
    peak_extra_bytes: int


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


def hf_send(gather_plan, src_rank: int, num_src: int, local: Mapping[str, torch.Tensor],
            tensors: Mapping[str, tuple[tuple[int, ...], str]], refit_group, hf_group, *, buffer_bytes: int,
            timeout_s: float) -> dict:
    """Training side of the baseline, on every training rank: gather every tensor whole on
    rank 0 (HF names and layout) over the refit group, then rank 0 broadcasts them bucket by
    bucket to every vLLM worker over ``hf_group``."""
    from .protocol import RankMap
    from .transport.executor import execute_plan

    t0 = time.perf_counter()
    rank_map = RankMap(tuple(range(num_src)), (0,))  # gather into training rank 0
    full = None
    if src_rank == 0:
        full = {n: torch.empty(shape, dtype=TORCH_DTYPES[dt]) for n, (shape, dt) in tensors.items()}
    gather = execute_plan(gather_plan.for_rank("src", src_rank), gather_plan.for_rank("dst", 0) if full is not None else None,
                          local, full, refit_group, rank_map, timeout_s=timeout_s, verify=False)
    peak = gather.peak_extra_bytes
    if full is not None:
        sent = broadcast_send(full, tensors, hf_group, buffer_bytes=buffer_bytes, timeout_s=timeout_s)
        peak += sent.peak_extra_bytes + sum(t.numel() * t.element_size() for t in full.values())
    return {"gather_bytes": gather.bytes_received, "gather_seconds": gather.seconds,
            "seconds": time.perf_counter() - t0, "peak_extra_bytes": peak}


class HFBroadcastWorkerMethods:
    """Mixed into the vLLM worker extension; ``self`` is the vLLM worker."""

    def mr_hf_join(self, host: str, port: int, world: int, timeout_s: float, dst_offset: int = 0,
                   secret: str = "") -> int:
        """Join the baseline's broadcast group: training rank 0 is group rank 0."""
        from .transport.group import RefitGroup

        me = 1 + dst_offset + int(self.rank)  # type: ignore[attr-defined]
        old = getattr(self, "_mr_hf_group", None)
        if old is not None:
            old.close(barrier=False)
        dev = "cuda" if str(self.device).startswith("cuda") else "cpu"  # type: ignore[attr-defined]
        self._mr_hf_group = RefitGroup.create(host, port, me, world, timeout_s, is_master=False, prefix=HF_PREFIX,
                                              device=dev, secret=secret)
        return me

    def mr_hf_receive(self, buffer_bytes: int, timeout_s: float) -> dict:
        """Receive every full HF tensor and let vLLM's loaders cut this rank's part, inside
        vLLM's layerwise reload (then re-prepack CPU MoE kernels, which 0.32 forgets)."""
        from dataclasses import asdict

        import vllm.model_executor.model_loader.reload.layerwise as layerwise
        from vllm.config import set_current_vllm_config

        from .adapters.vllm.apply import _reprepack_cpu_moe
        from .adapters.vllm.weight_transfer import canonical_tensors

        def consume(stream: Iterable[tuple[str, torch.Tensor]]) -> None:
            # vLLM 0.32 CPU forgets the MoE pad + prepack on reload; it must run on the rebuilt
            # model-format layer before the copy into the (padded, prepacked) kernel tensors.
            original = layerwise._copy_and_restore_kernel_tensors

            def copy_after_prepack(layer, info):
                _reprepack_cpu_moe(layer)  # no-op off CPU and for layers without w13_weight
                original(layer, info)

            layerwise._copy_and_restore_kernel_tensors = copy_after_prepack
            try:
                with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                    self.model_runner.reload_weights(weights_iterator=stream, is_checkpoint_format=True)  # type: ignore[attr-defined]
            finally:
                layerwise._copy_and_restore_kernel_tensors = original

        stats = broadcast_receive(canonical_tensors(self.vllm_config), self._mr_hf_group, 0, consume,  # type: ignore[attr-defined]
                                  buffer_bytes=buffer_bytes, timeout_s=timeout_s)
        return asdict(stats)

    def mr_hf_leave(self) -> None:
        g = getattr(self, "_mr_hf_group", None)
        if g is not None:
            g.close(barrier=False)
            self._mr_hf_group = None


def refit_hf_broadcast(driver: Any, state: dict) -> Any:
    """Run the baseline with a driver's trainers and engines (the refit group must exist: the
    gather runs over it). ``state`` keeps the broadcast group and gather plan between calls."""

    from .driver import RefitMetrics
    from .plan import get_plan
    from .ports import free_port

    cfg = driver.refit_config
    tensors = driver.src.tensors
    if "gather_plan" not in state:
        state["gather_plan"] = get_plan(driver.src, gather_layout(tensors), bucket_bytes=cfg.bucket_bytes)
    if not state.get("joined"):
        port, world = free_port(driver.host), 1 + driver.dst.world_size
        driver.trainers.submit("hf_join", driver.host, port, world, cfg.timeout_s, driver.secret)
        # Every engine joins at once: creating the group is a rendezvous of all its ranks.
        errors = driver._on_engines(
            lambda llm, offset: llm.collective_rpc("mr_hf_join", args=(driver.host, port, world, cfg.timeout_s, offset,
                                                                       driver.secret)), driver._offsets)
        driver.trainers.collect()
        if errors:
            from .errors import RefitFailed

            raise RefitFailed("hf_broadcast join: " + "; ".join(errors))
        state["joined"] = True
    t0 = time.perf_counter()
    driver.trainers.submit("hf_send", state["gather_plan"], cfg.buffer_bytes, cfg.timeout_s)
    errors = driver._on_engines(lambda llm, _: state.setdefault("dst", []).extend(
        llm.collective_rpc("mr_hf_receive", args=(cfg.buffer_bytes, cfg.timeout_s))))
    src_stats = driver.trainers.collect()
    seconds = time.perf_counter() - t0
    if errors:
        state["joined"] = False
        from .errors import RefitFailed

        raise RefitFailed("hf_broadcast: " + "; ".join(errors))
    dst_stats, state["dst"] = state.pop("dst", []), []
    for llm in driver.engines:
        llm.reset_prefix_cache()
    gather_bytes = sum(s["gather_bytes"] for s in src_stats)
    phases = {"gather": max(s["gather_seconds"] for s in src_stats),
              "root": max(s["seconds"] for s in src_stats),
              "receive_and_reload": max(s["seconds"] for s in dst_stats)}
    return RefitMetrics(
        transport="hf_broadcast",
        bytes_moved=gather_bytes + sum(s["bytes_received"] for s in dst_stats),
        bytes_min=driver.plan.bytes_min,
        seconds=seconds,
        transfer_seconds=max([s["seconds"] for s in dst_stats] + [s["seconds"] for s in src_stats]),
        peak_extra_bytes=max([s["peak_extra_bytes"] for s in dst_stats] + [s["peak_extra_bytes"] for s in src_stats]),
        verified=False,
        notes=("no checksum verification on the baseline path; checked by logprobs",),
        phases={k: round(v, 6) for k, v in phases.items()},
    )
