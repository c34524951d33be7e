"""vLLM worker extension: control-plane methods run inside every worker.

Use with ``LLM(..., worker_extension_cls="mcore_reshard.adapters.vllm.worker.ReshardWorkerExtension")``
and ``llm.collective_rpc("mr_describe")``. Arguments and results are control messages
(picklable descriptors, names, checksums); bulk bytes travel over a separate data plane,
which plugs in by subclassing and feeding :meth:`ReshardWorkerExtension.mr_applier`.

With ``MCORE_RESHARD_PLAIN_LINEAR=1`` in the environment (``start_engine(direct=True)``),
importing this module in a worker replaces vLLM's CPU GEMM dispatch so dense linears keep
their weights in model format (plain ``F.linear``): refits can then write them in place,
as on CUDA. vLLM imports the extension class before it loads the model.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Sequence

import torch

from ...layout.descriptor import LocalParam
from .apply import RefitIncomplete, VllmApplier, select_modes
from .record import record_local_params

__all__ = ["ReshardWorkerExtension", "PLAIN_LINEAR_ENV", "install_plain_linear"]

PLAIN_LINEAR_ENV = "MCORE_RESHARD_PLAIN_LINEAR"


def _plain_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement for ``dispatch_cpu_unquantized_gemm``: no repacking, weights stay as loaded."""
    layer.cpu_linear = torch.nn.functional.linear


def install_plain_linear() -> None:
    """Make CPU dense linears compute from ``layer.weight`` with ``F.linear`` (model format)."""
    import vllm.model_executor.layers.utils as lu

    lu.dispatch_cpu_unquantized_gemm = _plain_cpu_gemm


