"""Data-plane methods of the worker extension: join the refit group, receive a plan's bytes
into the live model (through :class:`VllmApplier`), or receive the HF-broadcast baseline.

RPC arguments and results are control messages: plain values or pickled bytes (vLLM's RPC
serializer turns dataclasses into dicts, so dataclasses travel pickled).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

__all__ = ["TransferMethods", "RefitWorkerExtension", "REFIT_EXTENSION"]


class TransferMethods:
    """Mixed into the worker extension; ``self`` is the vLLM worker."""

    def _mr_dst_rank(self, dst_offset: int) -> int:
        return dst_offset + int(self.rank)  # type: ignore[attr-defined]

    def mr_join(self, host: str, port: int, world: int, rank_map_bytes: bytes, timeout_s: float,
                dst_offset: int = 0) -> int:
        """Join the refit group (once; reused by every refit). Returns the group rank."""
        from ...transport.group import RefitGroup

        rank_map = pickle.loads(rank_map_bytes)
        old = getattr(self, "_mr_group", None)
        if old is not None:
            old.close(barrier=False)
        self._mr_dst = self._mr_dst_rank(dst_offset)
        me = rank_map.group_rank("dst", self._mr_dst)
        self._mr_group = RefitGroup.create(host, port, me, world, timeout_s, is_master=False, rank_map=rank_map,
                                           device=self._mr_transport_device())
        return me

    def _mr_transport_device(self) -> str:
        dev = str(self.device)  # type: ignore[attr-defined]
        return "cuda" if dev.startswith("cuda") else "cpu"

    def mr_set_plan(self, slices: dict[int, bytes], digest: str, slice_digests: dict[int, str]) -> str:
        """Keep this worker's slice of the plan (sent once per layout; refits then name the
        plan by digest, so per-refit RPCs stay small control messages). The slice is re-hashed
        here: what this rank runs is provably what the driver cut for it."""
        plan_slice = pickle.loads(slices[self._mr_dst])
        if plan_slice.side != "dst" or plan_slice.rank != self._mr_dst or plan_slice.digest() != slice_digests[self._mr_dst]:
            raise RuntimeError(f"vLLM worker {self._mr_dst}: the plan slice received does not match its digest")
        self._mr_plan = (digest, plan_slice)
        return slice_digests[self._mr_dst]

    def mr_refit(self, digest: str, verify: bool, timeout_s: float, atomic: bool = False,
                 keep_received: bool = False) -> bytes:
        return _as_reply(self._mr_refit, digest, verify, timeout_s, atomic, keep_received)

    def _mr_refit(self, digest: str, verify: bool, timeout_s: float, atomic: bool,
                  keep_received: bool) -> Any:
        """Receive this worker's slice of the plan and apply it; returns (``TransferStats``,
        apply-phase seconds), sent back as ``("ok", ...)`` by :func:`_as_reply`.

        On any failure the applier aborts: the engine keeps serving the old weights if nothing
        live was touched, else it is marked not serving (``mr_status``) and the error says so.
        ``keep_received`` keeps a model-format copy of every received parameter for the full
        verification (:meth:`mr_received`), at the cost of one copy of this rank's weights.
        """
        from ...transport.executor import execute_plan

        group = getattr(self, "_mr_group", None)
        if group is None:
            raise RuntimeError("mr_refit before mr_join")
        held, plan_slice = getattr(self, "_mr_plan", (None, None))
        if held != digest:
            raise RuntimeError(f"vLLM worker {self._mr_dst}: asked to run plan {digest}, holds {held}")
        applier = self.mr_applier(atomic)  # type: ignore[attr-defined]
        sink: Any = applier
        self._mr_received = None
        if keep_received:
            sink = _Tee(applier, self.mr_params())  # type: ignore[attr-defined]
            self._mr_received = sink.copies
        applier.begin()
        try:
            stats = execute_plan(None, plan_slice, {}, sink, group, timeout_s=timeout_s, verify=verify,
                                 plan_digest=digest)
            t0 = time.perf_counter()
            applier.finish()
            finish_s = time.perf_counter() - t0
        except BaseException as exc:
            try:
                applier.abort(f"refit failed: {exc}")
            finally:
                group.close(barrier=False)  # a failed group is broken: mr_join makes a new one
                self._mr_group = None
            raise
        self._mr_after_update()  # type: ignore[attr-defined]
        return stats, dict(applier.timings, finish=finish_s)

    def mr_received(self) -> bytes:
        """Full verification: this rank's model-format parameters after the last refit, pickled
        ``{local_name: tensor}``. Live values where the kernel keeps model format (direct
        mode), else the received copy (``mr_refit(keep_received=True)``)."""
        received = getattr(self, "_mr_received", None)
        if received is None:
            raise RuntimeError("mr_received needs a refit with keep_received=True first")
        modes = self.mr_modes()  # type: ignore[attr-defined]
        params = dict(self._mr_model().named_parameters())  # type: ignore[attr-defined]
        out = {}
        for name, copy in received.items():
            live = params.get(name)
            direct = modes.get(name) == "direct" and live is not None and tuple(live.shape) == tuple(copy.shape)
            out[name] = (live.detach().cpu().clone() if direct else copy, "live" if direct else "received")
        return pickle.dumps(out)

    def mr_hf_join(self, host: str, port: int, world: int, timeout_s: float, dst_offset: int = 0) -> int:
        """Join the baseline's broadcast group: training rank 0 is group rank 0."""
        from ...transport.group import RefitGroup

        me = 1 + self._mr_dst_rank(dst_offset)
        self._mr_hf_group = RefitGroup.create(host, port, me, world, timeout_s, is_master=False,
                                              prefix="mcore_reshard/hf", device=self._mr_transport_device())
        return me

    def mr_hf_receive(self, buffer_bytes: int, timeout_s: float) -> bytes:
        return _as_reply(self._mr_hf_receive, buffer_bytes, timeout_s)

    def _mr_hf_receive(self, buffer_bytes: int, timeout_s: float) -> Any:
        """Baseline: receive every full HF tensor and let vLLM's loaders cut this rank's part,
        inside vLLM's layerwise reload (then re-prepack CPU MoE kernels, which 0.32 forgets)."""
        from vllm.config import set_current_vllm_config

        from ...baseline import broadcast_receive
        from .apply import _reprepack_cpu_moe

        tensors = self._mr_canonical_tensors()  # type: ignore[attr-defined]

        import vllm.model_executor.model_loader.reload.layerwise as layerwise

        def consume(stream: Any) -> None:
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

        stats = broadcast_receive(tensors, self._mr_hf_group, 0, consume, buffer_bytes=buffer_bytes,
                                  timeout_s=timeout_s)
        self._mr_after_update()  # type: ignore[attr-defined]
        return stats

    def mr_raw_bandwidth(self, pairs: list[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        """Benchmark floor: one ``nbytes`` message per (source, destination) group-rank pair,
        over the refit group; bytes/s of this worker's pair (None when in none)."""
        from ...transport.executor import raw_send_bandwidth

        group = self._mr_group
        mine = [(s, d) for s, d in pairs if group.rank in (s, d)]
        return raw_send_bandwidth(group, *mine[0], nbytes, timeout_s) if mine else None

    def mr_leave(self) -> None:
        for attr in ("_mr_group", "_mr_hf_group"):
            g = getattr(self, attr, None)
            if g is not None:
                g.close(barrier=False)
                setattr(self, attr, None)


def _as_reply(fn: Any, *args: Any) -> bytes:
    """Run a data-plane method and always answer, with ``("ok", result)`` or ``("error",
    message)``, pickled. A worker that raised inside ``collective_rpc`` would leave its
    peers' replies queued and poison the next RPC; an error as data keeps the control plane
    in step, and the driver raises with every rank's message."""
    import traceback

    try:
        return pickle.dumps(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001 - returned to the driver, which raises
        return pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))


class _Tee:
    """Sink that applies every write and keeps a model-format copy of it (full verification)."""

    def __init__(self, applier: Any, params: Any) -> None:
        import torch

        from ...layout.torch_views import TORCH_DTYPES

        self.applier = applier
        self.params = applier.params  # the executor reads the wire dtype from here
        self.copies = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in params}

    def write(self, local_name: str, view: Any, tensor: Any) -> None:
        from ...layout.torch_views import local_view

        self.applier.write(local_name, view, tensor)
        local_view(self.copies[local_name], view).copy_(tensor)


def _extension_class():
    from .worker import ReshardWorkerExtension

    class RefitWorkerExtension(TransferMethods, ReshardWorkerExtension):
        """The worker extension a refit engine runs: descriptors, apply path, data plane."""

    return RefitWorkerExtension


RefitWorkerExtension = _extension_class()
REFIT_EXTENSION = "mcore_reshard.adapters.vllm.transfer_ext.RefitWorkerExtension"
