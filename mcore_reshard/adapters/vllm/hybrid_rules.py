"""vLLM 0.32 model-format layouts of the hybrid families, as pure functions.

``models/nemotron_h.py`` (``NemotronHForCausalLM``: ``model.layers.N.mixer.*``) and
``models/qwen3_next.py`` (``Qwen3NextForCausalLM``), read in vLLM's source and checked against
what vLLM's own loaders write (``tests/test_hybrid_layouts.py`` records every tiny layout at
TP 1, 2 and 4 and compares piece by piece):

* ``MambaMixer2`` (``layers/mamba/mamba_mixer2.py``): with ``n_groups % tp == 0`` ``in_proj``
  is a ``MergedColumnParallelLinear`` ``[z_r | x_r | B_r | C_r | dt_r]`` and ``conv1d``
  ``[x_r | B_r | C_r]`` (megatron's own per-rank order); with ``n_groups == 1`` and tp > 1
  ``mamba_v2_sharded_weight_loader`` gives every rank the whole group: ``[z_r | x_r | B | C |
  dt_r]``. Other ``n_groups % tp != 0`` are refused by vLLM. ``A`` is derived at load:
  ``-exp(A_log)`` (a composed loader), fp32; ``conv_weights`` is a buffer viewing
  ``conv1d.weight``;
* GDN (``Qwen3NextGatedDeltaNet``): ``in_proj_qkvz`` / ``in_proj_ba`` keep HF's per-key-head
  groups, each rank a contiguous block of whole groups; ``conv1d`` ``[q_r | k_r | v_r]``;
  ``A_log`` fp32, kept raw; the gated ``norm`` replicated;
* Qwen3-Next attention's ``qkv_proj`` takes q_proj's ``[q_h; gate_h]`` rows of its heads;
* Nemotron-H's MLP and experts are not gated: ``up_proj`` column-, ``down_proj`` row-parallel;
  FusedMoE ``w13`` holds ``up_proj`` alone.
"""

from __future__ import annotations

from ...layout import Box, LayoutError, LocalParam, ModelSpec, Piece, SideLayout, View
from ...layout.spec import ROUTER_BIAS_DTYPE
from .rules import HYBRID_RULES, VllmParallel, _Builder, _cols, _full, _rows

__all__ = ["hybrid_vllm_rank_params", "hybrid_vllm_layout", "hybrid_vllm_tensors", "DERIVED_NOTE"]

#: What the plan report says about the parameters vLLM computes from the checkpoint at load.
DERIVED_NOTE = ("Mamba mixer.A: vLLM derives A = -exp(A_log) in its weight loader; the refit writes A_log's bytes into "
                "the mixer's model-format shadow and re-runs that derivation (reload mode), with D and dt_bias")

_Entry = tuple[str, tuple[int, ...], tuple[tuple[str, Box, View], ...]]


def _conv(rows: list[tuple[int, int]], k: int) -> tuple[tuple[Box, View], ...]:
    """A conv weight ``[C, 1, k]`` of row runs ``(canonical row0, rows)``, stacked locally."""
    out, at = [], 0
    for row0, n in rows:
        out.append((Box((row0, 0, 0), (n, 1, k)), View(at * k, (n, 1, k), (k, k, 1))))
        at += n
    return tuple(out)


def _vec(rows: list[tuple[int, int]]) -> tuple[tuple[Box, View], ...]:
    out, at = [], 0
    for row0, n in rows:
        out.append((Box((row0,), (n,)), View(at, (n,), (1,))))
        at += n
    return tuple(out)


