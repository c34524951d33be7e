"""vLLM worker extension: what vLLM's weight-transfer API cannot carry.

Refits themselves go through the registered weight-transfer engine
(``backend/engine.py``); this extension is only a diagnostic: recording descriptors
(``mr_describe``), status, the received copy for ``verify=full``, the raw-bandwidth probe and
live checksums. A driver plans a plain engine from the rules instead. Use with
``LLM(..., worker_extension_cls="mcore_reshard.adapters.vllm.worker.ReshardWorkerExtension")``
and ``llm.collective_rpc("mr_describe")`` (or ``engine.describe(llm)``); replies are the typed
messages of ``protocol.py`` in their wire form (``WorkerLayout``, ``WorkerStatus``,
``ReceivedWeights``): nothing is pickled.

With ``MCORE_RESHARD_PLAIN_LINEAR=1`` in the environment (``start_engine(direct=True)``),
importing this module in a worker replaces vLLM's CPU GEMM dispatch so dense linears keep
their weights in model format (plain ``F.linear``): refits can then write them in place,
as on CUDA. vLLM imports the extension class before it loads the model.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import torch

from ...infra.checkpoint import load_canonical
from ...layout.descriptor import LocalParam
from ...transport.views import ReceivedWeights
from ...wire.protocol import WorkerLayout, WorkerStatus
from ...transport.views import box_slices
from .apply import RefitIncomplete, VllmApplier, select_modes
from .fp8 import engine_fp8, engine_holds, quantized_checkpoint
from .layers import owner
from .record import canonical_tensors, record_local_params, served_spec

__all__ = ["ReshardWorkerExtension", "REFIT_EXTENSION", "PLAIN_LINEAR_ENV", "install_plain_linear"]

REFIT_EXTENSION = "mcore_reshard.adapters.vllm.worker.ReshardWorkerExtension"

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


def _tensor_checksums(model: torch.nn.Module, skip: set[int]) -> dict[str, str]:
    """sha256 of each parameter and buffer of ``model`` but those in ``skip`` (by id)."""
    out: dict[str, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in skip:
            b = t.detach().contiguous().cpu().reshape(-1)
            out[name] = hashlib.sha256(b.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


class ReshardWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` etc.)."""

    # -- helpers (not RPC targets) -------------------------------------------------------
    def _mr_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _mr_served(self) -> torch.nn.Module:
        """What refits write: the engine's target-and-draft tree where it has one."""
        eng = self._mr_engine()
        return eng.served if eng is not None else self._mr_model()

    def _mr_engine(self) -> Any:
        """This worker's ``mcore_reshard`` weight-transfer engine, or None."""
        from .backend.engine import ReshardWeightTransferEngine

        eng = getattr(self, "weight_transfer_engine", None)
        return eng if isinstance(eng, ReshardWeightTransferEngine) else None

    def mr_params(self) -> list[LocalParam]:
        """Recorded pieces of this worker (recorded once, cached; the engine's when it has one)."""
        eng = self._mr_engine()
        if eng is not None:
            return eng.params()
        cached = getattr(self, "_mr_cached_params", None)
        if cached is None:
            tensors = canonical_tensors(self.vllm_config)  # type: ignore[attr-defined]
            recorded = record_local_params(
                self._mr_model(), tensors, self.mr_rank_info()["rank"],
                vllm_config=self.vllm_config, device=self.mr_rank_info()["device"],  # type: ignore[attr-defined]
                checkpoint=served_spec(self.vllm_config).checkpoint_shapes(),  # type: ignore[attr-defined]
            )
            cached = engine_holds(self._mr_model(), recorded, tensors, self.vllm_config)  # type: ignore[attr-defined]
            self._mr_cached_params = cached
        return cached

    def mr_applier(self, atomic: bool = False) -> VllmApplier:
        """The applier a transport feeds with ``write(local_name, view, tensor)``."""
        ap = getattr(self, "_mr_current_applier", None)
        if ap is None or ap.atomic != atomic:
            if ap is not None and ap.state == "not_serving":
                ap.check_serving()
            new = VllmApplier(self._mr_served(), self.mr_params(), atomic=atomic,
                              device=self.mr_rank_info()["device"])
            if ap is not None:
                new.inherit(ap)
            ap = self._mr_current_applier = new
        return ap

    # -- RPC methods --------------------------------------------------------------------
    def mr_describe(self) -> list:
        """This worker's destination pieces (model format, local = named_parameters names):
        ``WorkerLayout`` on the wire (vLLM's RPC serializer would turn dataclasses into dicts)."""
        return WorkerLayout(tuple(self.mr_params())).to_wire()

    def mr_rank_info(self) -> dict[str, Any]:
        """Global rank in the engine and the tp/pp/dp coordinates of this worker."""
        from vllm.distributed import parallel_state as ps

        par = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return {
            "pid": os.getpid(),
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
        return select_modes(self._mr_served(), self.mr_params())

    def mr_status(self) -> dict[str, Any]:
        """Serving state of this worker's model, the version it holds, and the agreed outcome
        of the last refit: ``WorkerStatus`` on the wire (``ReshardWeightTransferEngine.status``)."""
        eng = self._mr_engine()
        ap = getattr(self, "_mr_current_applier", None)
        if eng is not None and (ap is None or ap.state == "serving"):
            # A diagnostics load (``mr_load_canonical``) that left the weights whole is what a
            # loader does: the weight-transfer engine's status (the version a driver's refit
            # checks) stays this worker's. One that left them torn is reported below.
            return eng.status().to_wire()
        return (WorkerStatus() if ap is None else WorkerStatus(ap.state, ap.reason)).to_wire()

    def mr_received(self) -> dict[str, Any]:
        """``verify=full``: this rank's model-format parameters after the last refit
        (``ReceivedWeights`` on the wire): live values where the kernel keeps model format,
        else the copy the engine kept while receiving."""
        eng = self._mr_engine()
        received = eng.received if eng is not None else None
        if received is None:
            raise RuntimeError("mr_received needs a refit with verify=full first")
        modes = self.mr_modes()
        params = dict(self._mr_served().named_parameters())
        tensors, where = {}, {}
        for name, copy in received.items():
            live = params.get(name)
            direct = modes.get(name) == "direct" and live is not None and tuple(live.shape) == tuple(copy.shape)
            tensors[name] = live.detach().cpu().clone() if direct else copy
            where[name] = "live" if direct else "received"
        return ReceivedWeights(tensors, where).to_wire()

    def mr_raw_bandwidth(self, pairs: list[tuple[int, int]], nbytes: int, timeout_s: float) -> float | None:
        """Benchmark floor over the engine's refit group (see ``RefitEndpoint.raw_bandwidth``)."""
        eng = self._mr_engine()
        if eng is None or eng.endpoint is None:
            raise RuntimeError("mr_raw_bandwidth needs a joined mcore_reshard weight-transfer engine")
        return eng.endpoint.raw_bandwidth([tuple(p) for p in pairs], nbytes, timeout_s)

    def mr_load_canonical(self, path: str, atomic: bool = False,
                          only: Sequence[str] | None = None, stop_after: int | None = None,
                          then: str = "abort") -> dict[str, str]:
        """Test helper: apply a checkpoint directory through the recorded pieces, exactly as
        a refit applies received bytes. ``only`` limits it to some local params;
        ``stop_after`` stops after that many writes and calls ``then`` (``abort`` or
        ``finish``) to exercise the failure paths."""
        canon = load_canonical(path)
        fp8 = engine_fp8(self.vllm_config)  # type: ignore[attr-defined]
        if fp8 is not None:  # codes and scales, as the senders quantize (``transport.quantize``)
            canon = quantized_checkpoint(canon, fp8, self.vllm_config.model_config.dtype)  # type: ignore[attr-defined]
        eng = self._mr_engine()
        if eng is not None:  # weights change outside a refit: the next refit is full
            eng.forget_baselines()
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
        params = dict(self._mr_served().named_parameters())
        for name, mode in modes.items():
            if names is not None and name not in names:
                continue
            if mode != "direct":
                out[name] = None
                continue
            t = params[name].detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        return out

    def mr_draft_checksums(self) -> dict[str, str]:
        """sha256 of every tensor the speculative-decoding draft computes with (parameters and
        buffers, in whatever format its kernels keep them; the ones it shares with the target
        excepted): two engines that hold the same draft agree on every one."""
        draft = self.model_runner.get_draft_model()  # type: ignore[attr-defined]
        return _tensor_checksums(draft, {id(t) for t in [*self._mr_model().parameters(), *self._mr_model().buffers()]})

    def mr_served_checksums(self) -> dict[str, str]:
        """sha256 of every tensor the target model computes with (parameters and buffers, in
        whatever format its kernels keep them: packed linears, an FP8 layer's packed codes and
        scales): two engines that serve the same weights agree on every one."""
        return _tensor_checksums(self._mr_model(), set())

    def mr_lora_slots(self, names: Sequence[str]) -> dict[str, list]:
        """The LoRA slot tensors ``names`` (``lora_rules.slot_name``) as this worker's LoRA
        layers hold them, as nested lists (diagnostics: the layouts checked against vLLM's own
        ``set_lora``)."""
        model = self._mr_model()
        return {name: owner(model, name)[0].value.detach().float().cpu().tolist() for name in names}

    def mr_draft_layout(self) -> dict[str, Any]:
        """The speculative-decoding draft model this worker holds (diagnostics: the draft's
        layout checked against vLLM's own): its parameters' names and shapes, and whether its
        embedding and output head are the target's own tensors."""
        draft = self.model_runner.get_draft_model()  # type: ignore[attr-defined]
        target = self._mr_model()
        params = {n: list(t.shape) for n, t in draft.named_parameters()}
        inner = getattr(draft, "model", draft)
        heads = [layer.shared_head.head for layer in getattr(inner, "layers", {}).values() if hasattr(layer, "shared_head")]
        return {"params": params,
                "shares_embed": getattr(inner, "embed_tokens", None) is target.model.embed_tokens,
                "shares_head": bool(heads) and all(h is target.lm_head for h in heads)}

    def _mr_after_update(self) -> None:
        """Invalidate the runner's caches derived from the old weights. Not its encoder cache:
        the scheduler keeps the record of which encoder outputs exist, and dropping the
        worker's tensors alone makes the next request of a cached image fail ("Encoder cache
        miss"); the engine drops both at once (``engine.reset_encoder_cache``)."""
        mr = self.model_runner  # type: ignore[attr-defined]
        for fn in ("reset_lora_state", "reset_mm_cache"):
            if hasattr(mr, fn):
                getattr(mr, fn)()