if os.environ.get(PLAIN_LINEAR_ENV) == "1":
    install_plain_linear()


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` etc.)."""

    # -- helpers (not RPC targets) -------------------------------------------------------
    def _mr_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _mr_canonical_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Canonical HF tensors of the served model (names, shapes), from its HF config."""
        from ...layout.spec import spec_from_hf_config

        mc = self.vllm_config.model_config  # type: ignore[attr-defined]
        dtype = str(mc.dtype).replace("torch.", "")
        spec = spec_from_hf_config(mc.hf_config, dtype=dtype)
        return spec.tensor_table()

    def mr_params(self) -> list[LocalParam]:
        """Recorded pieces of this worker (recorded once, cached)."""
        cached = getattr(self, "_mr_cached_params", None)
        if cached is None:
            cached = record_local_params(
                self._mr_model(), self._mr_canonical_tensors(), self.mr_rank_info()["rank"],
                vllm_config=self.vllm_config, device=self.mr_rank_info()["device"],  # type: ignore[attr-defined]
            )
            self._mr_cached_params = cached
        return cached

    def mr_applier(self, atomic: bool = False) -> VllmApplier:
        """The applier a transport feeds with ``write(local_name, view, tensor)``."""
        ap = getattr(self, "_mr_current_applier", None)
        if ap is None or ap.atomic != atomic:
            if ap is not None and ap.state == "not_serving":
                ap.check_serving()
            ap = VllmApplier(self._mr_model(), self.mr_params(), atomic=atomic,
                             device=self.mr_rank_info()["device"])
            self._mr_current_applier = ap
        return ap

    # -- RPC methods --------------------------------------------------------------------
    def mr_describe(self) -> bytes:
        """This worker's destination pieces (model format, local = named_parameters names),
        pickled: vLLM's RPC serializer turns dataclasses into dicts (``engine.describe``
        unpickles)."""
        return pickle.dumps(list(self.mr_params()))

    def mr_rank_info(self) -> dict[str, Any]:
        """Global rank in the engine and the tp/pp/dp coordinates of this worker."""
        from vllm.distributed import parallel_state as ps

        par = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return {
            "rank": int(self.rank),  # type: ignore[attr-defined]
            "local_rank": int(getattr(self, "local_rank", 0)),
            "tp_rank": ps.get_tp_group().rank_in_group, "tp_size": ps.get_tp_group().world_size,
            "pp_rank": ps.get_pp_group().rank_in_group, "pp_size": ps.get_pp_group().world_size,
            "dp_rank": par.data_parallel_rank, "dp_size": par.data_parallel_size,
            "enable_ep": bool(par.enable_expert_parallel),
            "device": str(self.device),  # type: ignore[attr-defined]
        }

    def mr_modes(self) -> dict[str, str]:
        """Per local parameter: ``direct`` (in-place) or ``reload`` (layerwise lifecycle)."""
        return select_modes(self._mr_model(), self.mr_params())

    def mr_status(self) -> dict[str, str]:
        ap = getattr(self, "_mr_current_applier", None)
        return {"state": "serving" if ap is None else ap.state, "reason": "" if ap is None else ap.reason}

    def mr_begin(self, atomic: bool = False) -> None:
        self.mr_applier(atomic).begin()

    def mr_finish(self) -> None:
        self.mr_applier(self._mr_current_applier.atomic).finish()  # type: ignore[attr-defined]
        self._mr_after_update()

    def mr_abort(self, reason: str = "aborted") -> dict[str, str]:
        ap = getattr(self, "_mr_current_applier", None)
        if ap is not None:
            try:
                ap.abort(reason)
            except RuntimeError:
                pass  # state says not_serving; reported below
        return self.mr_status()

    def mr_load_canonical(self, path: str, atomic: bool = False,
                          only: Sequence[str] | None = None, stop_after: int | None = None,
                          then: str = "abort") -> dict[str, str]:
        """Test helper: apply a checkpoint directory through the recorded pieces, exactly as
        a refit applies received bytes. ``only`` limits it to some local params;
        ``stop_after`` stops after that many writes and calls ``then`` (``abort`` or
        ``finish``) to exercise the failure paths."""
        from ...layout.torch_views import box_slices
        from ...testing.tiny import load_canonical

        canon = load_canonical(path)
        ap = self.mr_applier(atomic)
        ap.begin()
        n = 0
        try:
            for lp in self.mr_params():
                if only is not None and lp.name not in only:
                    continue
                for pc in lp.pieces:
                    if stop_after is not None and n >= stop_after:
                        if then == "finish":
                            ap.finish()
                        else:
                            try:
                                ap.abort(f"aborted after {n} writes")
                            except RefitIncomplete:
                                pass  # reported by the status below
                        return self.mr_status()
                    ap.write(lp.name, pc.view, canon[pc.canonical][box_slices(pc.box)])
                    n += 1
            ap.finish()
        except BaseException:
            if ap.state == "updating":
                try:
                    ap.abort("failed")
                except RuntimeError:
                    pass  # already not_serving; the original error is more useful
            raise
        self._mr_after_update()
        return self.mr_status()

    def mr_param_checksums(self, names: Sequence[str] | None = None) -> dict[str, str | None]:
        """sha256 of each live parameter where the engine keeps model format (``direct``);
        None where the kernel repacks it (compare outputs there instead)."""
        modes = self.mr_modes()
        out: dict[str, str | None] = {}
        params = dict(self._mr_model().named_parameters())
        for name, mode in modes.items():
            if names is not None and name not in names:
                continue
            if mode != "direct":
                out[name] = None
                continue
            t = params[name].detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        return out

    def mr_sample_params(self, names: Sequence[str]) -> dict[str, list]:
        """Live values of a few (small) parameters, as lists (test helper)."""
        params = dict(self._mr_model().named_parameters())
        return {n: params[n].detach().float().cpu().flatten().tolist() for n in names}

    def _mr_after_update(self) -> None:
        """Invalidate caches derived from the old weights (prefix cache keys stay valid
        only for the same weights)."""
        mr = self.model_runner  # type: ignore[attr-defined]
        for fn in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(mr, fn):
                getattr(mr, fn)()