class _HybridBuilder(_Builder):
    """``_Builder`` with each layer built by its mixer kind."""

    def __init__(self, spec: ModelSpec, par: VllmParallel) -> None:
        _check(spec, par)
        super().__init__(spec, par)
        self.h = spec.hybrid

    def mamba(self, r: int) -> list[_Entry]:
        m, H, tp = self.h.mamba, self.spec.hidden, self.par.tp
        di, nh, gs = m.d_inner // tp, m.heads // tp, m.groups * m.state
        rep = m.groups % tp != 0  # n_groups == 1: every rank holds the whole group
        g_r, g0 = (gs, 0) if rep else (gs // tp, r * gs // tp)
        ip = [(r * di, di), (m.d_inner + r * di, di), (2 * m.d_inner + g0, g_r), (2 * m.d_inner + gs + g0, g_r),
              (2 * m.d_inner + 2 * gs + r * nh, nh)]
        conv = [(r * di, di), (m.d_inner + g0, g_r), (m.d_inner + gs + g0, g_r)]
        rows = 2 * di + 2 * g_r + nh
        at, ipp = 0, []
        for row0, n in ip:
            ipp.append(("in_proj.weight", *_rows(row0, n, H, at * H)))
            at += n
        out: list[_Entry] = [
            ("A", (nh,), (("A_log", *_vec([(r * nh, nh)])[0]),)),
            ("D", (nh,), (("D", *_vec([(r * nh, nh)])[0]),)),
            ("dt_bias", (nh,), (("dt_bias", *_vec([(r * nh, nh)])[0]),)),
            ("conv1d.weight", (di + 2 * g_r, 1, m.conv_kernel), tuple(("conv1d.weight", b, v) for b, v in _conv(conv, m.conv_kernel))),
        ]
        if m.conv_bias:
            out.append(("conv1d.bias", (di + 2 * g_r,), tuple(("conv1d.bias", b, v) for b, v in _vec(conv))))
        out += [("in_proj.weight", (rows, H), tuple(ipp)),
                ("out_proj.weight", (H, di), (("out_proj.weight", *_cols(r * di, H, di, di)),)),
                ("norm.weight", (di,), (("norm.weight", *_vec([(r * di, di)])[0]),))]
        return out

    def gdn(self, r: int) -> list[_Entry]:
        g, H, tp = self.h.gdn, self.spec.hidden, self.par.tp
        nk, nv = g.k_heads // tp, g.v_heads // tp
        qk = g.k_heads * g.k_dim
        qkvz, ba = nk * g.group_rows, nk * 2 * g.ratio
        conv = [(r * nk * g.k_dim, nk * g.k_dim), (qk + r * nk * g.k_dim, nk * g.k_dim),
                (2 * qk + r * nv * g.v_dim, nv * g.v_dim)]
        return [
            ("dt_bias", (nv,), (("dt_bias", *_vec([(r * nv, nv)])[0]),)),
            ("A_log", (nv,), (("A_log", *_vec([(r * nv, nv)])[0]),)),
            ("conv1d.weight", (nk * 2 * g.k_dim + nv * g.v_dim, 1, g.conv_kernel),
             tuple(("conv1d.weight", b, v) for b, v in _conv(conv, g.conv_kernel))),
            ("in_proj_qkvz.weight", (qkvz, H), (("in_proj_qkvz.weight", *_rows(r * qkvz, qkvz, H, 0)),)),
            ("in_proj_ba.weight", (ba, H), (("in_proj_ba.weight", *_rows(r * ba, ba, H, 0)),)),
            ("norm.weight", (g.v_dim,), (("norm.weight", *_full((g.v_dim,))),)),
            ("out_proj.weight", (H, nv * g.v_dim), (("out_proj.weight", *_cols(r * nv * g.v_dim, H, nv * g.v_dim, nv * g.v_dim)),)),
        ]

    def attention(self, r: int) -> list[_Entry]:
        """``qkv_proj`` (+ o_proj, q/k norm); Qwen3-Next's q rows carry each head's gate."""
        if not self.h.attn_gate:
            return [(n.replace("self_attn.", "", 1), s, tuple((c.replace("self_attn.", "", 1), b, v) for c, b, v in p))
                    for n, s, p in self.attn(r)]
        s, d = self.spec, self.d
        H, q, kv = s.hidden, 2 * d.q_rows, d.kv_rows
        ks = r // d.kv_rep if s.num_kv_heads < d.tp else r
        w = (("q_proj.weight", *_rows(r * q, q, H, 0)), ("k_proj.weight", *_rows(ks * kv, kv, H, q * H)),
             ("v_proj.weight", *_rows(ks * kv, kv, H, (q + kv) * H)))
        oq = d.q_rows
        out: list[_Entry] = [("qkv_proj.weight", (q + 2 * kv, H), w),
                             ("o_proj.weight", (H, oq), (("o_proj.weight", *_cols(r * oq, H, oq, oq)),))]
        for nm in ("q_norm.weight", "k_norm.weight"):
            out.append((nm, (s.head_dim,), ((nm, *_full((s.head_dim,))),)))
        return out

    def mlp(self, r: int, F: int, shared: str = "") -> list[_Entry]:
        H, f = self.spec.hidden, F // self.par.tp
        down = (shared + "down_proj.weight", (H, f), ((shared + "down_proj.weight", *_cols(r * f, H, f, f)),))
        if self.h.plain_mlp:
            return [(shared + "up_proj.weight", (f, H), ((shared + "up_proj.weight", *_rows(r * f, f, H, 0)),)), down]
        gu = ((shared + "gate_proj.weight", *_rows(r * f, f, H, 0)), (shared + "up_proj.weight", *_rows(r * f, f, H, f * H)))
        return [(shared + "gate_up_proj.weight", (2 * f, H), gu), down]

    def rank_params(self, rank: int) -> list[LocalParam]:
        s, par, d, h = self.spec, self.par, self.d, self.h
        if not 0 <= rank < par.world_size:
            raise LayoutError(f"rank {rank} outside the vLLM world of {par.world_size} ranks")
        tp_r, pp_r = rank % par.tp, rank // par.tp % par.pp
        out: list[LocalParam] = []

        def add(name: str, shape, pieces, dtype: str = s.dtype) -> None:
            out.append(LocalParam(rank, name, shape, dtype, tuple(Piece(rank, name, c, b, v) for c, b, v in pieces)))

        if pp_r == 0:
            shape, pv = self.vocab(tp_r)
            add("model.embed_tokens.weight", shape, tuple((h.embedding, b, v) for b, v in pv))
        start, end = d.stages[pp_r]
        for layer in range(start, end):
            self.hybrid_layer(out, rank, layer, add)
        if pp_r == par.pp - 1:
            norm = "model.norm_f.weight" if h.family == "nemotron_h" else "model.norm.weight"
            add(norm, (s.hidden,), ((h.final_norm, *_full((s.hidden,))),))
            if not s.tied:
                shape, pv = self.vocab(tp_r)
                add("lm_head.weight", shape, tuple(("lm_head.weight", b, v) for b, v in pv))
        return out

    def hybrid_layer(self, out: list[LocalParam], rank: int, layer: int, add) -> None:
        s, h, par = self.spec, self.h, self.par
        tp_r = rank % par.tp
        sym, hp, H = h.mixers[layer], h.layer_prefix(layer), s.hidden
        local = f"model.layers.{layer}."

        def put(lp: str, cp: str, entries: list[_Entry], derived: str = "") -> None:
            for suffix, shape, pieces in entries:
                dt = "float32" if (derived and suffix == derived) or suffix == "A_log" else s.dtype
                add(lp + suffix, shape, tuple((cp + c, b, v) for c, b, v in pieces), dt)

        if h.family == "nemotron_h":
            add(local + "norm.weight", (H,), ((hp + "norm.weight", *_full((H,))),))
            lp, cp = local + "mixer.", hp + "mixer."
            if sym == "M":
                put(lp, cp, self.mamba(tp_r), derived="A")
            elif sym == "*":
                put(lp, cp, self.attention(tp_r))
            elif sym == "-":
                put(lp, cp, self.mlp(tp_r, s.intermediate))
            else:
                self.moe(out, rank, layer, lp, cp, add)
            return
        add(local + "input_layernorm.weight", (H,), ((hp + "input_layernorm.weight", *_full((H,))),))
        if sym == "G":
            put(local + "linear_attn.", hp + "linear_attn.", self.gdn(tp_r))
        else:
            put(local + "self_attn.", hp + "self_attn.", self.attention(tp_r))
        if s.is_moe(layer):
            self.moe(out, rank, layer, local + "mlp.", hp + "mlp.", add)
        else:
            put(local + "mlp.", hp + "mlp.", self.mlp(tp_r, s.intermediate))
        add(local + "post_attention_layernorm.weight", (H,), ((hp + "post_attention_layernorm.weight", *_full((H,))),))

    def moe(self, out: list[LocalParam], rank: int, layer: int, lp: str, cp: str, add) -> None:
        s, h, par, d = self.spec, self.h, self.par, self.d
        tp_r, H, E = rank % par.tp, s.hidden, s.num_experts
        add(lp + "gate.weight", (E, H), ((cp + "gate.weight", *_full((E, H))),))
        if s.router_bias:
            add(lp + "gate.e_score_correction_bias", (E,), ((cp + "gate.e_score_correction_bias", *_full((E,))),),
                ROUTER_BIAS_DTYPE)
        if h.shared_gate:
            add(lp + "shared_expert_gate.weight", (1, H), ((cp + "shared_expert_gate.weight", *_full((1, H))),))
        if s.shared_intermediate:
            sh = "shared_experts." if h.family == "nemotron_h" else "shared_expert."
            for suffix, shape, pieces in self.mlp(tp_r, s.shared_intermediate, sh):
                add(lp + suffix, shape, tuple((cp + c, b, v) for c, b, v in pieces))
        if not h.plain_mlp:
            # ``_add_experts`` names ``<layer>.mlp.experts.routed_experts.*`` (Qwen3-Next's own).
            self._add_experts(out, rank, layer, rank // (par.tp * par.pp) % par.dp * par.tp + tp_r, lp[: -len("mlp.")])
            return
        # Non-gated FusedMoE: w13 holds up_proj alone ([E_l, f, H]); w2 as for every family.
        f = d.moe_rows
        mr = rank // (par.tp * par.pp) % par.dp * par.tp + tp_r
        from .parallel import expert_slots

        first, n = expert_slots(d, mr) if d.ep > 1 else (0, d.physical)
        r0 = 0 if d.ep > 1 else mr
        phys = d.maps.get(layer, d.initial_map)
        w13, w2 = lp + "experts.routed_experts.w13_weight", lp + "experts.routed_experts.w2_weight"
        p13, p2 = [], []
        for j in range(n):
            e = f"{cp}experts.{phys[first + j]}."
            p13.append(Piece(rank, w13, e + "up_proj.weight", Box((r0 * f, 0), (f, H)), View(j * f * H, (f, H), (H, 1))))
            p2.append(Piece(rank, w2, e + "down_proj.weight", Box((0, r0 * f), (H, f)), View(j * H * f, (H, f), (f, 1))))
        out.append(LocalParam(rank, w13, (n, f, H), s.dtype, tuple(p13)))
        out.append(LocalParam(rank, w2, (n, H, f), s.dtype, tuple(p2)))


def _check(spec: ModelSpec, par: VllmParallel) -> None:
    """What vLLM refuses for a hybrid at this TP, in one line naming the tensor."""
    h, tp, fam = spec.hybrid, par.tp, spec.arch
    m, g = h.mamba, h.gdn
    if m is not None and "M" in h.mixers:
        if m.heads % tp:
            raise LayoutError(f"{fam}: mixer.in_proj / A / D: mamba_num_heads={m.heads} is not divisible by vLLM "
                              f"tp={tp} (MambaMixer2: 'Tensor parallel world size must divide num heads'); pick a tp "
                              "that divides it")
        if m.groups % tp and m.groups != 1:
            raise LayoutError(f"{fam}: mixer.in_proj B/C: n_groups={m.groups} is neither divisible by vLLM tp={tp} "
                              "nor 1 (MambaMixer2 replicates only a single group); pick a tp that divides n_groups")
    if g is not None and "G" in h.mixers:
        for what, n in (("linear_num_key_heads", g.k_heads), ("linear_num_value_heads", g.v_heads)):
            if n % tp:
                raise LayoutError(f"{fam}: linear_attn.in_proj_qkvz: {what}={n} is not divisible by vLLM tp={tp}; "
                                  "pick a tp that divides it")
    if h.plain_mlp and spec.moe_layers and par.fp8 is not None:
        raise LayoutError(f"{fam}: FP8 rollout of non-gated experts is not supported")


def hybrid_vllm_tensors(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """The destination's table: vLLM keeps every ``A_log`` in fp32 (Mamba's derived ``A`` and
    GDN's raw ``A_log``) whatever the model dtype, so a bf16 plan casts them while packing
    (``refit.allow_cast``) -- the cast vLLM's own ``copy_`` makes at load."""
    return spec.tensor_table()


def hybrid_vllm_rank_params(spec: ModelSpec, par: VllmParallel, rank: int) -> list[LocalParam]:
    return _HybridBuilder(spec, par).rank_params(rank)


def hybrid_vllm_layout(spec: ModelSpec, par: VllmParallel) -> SideLayout:
    b = _HybridBuilder(spec, par)
    params: list[LocalParam] = []
    for rank in range(par.world_size):
        params.extend(b.rank_params(rank))
    h = spec.hybrid
    notes = [f"vllm model format ({spec.arch}): tp={par.tp} pp={par.pp} dp={par.dp} replicas={par.replicas}",
             f"vocab {spec.vocab} padded to {b.d.padded_vocab}", f"pp layer bounds {list(b.d.stages)}"]
    if h.mamba is not None and "M" in h.mixers:
        notes.append(DERIVED_NOTE)
        if h.mamba.groups % par.tp:
            notes.append(f"Mamba n_groups={h.mamba.groups} < tp={par.tp}: every vLLM rank holds the whole group's B "
                         "and C rows (mamba_v2_sharded_weight_loader), sent to each")
    if par.fp8 is not None:
        raise LayoutError(f"{spec.arch}: FP8 rollout of a hybrid family is not built")
    if spec.dtype != "float32":
        notes.append(f"A_log: float32 on both sides (vLLM and megatron's MambaMixer keep it so), carried as its "
                     f"bits in a {spec.dtype} plan")
    return SideLayout("vllm", par.world_size, tuple(params), hybrid_vllm_tensors(spec), tuple(notes))


HYBRID_RULES[:] = [(hybrid_vllm_rank_params, hybrid_vllm_layout)]
