"""The HF-broadcast baseline's engine end in a vLLM engine: the worker extension that joins the
broadcast group and reloads what arrives through vLLM's own loaders, and the calls a driver
makes on such an engine (``refit.transports.hf_broadcast``: the driver and trainer ends).
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

import torch

from ...transport.broadcast import HF_PREFIX, BroadcastJoin, BroadcastStats, broadcast_receive
from ...transport.group import RefitGroup
from .engine import engine_info, is_multimodal, reset_encoder_cache
from .layers import reprepack_cpu_moe
from .record import canonical_tensors, served_spec
from .worker import ReshardWorkerExtension

__all__ = ["HF_BROADCAST_EXTENSION", "HFBroadcastWorkerExtension", "reload_weights", "runs_baseline", "hf_join",
           "hf_receive", "hf_leave"]

#: The worker extension of an engine that runs the baseline (and every diagnostic).
HF_BROADCAST_EXTENSION = "mcore_reshard.adapters.vllm.hf_baseline.HFBroadcastWorkerExtension"


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


# ---------------------------------------------------------------------------- the driver's calls


def runs_baseline(dest: Any) -> bool:
    """Whether a destination's engine was started with the baseline's engine end."""
    engine = getattr(dest, "engine", None)
    if engine is None:
        return False
    mod, _, name = engine_info(engine).worker_extension.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name) if mod else None
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, HFBroadcastWorkerExtension)


def hf_join(dest: Any, join: BroadcastJoin) -> None:
    dest.engine.collective_rpc("mr_hf_join", args=(join.to_wire(),))


def hf_receive(dest: Any, buffer_bytes: int, timeout_s: float) -> list[BroadcastStats]:
    """Every worker receives the whole model and reloads it; then the old weights' cached KV
    goes, and a multimodal encoder's cached outputs (the whole model changed)."""
    got = [BroadcastStats.from_wire(w) for w in dest.engine.collective_rpc("mr_hf_receive",
                                                                          args=(buffer_bytes, timeout_s))]
    dest.engine.reset_prefix_cache()
    if is_multimodal(dest.engine):
        reset_encoder_cache(dest.engine)
    return got


def hf_leave(dest: Any) -> None:
    dest.engine.collective_rpc("mr_hf_leave")

