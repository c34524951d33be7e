"""The hybrid families' in-process verification: megatron-core's real ``HybridModel`` ranks
holding a checkpoint's weights refit vLLM's own model class, compared bit for bit with vLLM's
own load of the same checkpoint.

``megatron_hybrid_job`` runs on each rank of a megatron world (``run_world``): it builds the
family's real megatron-core modules on CPU (``adapters.megatron.hybrid_build``), checks that
they hold exactly the parameters the family's table predicts (names, shapes), loads the HF
checkpoint into them through those predictions, and returns the rank's tensors.
``refit_inproc`` builds vLLM's model class for each TP rank (``vllm_inproc``), loads it from
another checkpoint (so every stale value is real), records its layout with vLLM's own
loaders, plans, runs the plan into the applier as a refit would, and returns each rank's
``kernel_state``; ``reference_states`` is vLLM's own load. Test scaffolding only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..layout import load_model_spec
from .vllm_inproc import build_vllm_model, kernel_state, load_hf

__all__ = ["megatron_hybrid_job", "refit_inproc", "reference_states"]


def megatron_hybrid_job(ctx: Any, ckpt: str, dtype: str, par_kwargs: dict) -> dict:
    """One megatron rank: build, check names against the rules, load the checkpoint."""
    from ..adapters.megatron.build import init_megatron
    from ..adapters.megatron.hybrid_build import build_hybrid
    from ..adapters.megatron.live import describe
    from ..adapters.megatron.rules import MegatronParallel, megatron_rank_params
    from ..infra.checkpoint import load_canonical
    from ..transport.views import TORCH_DTYPES, materialize_local

    spec = load_model_spec(ckpt, dtype=dtype)
    par = MegatronParallel(**par_kwargs)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    (model,) = build_hybrid(spec, par)
    model.to(TORCH_DTYPES[dtype])  # as Float16Module casts a bf16 policy
    live = dict(model.named_parameters())
    live.update((n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))
    want = megatron_rank_params(spec, par, ctx.rank)
    got_shapes = {n: tuple(t.shape) for n, t in live.items()}
    want_shapes = {lp.name: tuple(lp.shape) for lp in want}
    canon = load_canonical(ckpt)
    out = {}
    with torch.no_grad():
        for lp in want:
            if lp.name in live:
                live[lp.name].copy_(materialize_local(lp, canon))
                # what the endpoint sends: the described dtype (A_log fp32: a bf16 model's copy widened)
                out[lp.name] = live[lp.name].detach().to(TORCH_DTYPES[lp.dtype]).clone()
    # the live adapter's own check (names, shapes, dtypes: A_log narrower only where the table widens it)
    described = describe([model], spec) if got_shapes == want_shapes else None
    return dict(rank=ctx.rank, tensors=out, shapes_equal=got_shapes == want_shapes, described=described == want,
                only_megatron=sorted(set(got_shapes) - set(want_shapes)),
                only_rules=sorted(set(want_shapes) - set(got_shapes)),
                shape_diff=sorted(n for n in set(got_shapes) & set(want_shapes) if got_shapes[n] != want_shapes[n]))


def reference_states(ckpt: str | Path, dtype: str, tp: int, **engine: Any) -> list[dict[str, torch.Tensor]]:
    """vLLM's own load of ``ckpt`` on every TP rank, as ``kernel_state`` (``engine``: more
    ``EngineArgs``)."""
    out = []
    for r in range(tp):
        m = build_vllm_model(ckpt, dtype, tp, r, **engine)
        load_hf(m)
        with m.active():
            out.append(kernel_state(m.model))
    return out


def refit_inproc(ckpt: str | Path, stale: str | Path, dtype: str, tp: int, src_layout: Any,
                 src_tensors: Mapping[int, Mapping[str, torch.Tensor]], *, rebind: bool = True,
                 record: bool = True, engine: Mapping[str, Any] | None = None) -> dict:
    """Refit vLLM's model (TP ``tp``, loaded from ``stale``) from megatron's tensors; returns
    the plan, each rank's state before and after, and the recorded layouts. ``record=False``:
    the destination is the rules' layout as it is (a loader vLLM's recorder cannot follow:
    Qwen3-VL-MoE's transposed stacked experts), so a wrong rule shows as a state that differs
    from vLLM's own load."""
    from ..adapters.vllm.apply import VllmApplier
    from ..adapters.vllm.record import record_local_params
    from ..layout.descriptor import SideLayout
    from ..plan.planner import build_plan
    from ..transport.views import TORCH_DTYPES, local_view
    from .local_plan import run_plan_locally

    spec = load_model_spec(ckpt, dtype=dtype)
    models, params = [], []
    for r in range(tp):
        m = build_vllm_model(ckpt, dtype, tp, r, **dict(engine or {}))
        load_hf(_Retarget(m, stale))  # the stale weights the refit must replace
        if not record:
            from ..adapters.vllm.rules import VllmParallel, vllm_rank_params

            params.append(vllm_rank_params(spec, VllmParallel(tp=tp, **dict(engine or {})), r))
            models.append(m)
            continue
        with m.active():
            params.append(record_local_params(m.model, spec.tensor_table(), r))
        models.append(m)
    dst = SideLayout("vllm-inproc", tp, tuple(p for ps in params for p in ps), spec.tensor_table(), ())
    plan = build_plan(src_layout, dst, allow_cast=True)
    buffers = {r: {lp.name: torch.zeros(lp.shape, dtype=TORCH_DTYPES[lp.dtype]) for lp in params[r]} for r in range(tp)}
    moved = run_plan_locally(plan, src_tensors, buffers)
    before, after, modes = [], [], []
    for r, m in enumerate(models):
        with m.active():
            before.append({k: v.clone() for k, v in kernel_state(m.model).items()})
            app = VllmApplier(m.model, params[r], atomic=True, rebind=rebind)
            modes.append(dict(app.modes))
            app.begin()
            for lp in params[r]:
                for p in lp.pieces:
                    app.write(lp.name, p.view, local_view(buffers[r][lp.name], p.view))
            app.finish()
            after.append(kernel_state(m.model))
    return dict(plan=plan, moved=moved, before=before, after=after, modes=modes, params=params)


class _Retarget:
    """An ``InprocModel`` whose loader reads another checkpoint directory (same config)."""

    def __init__(self, m: Any, path: str | Path) -> None:
        self.model, self.active = m.model, m.active
        cfg = m.vllm_config
        self.vllm_config = _with_model_path(cfg, str(path))


def _with_model_path(cfg: Any, path: str) -> Any:
    import copy

    out = copy.copy(cfg)
    out.model_config = copy.copy(cfg.model_config)
    out.model_config.model = path
    return out
