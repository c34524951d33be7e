"""A Megatron-Core LoRA policy's adapters as boxes of the canonical PEFT tensors.

The layout is Megatron-Bridge's (``megatron/bridge/peft/utils.py:ParallelLinearAdapter``): each
adapted module ``M`` gets ``M.adapter.linear_in.weight`` (A) and ``M.adapter.linear_out.weight``
(B), and

- a column-parallel base (``linear_qkv``, ``linear_fc1``): A is split along the rank, rows
  ``[tp_r * r/tp, (tp_r+1) * r/tp)`` (its output all-gathered), B along its output rows exactly
  as the base weight's: ``linear_qkv``'s per-query-group ``[q_g; k_g; v_g]`` runs,
  ``linear_fc1``'s ``[gate_r; up_r]``. Its one A is the canonical A of every projection the
  module fuses (Bridge exports it under each).
- a row-parallel base (``linear_proj``, ``linear_fc2``): A is split along its input columns as
  the base weight is, B along its output rows (all-gathered in the forward).

Pure metadata, like ``rules.py``; its templates and rank coordinates are reused from there.
"""

from __future__ import annotations

from ...layout import LayoutError, LocalParam, ModelSpec, Piece, SideLayout
from ...layout.lora import PeftConfig, adapter_tensors, expert_lora_name, lora_name
from .rules import (MegatronParallel, _chunk_prefix, _col_parallel, _qkv_pieces, _row_parallel, _rows, _swiglu_fc1,
                    rank_coords, stage_layers)

__all__ = ["megatron_lora_layout", "megatron_lora_rank_params"]


def _check(spec: ModelSpec, par: MegatronParallel, peft: PeftConfig) -> None:
    tp, r = par.tp, peft.dim
    column = [m for m in peft.modules if m in ("linear_qkv", "linear_fc1")]
    if column and r % tp:
        raise LayoutError(f"peft.dim={r}: Megatron-Bridge splits the A of {column} along the rank over "
                          f"tensor_model_parallel_size={tp}, which must divide it")
    if any(m in peft.modules for m in ("linear_proj", "linear_fc2")) and spec.hidden % tp:
        raise LayoutError(f"peft: the B of linear_proj/linear_fc2 is split over tp={tp}, which must divide "
                          f"hidden_size={spec.hidden}")


def _layer(spec: ModelSpec, par: MegatronParallel, peft: PeftConfig, layer: int, prefix: str, tp_r: int):
    """Templates (local name, shape, pieces) of one decoder layer's adapters on TP rank ``tp_r``."""
    H, tp, r, D = spec.hidden, par.tp, peft.dim, spec.head_dim
    rows_a = r // tp
    out = []
    for module in peft.modules:
        if module in ("linear_fc1", "linear_fc2") and spec.is_moe(layer):
            continue  # the routed experts': ``_expert_adapters``
        base = prefix + ("self_attention." if module in ("linear_qkv", "linear_proj") else "mlp.") + module
        a_name, b_name = base + ".adapter.linear_in.weight", base + ".adapter.linear_out.weight"
        if module == "linear_qkv":
            projs = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
            out.append((a_name, (rows_a, H), tuple(_rows(0, lora_name(layer, p, "lora_A"), tp_r * rows_a, rows_a, H)
                                                   for p in projs)))
            pieces, rows = _qkv_pieces(spec, tp, tp_r, f"model.layers.{layer}.self_attn.", r, "lora_B.weight")
            out.append((b_name, (rows, r), pieces))
        elif module == "linear_fc1":
            gate, up = "mlp.gate_proj", "mlp.up_proj"
            out.append((a_name, (rows_a, H), tuple(_rows(0, lora_name(layer, p, "lora_A"), tp_r * rows_a, rows_a, H)
                                                   for p in (gate, up))))
            out.append(_swiglu_fc1(b_name, lora_name(layer, gate, "lora_B"), lora_name(layer, up, "lora_B"),
                                   spec.intermediate, r, tp, tp_r))
        else:  # row-parallel bases
            proj, k = (("self_attn.o_proj", spec.num_heads * D) if module == "linear_proj"
                       else ("mlp.down_proj", spec.intermediate))
            out.append(_row_parallel(a_name, lora_name(layer, proj, "lora_A"), r, k, tp, tp_r))
            out.append(_col_parallel(b_name, lora_name(layer, proj, "lora_B"), H, r, tp, tp_r))
    return out


