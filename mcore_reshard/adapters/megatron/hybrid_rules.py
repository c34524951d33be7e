"""megatron-core 0.19 ``HybridModel`` layouts (Nemotron-H, Qwen3-Next) as pure functions.

A hybrid's decoder is megatron's pattern string (``layout.hybrid.megatron_pattern``), one
megatron layer per symbol, each built by ``models/hybrid/hybrid_block.HybridStack`` from its
spec (``mamba_layer``, ``gdn_layer``, ``attention_layer``, ``mlp_layer``, ``moe_layer``). What
each holds on a TP rank (``ssm/mamba_mixer.py``, ``ssm/gated_delta_net/``):

* ``MambaMixer``: ``in_proj`` is one ``ColumnParallelLinear`` whose rank-local rows are
  ``[z_r | x_r | B_r | C_r | dt_r]`` (each component split on its own, ``partition_sizes``),
  so a plain gather interleaves ranks: five row boxes of HF's ``in_proj`` per rank;
  ``conv1d_weight`` / ``conv1d_bias`` are ``[x_r | B_r | C_r]`` (three boxes); ``A_log``,
  ``D``, ``dt_bias`` split by head, the gated ``norm`` by channel, ``out_proj`` row-parallel.
  megatron asserts ``nheads % tp == 0`` and ``ngroups % tp == 0``;
* ``GatedDeltaNet``: ``in_proj`` rank-local rows ``[q_r | k_r | v_r | z_r | b_r | a_r]``
  (``in_proj_split_sections``), key heads and value heads split by TP; HF's
  ``in_proj_qkvz`` groups the same rows per key head ``[q_g; k_g; v_g; z_g]`` and
  ``in_proj_ba`` ``[b_g; a_g]``: four boxes per key head in qkvz and two in ba;
  ``conv1d.weight`` is ``[q_r | k_r | v_r]`` (three boxes of HF's ``[q; k; v]``); ``A_log``,
  ``dt_bias`` by value head; ``out_norm`` (one head's width) replicated;
* gated attention (``attention_output_gate``, Qwen3-Next): ``linear_qkv`` per KV group
  ``[q (P heads) | gate (P heads) | k | v]``; HF's ``q_proj`` holds ``[q_h; gate_h]`` per head;
* Nemotron-H's MLPs and experts are not gated (relu2): ``linear_fc1`` is ``up_proj`` alone.

Stages: without ``|`` in the pattern megatron slices the layer list evenly or by
``num_layers_in_first/last_pipeline_stage`` (``select_pipeline_segment``), which the
project's ``stage_layers`` computes; virtual stages need ``|`` patterns and are refused.
Norms: the local spec keeps each layer's input norm separate (``norm`` for Mamba,
``input_layernorm`` / ``pre_mlp_layernorm`` elsewhere); the TE spec fuses it into the first
linear (``layer_norm_weight``), except a MoE layer's ``pre_mlp_layernorm``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from ...layout import LayoutError, LocalParam, ModelSpec, SideLayout
from ...layout.hybrid import A_LOG_DTYPE, megatron_layer_role, megatron_pattern
from .rules import (HYBRID_RULES, MegatronParallel, _full, _qkv_pieces, _row_parallel, _rows, _stamp, _swiglu_fc1, _Tmpl, _vocab_rows,
                    padded_vocab, rank_coords, stage_layers)

__all__ = ["check_hybrid", "hybrid_rank_params", "hybrid_layout"]


def check_hybrid(spec: ModelSpec, par: MegatronParallel) -> None:
    """What megatron-core refuses for this hybrid and layout, in one line naming the tensor."""
    h, tp, fam = spec.hybrid, par.tp, spec.arch
    assert h is not None
    for f in ("tp", "pp", "ep", "cp", "dp"):
        if getattr(par, f) < 1:
            raise LayoutError(f"parallel size {f}={getattr(par, f)} must be >= 1")
    if par.vpp > 1:
        raise LayoutError(f"{fam}: virtual pipeline stages need '|' stage boundaries in megatron's "
                          "hybrid_layer_pattern (select_pipeline_segment); use vpp=1")
    if par.layer_spec not in ("local", "te") or par.experts not in ("sequential", "grouped"):
        raise LayoutError(f"layer_spec={par.layer_spec!r} / experts={par.experts!r} not known")
    m, g = h.mamba, h.gdn
    if m is not None and "M" in h.mixers:
        if m.heads % tp:
            raise LayoutError(f"{fam}: mixer.in_proj / A_log / D: mamba_num_heads={m.heads} must be divisible by "
                              f"megatron tp={tp} (MambaMixer splits heads); choose a tp that divides it")
        if m.groups % tp:
            raise LayoutError(f"{fam}: mixer.in_proj B/C: n_groups={m.groups} must be divisible by megatron tp={tp} "
                              "(MambaMixer asserts ngroups % tp == 0; vLLM alone replicates groups)")
        if m.heads % m.groups:
            raise LayoutError(f"{fam}: mamba_num_heads={m.heads} must be divisible by n_groups={m.groups}")
    if g is not None and "G" in h.mixers:
        for what, n in (("linear_num_key_heads", g.k_heads), ("linear_num_value_heads", g.v_heads)):
            if n % tp:
                raise LayoutError(f"{fam}: linear_attn.in_proj_qkvz: {what}={n} must be divisible by megatron "
                                  f"tp={tp} (GatedDeltaNet splits heads by TP)")
    if "*" in h.mixers:
        ng = spec.num_kv_heads
        if spec.num_heads % tp:
            raise LayoutError(f"{fam}: self_attn.q_proj: num_attention_heads={spec.num_heads} must be divisible by tp={tp}")
        if ng % tp and tp % ng:
            raise LayoutError(f"{fam}: self_attn.k_proj: num_query_groups={ng} must be a multiple or divisor of tp={tp}")
        if h.attn_gate and ng < tp:
            raise LayoutError(f"{fam}: self_attn.q_proj (gated): num_key_value_heads={ng} < tp={tp} splits a KV "
                              "group's [q | gate | k | v] block; not supported")
    symbols = set(megatron_pattern(spec))
    if "-" in symbols and spec.intermediate % tp:
        raise LayoutError(f"{fam}: mlp up_proj: intermediate_size={spec.intermediate} must be divisible by tp={tp}")
    if "E" in symbols:
        if spec.num_experts % par.ep:
            raise LayoutError(f"{fam}: mlp experts: num_experts={spec.num_experts} must be divisible by ep={par.ep}")
        if spec.moe_intermediate % par.etp_size:
            raise LayoutError(f"{fam}: experts' up_proj: moe_intermediate_size={spec.moe_intermediate} must be "
                              f"divisible by etp={par.etp_size}")
        if spec.shared_intermediate % tp:
            raise LayoutError(f"{fam}: shared expert up_proj: {spec.shared_intermediate} must be divisible by tp={tp}")
    elif par.ep > 1:
        raise LayoutError(f"{fam}: expert_model_parallel_size={par.ep} needs MoE layers")
    if (par.tp * par.cp * par.dp) % (par.etp_size * par.ep):
        raise LayoutError(f"world_size={par.world_size} is not divisible by etp*ep*pp={par.etp_size * par.ep * par.pp}")
    stage_layers(len(megatron_pattern(spec)), par)


def _split_rows(name: str, shape: tuple[int, ...], parts: list[tuple[str, int, int]], tail: int | None) -> _Tmpl:
    """A local tensor of consecutive row runs: ``(canonical, canonical row0, rows)`` each,
    ``tail`` the elements per row (None: a vector; the shape's trailing dims otherwise)."""
    out, at = [], 0
    for canonical, row0, n in parts:
        if n:
            out.append(_rows3(at, canonical, row0, n, shape[1:]) if tail is not None else _rows(at, canonical, row0, n, None))
        at += n
    return (name, shape, tuple(out))


def _rows3(local_row: int, canonical: str, row0: int, nrows: int, rest: tuple[int, ...]):
    """Row runs of a tensor of any rank (a conv weight ``[C, 1, k]``)."""
    from ...layout import Box, View, contiguous_strides

    inner = 1
    for d in rest:
        inner *= d
    shape = (nrows, *rest)
    return (canonical, Box((row0, *(0 for _ in rest)), shape), View(local_row * inner, shape, contiguous_strides(shape)))


def _mamba(spec: ModelSpec, par: MegatronParallel, pre: str, hf: str, r: int) -> list[_Tmpl]:
    m, H, tp = spec.hybrid.mamba, spec.hidden, par.tp
    di, gs, nh = m.d_inner // tp, m.groups * m.state // tp, m.heads // tp
    x = "mixer."
    ip = hf + "in_proj.weight"
    B0 = 2 * m.d_inner
    out = [_split_rows(pre + x + "in_proj.weight", (2 * di + 2 * gs + nh, H), [
        (ip, r * di, di), (ip, m.d_inner + r * di, di), (ip, B0 + r * gs, gs),
        (ip, B0 + m.groups * m.state + r * gs, gs), (ip, B0 + 2 * m.groups * m.state + r * nh, nh)], H)]
    conv_parts = lambda c: [(c, r * di, di), (c, m.d_inner + r * gs, gs), (c, m.d_inner + m.groups * m.state + r * gs, gs)]
    out.append(_split_rows(pre + x + "conv1d_weight", (di + 2 * gs, 1, m.conv_kernel), conv_parts(hf + "conv1d.weight"), 1))
    if m.conv_bias:
        out.append(_split_rows(pre + x + "conv1d_bias", (di + 2 * gs,), conv_parts(hf + "conv1d.bias"), None))
    for p in ("dt_bias", "A_log", "D"):
        out.append((pre + x + p, (nh,), (_rows(0, hf + p, r * nh, nh, None),)))
    out.append((pre + x + "norm.weight", (di,), (_rows(0, hf + "norm.weight", r * di, di, None),)))
    out.append(_row_parallel(pre + x + "out_proj.weight", hf + "out_proj.weight", H, m.d_inner, tp, r))
    return out


def _gdn(spec: ModelSpec, par: MegatronParallel, pre: str, hf: str, r: int) -> list[_Tmpl]:
    g, H, tp = spec.hybrid.gdn, spec.hidden, par.tp
    nk, nv = g.k_heads // tp, g.v_heads // tp
    R, G = g.ratio, g.group_rows
    qkvz, ba = hf + "in_proj_qkvz.weight", hf + "in_proj_ba.weight"
    sec = [nk * g.k_dim, nk * g.k_dim, nv * g.v_dim, nv * g.v_dim, nv, nv]  # q k v z b a
    starts = [sum(sec[:i]) for i in range(6)]
    pieces = []
    for i in range(nk):
        kh = r * nk + i  # global key head (its group in HF's interleaved layout)
        pieces += [_rows(starts[0] + i * g.k_dim, qkvz, kh * G, g.k_dim, H),
                   _rows(starts[1] + i * g.k_dim, qkvz, kh * G + g.k_dim, g.k_dim, H),
                   _rows(starts[2] + i * R * g.v_dim, qkvz, kh * G + 2 * g.k_dim, R * g.v_dim, H),
                   _rows(starts[3] + i * R * g.v_dim, qkvz, kh * G + 2 * g.k_dim + R * g.v_dim, R * g.v_dim, H),
                   _rows(starts[4] + i * R, ba, kh * 2 * R, R, H),
                   _rows(starts[5] + i * R, ba, kh * 2 * R + R, R, H)]
    pieces.sort(key=lambda t: t[2].offset)
    sa = pre + "self_attention."
    qk = g.k_heads * g.k_dim
    conv = hf + "conv1d.weight"
    out = [(sa + "in_proj.weight", (sum(sec), H), tuple(pieces)),
           _split_rows(sa + "conv1d.weight", (2 * nk * g.k_dim + nv * g.v_dim, 1, g.conv_kernel),
                       [(conv, r * nk * g.k_dim, nk * g.k_dim), (conv, qk + r * nk * g.k_dim, nk * g.k_dim),
                        (conv, 2 * qk + r * nv * g.v_dim, nv * g.v_dim)], 1)]
    for p in ("dt_bias", "A_log"):
        out.append((sa + p, (nv,), (_rows(0, hf + p, r * nv, nv, None),)))
    out.append(_full(sa + "out_norm.weight", hf + "norm.weight", (g.v_dim,)))
    out.append(_row_parallel(sa + "out_proj.weight", hf + "out_proj.weight", H, g.v_heads * g.v_dim, tp, r))
    return out


def _gated_qkv(spec: ModelSpec, par: MegatronParallel, name: str, attn: str, r: int) -> _Tmpl:
    """``linear_qkv`` with an output gate: per KV group ``[q (P heads) | gate (P) | k | v]``
    rows; HF's ``q_proj`` keeps ``[q_h; gate_h]`` per head (each a ``head_dim`` run)."""
    H, D, ng, tp = spec.hidden, spec.head_dim, spec.num_kv_heads, par.tp
    P = spec.num_heads // ng
    groups = ng // tp
    pieces, at = [], 0
    for gi in range(groups):
        g = r * groups + gi
        for part in (0, 1):  # q then gate, head by head
            for j in range(P):
                pieces.append(_rows(at, attn + "q_proj.weight", ((g * P + j) * 2 + part) * D, D, H))
                at += D
        pieces.append(_rows(at, attn + "k_proj.weight", g * D, D, H))
        pieces.append(_rows(at + D, attn + "v_proj.weight", g * D, D, H))
        at += 2 * D
    return (name, (at, H), tuple(pieces))


def _attention(spec: ModelSpec, par: MegatronParallel, pre: str, attn: str, r: int) -> list[_Tmpl]:
    H, tp = spec.hidden, par.tp
    sa = pre + "self_attention."
    out = [_row_parallel(sa + "linear_proj.weight", attn + "o_proj.weight", H, spec.num_heads * spec.head_dim, tp, r)]
    if spec.hybrid.attn_gate:
        out.append(_gated_qkv(spec, par, sa + "linear_qkv.weight", attn, r))
    else:
        pieces, rows = _qkv_pieces(spec, tp, r, attn, H, "weight")
        out.append((sa + "linear_qkv.weight", (rows, H), pieces))
    if spec.qk_norm:
        out.append(_full(sa + "q_layernorm.weight", attn + "q_norm.weight", (spec.head_dim,)))
        out.append(_full(sa + "k_layernorm.weight", attn + "k_norm.weight", (spec.head_dim,)))
    return out


def _fc1(name: str, mlp: str, F: int, H: int, n: int, r: int, plain: bool) -> _Tmpl:
    if plain:
        f = F // n
        return (name, (f, H), (_rows(0, mlp + "up_proj.weight", r * f, f, H),))
    return _swiglu_fc1(name, mlp + "gate_proj.weight", mlp + "up_proj.weight", F, H, n, r)


def _layer(spec: ModelSpec, par: MegatronParallel, j: int, pre: str, r: int) -> list[_Tmpl]:
    """Non-expert parameters of megatron layer ``j`` (prefix ``pre``) on TP rank ``r``."""
    h, H, tp = spec.hybrid, spec.hidden, par.tp
    te = par.layer_spec == "te"
    i, sym = megatron_layer_role(spec, j)
    hp = h.layer_prefix(i)
    nemo = h.family == "nemotron_h"
    mixer = hp + "mixer." if nemo else hp + ("linear_attn." if sym == "G" else "self_attn." if sym == "*" else "mlp.")
    in_norm = hp + ("norm.weight" if nemo else "input_layernorm.weight")
    ffn_norm = hp + ("norm.weight" if nemo else "post_attention_layernorm.weight")
    if sym == "M":
        norm = pre + ("mixer.in_proj.layer_norm_weight" if te else "norm.weight")
        return [_full(norm, in_norm, (H,))] + _mamba(spec, par, pre, mixer, r)
    if sym == "G":
        norm = pre + ("self_attention.in_proj.layer_norm_weight" if te else "input_layernorm.weight")
        return [_full(norm, in_norm, (H,))] + _gdn(spec, par, pre, mixer, r)
    if sym == "*":
        norm = pre + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight")
        return [_full(norm, in_norm, (H,))] + _attention(spec, par, pre, mixer, r)
    if sym == "-":
        F = spec.intermediate
        norm = pre + ("mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight")
        return [_full(norm, ffn_norm, (H,)), _fc1(pre + "mlp.linear_fc1.weight", mixer, F, H, tp, r, h.plain_mlp),
                _row_parallel(pre + "mlp.linear_fc2.weight", mixer + "down_proj.weight", H, F, tp, r)]
    out = [_full(pre + "pre_mlp_layernorm.weight", ffn_norm, (H,)),
           _full(pre + "mlp.router.weight", mixer + "gate.weight", (spec.num_experts, H))]
    if spec.router_bias:
        out.append(_full(pre + "mlp.router.expert_bias", mixer + "gate.e_score_correction_bias", (spec.num_experts,)))
    if spec.shared_intermediate:
        S, sh = spec.shared_intermediate, mixer + ("shared_experts." if nemo else "shared_expert.")
        out.append(_fc1(pre + "mlp.shared_experts.linear_fc1.weight", sh, S, H, tp, r, h.plain_mlp))
        out.append(_row_parallel(pre + "mlp.shared_experts.linear_fc2.weight", sh + "down_proj.weight", H, S, tp, r))
    if h.shared_gate:
        out.append(_full(pre + "mlp.shared_experts.gate_weight", mixer + "shared_expert_gate.weight", (1, H)))
    return out


def _experts(spec: ModelSpec, par: MegatronParallel, j: int, pre: str, ep_r: int, etp_r: int) -> list[_Tmpl]:
    i, sym = megatron_layer_role(spec, j)
    if sym != "E":
        return []
    h, H, F, etp = spec.hybrid, spec.hidden, spec.moe_intermediate, par.etp_size
    n = spec.num_experts // par.ep
    mixer = h.layer_prefix(i) + ("mixer." if h.family == "nemotron_h" else "mlp.")
    out = []
    for k in range(n):
        e = f"{mixer}experts.{ep_r * n + k}."
        if par.experts == "sequential":
            fc1, fc2 = (f"{pre}mlp.experts.local_experts.{k}.linear_fc{x}.weight" for x in (1, 2))
        else:
            fc1, fc2 = (f"{pre}mlp.experts.linear_fc{x}.weight{k}" for x in (1, 2))
        out.append(_fc1(fc1, e, F, H, etp, etp_r, h.plain_mlp))
        out.append(_row_parallel(fc2, e + "down_proj.weight", H, F, etp, etp_r))
    return out


@lru_cache(maxsize=1024)
def _templates(spec: ModelSpec, par: MegatronParallel, pp_r: int, tp_r: int, ep_r: int, etp_r: int):
    (layers,) = stage_layers(len(megatron_pattern(spec)), par)[pp_r]
    h, H, V, Vp = spec.hybrid, spec.hidden, spec.vocab, padded_vocab(spec, par)
    out: list[_Tmpl] = []
    if pp_r == 0:
        out.append(_vocab_rows("embedding.word_embeddings.weight", h.embedding, V, Vp, H, par.tp, tp_r))
    for local, j in enumerate(layers):
        pre = f"decoder.layers.{local}."
        out += _layer(spec, par, j, pre, tp_r)
        out += _experts(spec, par, j, pre, ep_r, etp_r)
    if pp_r == par.pp - 1:
        out.append(_full("decoder.final_norm.weight", h.final_norm, (H,)))
        if not spec.tied:
            out.append(_vocab_rows("output_layer.weight", "lm_head.weight", V, Vp, H, par.tp, tp_r))
    return tuple(out)


def hybrid_rank_params(spec: ModelSpec, par: MegatronParallel, rank: int) -> list[LocalParam]:
    """Every parameter ``rank`` of a ``HybridModel`` holds, named as ``named_parameters()``."""
    check_hybrid(spec, par)
    c = rank_coords(par, rank)
    out: list[LocalParam] = []
    _stamp(rank, spec.dtype, _templates(spec, par, c["pp"], c["tp"], c["ep"], c["etp"]), out)
    # A_log in fp32 (``layout.hybrid.A_LOG_DTYPE``): MambaMixer keeps it so; a GDN in a bf16
    # policy holds it in params_dtype and is described as fp32 here (a cast not built yet).
    return [replace(lp, dtype=A_LOG_DTYPE) if lp.name.endswith(".A_log") else lp for lp in out]


def hybrid_layout(spec: ModelSpec, par: MegatronParallel) -> SideLayout:
    """All ranks of the training world of a hybrid (every replica listed)."""
    check_hybrid(spec, par)
    params: list[LocalParam] = []
    for rank in range(par.world_size):
        params.extend(hybrid_rank_params(spec, par, rank))
    return SideLayout(
        name=f"megatron-hybrid(tp={par.tp},pp={par.pp},ep={par.ep},etp={par.etp_size},cp={par.cp},dp={par.dp})",
        world_size=par.world_size, params=tuple(params), tensors=spec.tensor_table(),
        notes=(f"{spec.arch}: megatron hybrid_layer_pattern {megatron_pattern(spec)!r}",))


HYBRID_RULES[:] = [(hybrid_rank_params, hybrid_layout)]