def _expert_adapters(spec: ModelSpec, par: MegatronParallel, peft: PeftConfig, layer: int, prefix: str, ep_r: int,
                     etp_r: int):
    """Templates of one MoE layer's routed-expert adapters on (ep_r, etp_r): each local expert's
    ``linear_fc1`` / ``linear_fc2`` adapted as a dense module is, over the expert-TP group
    (Bridge's adapters on expert linears: ``is_expert=True``); global expert = ep_r * E/ep + i."""
    if par.experts != "sequential":
        raise LayoutError("peft: adapters on grouped experts (TEGroupedMLP) are not described; use "
                          "moe_grouped_gemm=false (SequentialMLP) or exclude linear_fc1/linear_fc2")
    H, F, etp, r = spec.hidden, spec.moe_intermediate, par.etp_size, peft.dim
    n_local = spec.num_experts // par.ep
    out = []
    for i in range(n_local):
        e = ep_r * n_local + i
        name = lambda proj, part: expert_lora_name(layer, e, proj, part)  # noqa: E731
        base = f"{prefix}mlp.experts.local_experts.{i}."
        if "linear_fc1" in peft.modules:
            if r % etp:
                raise LayoutError(f"peft.dim={r}: Megatron-Bridge splits the A of the experts' linear_fc1 along the "
                                  f"rank over expert_tensor_parallel_size={etp}, which must divide it")
            a = base + "linear_fc1.adapter.linear_in.weight"
            out.append((a, (r // etp, H), tuple(_rows(0, name(p, "lora_A"), etp_r * (r // etp), r // etp, H)
                                                for p in ("gate_proj", "up_proj"))))
            out.append(_swiglu_fc1(base + "linear_fc1.adapter.linear_out.weight", name("gate_proj", "lora_B"),
                                   name("up_proj", "lora_B"), F, r, etp, etp_r))
        if "linear_fc2" in peft.modules:
            out.append(_row_parallel(base + "linear_fc2.adapter.linear_in.weight", name("down_proj", "lora_A"),
                                     r, F, etp, etp_r))
            out.append(_col_parallel(base + "linear_fc2.adapter.linear_out.weight", name("down_proj", "lora_B"),
                                     H, r, etp, etp_r))
    return out


def megatron_lora_rank_params(spec: ModelSpec, par: MegatronParallel, peft: PeftConfig, rank: int) -> list[LocalParam]:
    """The adapter parameters of one training rank (names as ``named_parameters`` gives them)."""
    _check(spec, par, peft)
    c = rank_coords(par, rank)
    dt = peft.lora_dtype or spec.dtype
    out: list[LocalParam] = []
    for v, chunk in enumerate(stage_layers(spec.num_layers, par)[c["pp"]]):
        for i, layer in enumerate(chunk):
            prefix = f"{_chunk_prefix(par, v)}decoder.layers.{i}."
            experts = (_expert_adapters(spec, par, peft, layer, prefix, c["ep"], c["etp"])
                       if spec.is_moe(layer) and {"linear_fc1", "linear_fc2"} & set(peft.modules) else [])
            for name, shape, pieces in _layer(spec, par, peft, layer, prefix, c["tp"]) + experts:
                out.append(LocalParam(rank, name, shape, dt, tuple(Piece(rank, name, cn, b, vw)
                                                                   for cn, b, vw in pieces)))
    return out


def megatron_lora_layout(spec: ModelSpec, par: MegatronParallel, peft: PeftConfig) -> SideLayout:
    """Every training rank's adapters: the source side of an adapter refit."""
    params = [p for rank in range(par.world_size) for p in megatron_lora_rank_params(spec, par, peft, rank)]
    return SideLayout("megatron-lora", par.world_size, tuple(params), adapter_tensors(spec, peft),
                      (f"lora: r={peft.dim} alpha={peft.alpha:g} on {', '.join(peft.modules)} (Megatron-Bridge layout)",))
