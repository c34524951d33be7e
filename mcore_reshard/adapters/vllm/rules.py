"""vLLM parameter layouts (model format) as pure functions of (model spec, parallel sizes, rank).

Model format is what vLLM's weight loaders write, before ``process_weights_after_loading``
repacks anything; names are those of ``model.named_parameters()`` in vLLM 0.32 for Llama,
Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 (``DeepseekV2ForCausalLM``). The rules mirror, in the
vLLM source:

- ``layers/linear.py``: ``QKVParallelLinear`` local ``[q_r; k_s; v_s]`` (KV heads replicated
  over ``tp // nKV`` ranks when ``tp > nKV``), ``MergedColumnParallelLinear`` ``[gate_r; up_r]``,
  ``RowParallelLinear`` column slices;
- ``layers/vocab_parallel_embedding.py``: vocab padded to a multiple of 64 globally, rank r
  owns padded rows ``[r*P/tp, (r+1)*P/tp)``, real rows first and zero rows after;
- ``layers/fused_moe/``: ``mlp.experts.routed_experts.w13_weight`` ``[E_l, 2*Ie_l, H]`` and
  ``w2_weight`` ``[E_l, H, Ie_l]``; MoE TP flattened over ``dp*tp`` without EP, whole experts
  placed linearly over ``ep = dp*tp`` ranks with EP (``expert_map_manager.determine_expert_map``);
- ``distributed/utils.py:get_pp_indices`` and ``models/utils.py:make_layers`` for PP (missing
  layers are ``PPMissingLayer``, which has no parameters);
- ``models/deepseek_v2.py`` (``DeepseekV2MLAAttention``): ``fused_qkv_a_proj`` = ``[q_a_proj;
  kv_a_proj_with_mqa]`` replicated (q_lora) or ``q_proj`` column-parallel plus a replicated
  ``kv_a_proj_with_mqa``; ``q_b_proj`` / ``kv_b_proj`` column-parallel by heads; ``o_proj`` row-
  parallel; ``DeepseekV2MoE``: ``gate.e_score_correction_bias`` (``noaux_tc``), a TP-split
  ``shared_experts`` MLP, FusedMoE experts as Qwen3-MoE's.

No vllm or torch import: plans for full-size models are computed from metadata alone.
"""

from __future__ import annotations

from dataclasses import replace

from ...layout import Box, LayoutError, LocalParam, ModelSpec, Piece, SideLayout, View
from ...layout.quant import quantize_side
from ...layout.spec import ROUTER_BIAS_DTYPE
from .parallel import QUANTIZATIONS, VllmParallel, check_dims, expert_slots

__all__ = ["QUANTIZATIONS", "VllmParallel", "vllm_layout", "vllm_rank_params"]

_MOE_W13 = "mlp.experts.routed_experts.w13_weight"
_MOE_W2 = "mlp.experts.routed_experts.w2_weight"


def _rows(offset: int, rows: int, cols: int, local_off: int) -> tuple[Box, View]:
    """Rows ``[offset, offset+rows)`` of a ``[*, cols]`` tensor, stored densely at ``local_off``."""
    return Box((offset, 0), (rows, cols)), View(local_off, (rows, cols), (cols, 1))


def _cols(offset: int, rows: int, cols: int, local_cols: int, local_off: int = 0) -> tuple[Box, View]:
    """Columns ``[offset, offset+cols)`` stored as a ``[rows, local_cols]`` local block."""
    return Box((0, offset), (rows, cols)), View(local_off, (rows, cols), (local_cols, 1))


def _full(shape: tuple[int, ...]) -> tuple[Box, View]:
    strides = (shape[1], 1) if len(shape) == 2 else (1,)
    return Box.full(shape), View(0, shape, strides)


# A template entry: (local suffix, local shape, ((canonical suffix, box, view), ...)).
_Entry = tuple[str, tuple[int, ...], tuple[tuple[str, Box, View], ...]]


class _Builder:
    """Builds rank parameters from per-coordinate templates, so ranks and layers holding the
    same geometry share ``Box``/``View`` objects and canonical-name strings."""

    def __init__(self, spec: ModelSpec, par: VllmParallel) -> None:
        self.spec, self.par = spec, par
        self.d = check_dims(spec, par)
        self._attn: dict[int, tuple[_Entry, ...]] = {}
        self._dense: dict[int, tuple[_Entry, ...]] = {}
        self._vocab: dict[int, tuple[tuple[int, ...], tuple[tuple[Box, View], ...]]] = {}
        self._moe_box: dict[int, tuple[Box, Box, Box]] = {}
        self._moe_views: list[tuple[View, View, View]] = []
        self._expert_names: dict[int, tuple[tuple[str, str, str], ...]] = {}
        self._prefix = [f"model.layers.{i}." for i in range(spec.num_layers + spec.mtp_layers)]

    # -- per-coordinate geometry

    def mla_attn(self, r: int) -> tuple[_Entry, ...]:
        """``DeepseekV2MLAAttention`` on TP rank ``r``: heads split by TP, latents replicated."""
        s = self.spec
        m, H, nh = s.mla, s.hidden, s.num_heads // self.d.tp
        assert m is not None
        kv_a = m.kv_lora_rank + m.qk_rope_head_dim
        qk, kvb = nh * m.qk_head_dim, nh * (m.qk_nope_head_dim + m.v_head_dim)
        a = "self_attn."
        out: list[_Entry] = []
        if m.q_lora_rank is None:
            out.append((a + "q_proj.weight", (qk, H), ((a + "q_proj.weight", *_rows(r * qk, qk, H, 0)),)))
            out.append((a + "kv_a_proj_with_mqa.weight", (kv_a, H),
                        ((a + "kv_a_proj_with_mqa.weight", *_full((kv_a, H))),)))
        else:
            ql = m.q_lora_rank
            out.append((a + "fused_qkv_a_proj.weight", (ql + kv_a, H), (
                (a + "q_a_proj.weight", *_rows(0, ql, H, 0)),
                (a + "kv_a_proj_with_mqa.weight", *_rows(0, kv_a, H, ql * H)))))
            out.append((a + "q_a_layernorm.weight", (ql,), ((a + "q_a_layernorm.weight", *_full((ql,))),)))
            out.append((a + "q_b_proj.weight", (qk, ql), ((a + "q_b_proj.weight", *_rows(r * qk, qk, ql, 0)),)))
        kl = m.kv_lora_rank
        out.append((a + "kv_a_layernorm.weight", (kl,), ((a + "kv_a_layernorm.weight", *_full((kl,))),)))
        out.append((a + "kv_b_proj.weight", (kvb, kl), ((a + "kv_b_proj.weight", *_rows(r * kvb, kvb, kl, 0)),)))
        v = nh * m.v_head_dim
        out.append((a + "o_proj.weight", (H, v), ((a + "o_proj.weight", *_cols(r * v, H, v, v)),)))
        return tuple(out)

    def attn(self, r: int) -> tuple[_Entry, ...]:
        if r in self._attn:
            return self._attn[r]
        s, d = self.spec, self.d
        if s.mla is not None:
            self._attn[r] = self.mla_attn(r)
            return self._attn[r]
        H, q, kv = s.hidden, d.q_rows, d.kv_rows
        ks = r // d.kv_rep if s.num_kv_heads < d.tp else r
        n = q + 2 * kv
        w = (
            ("self_attn.q_proj.weight", *_rows(r * q, q, H, 0)),
            ("self_attn.k_proj.weight", *_rows(ks * kv, kv, H, q * H)),
            ("self_attn.v_proj.weight", *_rows(ks * kv, kv, H, (q + kv) * H)),
        )
        out: list[_Entry] = [("self_attn.qkv_proj.weight", (n, H), w)]
        if s.qkv_bias:
            b = tuple(
                (f"self_attn.{p}_proj.bias", Box((start,), (rows,)), View(off, (rows,), (1,)))
                for p, start, rows, off in (("q", r * q, q, 0), ("k", ks * kv, kv, q), ("v", ks * kv, kv, q + kv))
            )
            out.append(("self_attn.qkv_proj.bias", (n,), b))
        out.append(("self_attn.o_proj.weight", (H, q), (("self_attn.o_proj.weight", *_cols(r * q, H, q, q)),)))
        if s.qk_norm:
            for nm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                out.append((nm, (s.head_dim,), ((nm, *_full((s.head_dim,))),)))
        self._attn[r] = tuple(out)
        return self._attn[r]

    def norms(self) -> tuple[_Entry, ...]:
        H = self.spec.hidden
        return tuple(
            (nm, (H,), ((nm, *_full((H,))),)) for nm in ("input_layernorm.weight", "post_attention_layernorm.weight")
        )

    def dense(self, r: int) -> tuple[_Entry, ...]:
        if r not in self._dense:
            H, i = self.spec.hidden, self.d.dense_rows
            gu = (("mlp.gate_proj.weight", *_rows(r * i, i, H, 0)), ("mlp.up_proj.weight", *_rows(r * i, i, H, i * H)))
            self._dense[r] = (
                ("mlp.gate_up_proj.weight", (2 * i, H), gu),
                ("mlp.down_proj.weight", (H, i), (("mlp.down_proj.weight", *_cols(r * i, H, i, i)),)),
            )
        return self._dense[r]

    def shared(self, r: int) -> tuple[_Entry, ...]:
        """``DeepseekV2MoE.shared_experts``: a TP-split SwiGLU MLP (``DeepseekV2MLP``)."""
        H, i = self.spec.hidden, self.spec.shared_intermediate // self.d.tp
        p = "mlp.shared_experts."
        gu = ((p + "gate_proj.weight", *_rows(r * i, i, H, 0)), (p + "up_proj.weight", *_rows(r * i, i, H, i * H)))
        return ((p + "gate_up_proj.weight", (2 * i, H), gu),
                (p + "down_proj.weight", (H, i), ((p + "down_proj.weight", *_cols(r * i, H, i, i)),)))

    def vocab(self, r: int) -> tuple[tuple[int, ...], tuple[tuple[Box, View], ...]]:
        if r not in self._vocab:
            s, d = self.spec, self.d
            lo = min(r * d.vocab_rows, s.vocab)
            hi = min((r + 1) * d.vocab_rows, s.vocab)
            pieces = (_rows(lo, hi - lo, s.hidden, 0),) if hi > lo else ()
            self._vocab[r] = ((d.vocab_rows, s.hidden), pieces)
        return self._vocab[r]

    def moe_boxes(self, mr: int) -> tuple[Box, Box, Box]:
        if mr not in self._moe_box:
            H, f = self.spec.hidden, self.d.moe_rows
            self._moe_box[mr] = (Box((mr * f, 0), (f, H)), Box((mr * f, 0), (f, H)), Box((0, mr * f), (H, f)))
        return self._moe_box[mr]

    def moe_views(self, slots: int) -> list[tuple[View, View, View]]:
        H, f = self.spec.hidden, self.d.moe_rows
        for j in range(len(self._moe_views), slots):
            self._moe_views.append(
                (
                    View(j * 2 * f * H, (f, H), (H, 1)),
                    View(j * 2 * f * H + f * H, (f, H), (H, 1)),
                    View(j * H * f, (H, f), (f, 1)),
                )
            )
        return self._moe_views

    def expert_names(self, layer: int) -> tuple[tuple[str, str, str], ...]:
        if layer not in self._expert_names:
            p = self._prefix[layer]
            self._expert_names[layer] = tuple(
                tuple(f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))
                for e in range(self.spec.num_experts)
            )
        return self._expert_names[layer]

    # -- one rank

    def rank_params(self, rank: int) -> list[LocalParam]:
        s, par, d = self.spec, self.par, self.d
        if not 0 <= rank < par.world_size:
            raise LayoutError(f"rank {rank} outside the vLLM world of {par.world_size} ranks")
        tp_r = rank % par.tp
        pp_r = rank // par.tp % par.pp
        first, last = pp_r == 0, pp_r == par.pp - 1
        dt = s.dtype
        out: list[LocalParam] = []

        def add(name: str, shape: tuple[int, ...], pieces: tuple[tuple[str, Box, View], ...], dtype: str = dt) -> None:
            out.append(LocalParam(rank, name, shape, dtype, tuple(Piece(rank, name, c, b, v) for c, b, v in pieces)))

        def add_vocab(name: str) -> None:
            shape, pv = self.vocab(tp_r)
            add(name, shape, tuple((name, b, v) for b, v in pv))

        # Qwen3-MoE builds embed_tokens, norm and lm_head on every PP stage; the dense models
        # only on the first stage (embed; also the last when tied) and the last (norm, lm_head).
        everywhere = s.arch == "qwen3_moe"
        if first or everywhere or (s.tied and last):
            add_vocab("model.embed_tokens.weight")
        start, end = d.stages[pp_r]
        for layer in range(start, end):
            self.layer_params(out, rank, layer)
        if last or everywhere:
            add("model.norm.weight", (s.hidden,), (("model.norm.weight", *_full((s.hidden,))),))
            if not s.tied:  # tied: lm_head.weight *is* embed_tokens.weight (named_parameters dedups)
                add_vocab("lm_head.weight")
        return out

    def layer_params(self, out: list[LocalParam], rank: int, layer: int, local: str | None = None,
                     moe: bool | None = None) -> None:
        """Decoder layer ``layer``'s parameters on ``rank``, named under ``local`` (default
        ``model.layers.{layer}.``; a draft's MTP layer: ``...mtp_block.``), boxes of
        ``model.layers.{layer}.*``; ``moe``: whether its MLP is routed (default: the spec's)."""
        s, par, d = self.spec, self.par, self.d
        tp_r = rank % par.tp
        mr = rank // (par.tp * par.pp) % par.dp * par.tp + tp_r  # flattened MoE rank (ep_rank with EP)
        p = self._prefix[layer]
        q = p if local is None else local
        dt = s.dtype

        def add(suffix: str, shape: tuple[int, ...], pieces: tuple[tuple[str, Box, View], ...], dtype: str = dt) -> None:
            name = q + suffix
            out.append(LocalParam(rank, name, shape, dtype, tuple(Piece(rank, name, p + c, b, v) for c, b, v in pieces)))

        for suffix, shape, pieces in self.attn(tp_r):
            add(suffix, shape, pieces)
        if s.is_moe(layer) if moe is None else moe:
            router = (s.num_experts, s.hidden)
            add("mlp.gate.weight", router, (("mlp.gate.weight", *_full(router)),))
            if s.router_bias:
                bias = "mlp.gate.e_score_correction_bias"
                add(bias, (s.num_experts,), ((bias, *_full((s.num_experts,))),), ROUTER_BIAS_DTYPE)  # fp32, as vLLM builds it
            if s.shared_intermediate:
                for suffix, shape, pieces in self.shared(tp_r):
                    add(suffix, shape, pieces)
            self._add_experts(out, rank, layer, mr, q)
        else:
            for suffix, shape, pieces in self.dense(tp_r):
                add(suffix, shape, pieces)
        for suffix, shape, pieces in self.norms():
            add(suffix, shape, pieces)

    def _add_experts(self, out: list[LocalParam], rank: int, layer: int, mr: int, local: str | None = None) -> None:
        s, d = self.spec, self.d
        H, f = s.hidden, d.moe_rows
        if d.ep > 1:
            first_slot, n = expert_slots(d, mr)
            gbox, ubox, dbox = self.moe_boxes(0)
        else:
            first_slot, n = 0, d.physical
            gbox, ubox, dbox = self.moe_boxes(mr)
        phys = d.maps.get(layer, d.initial_map)
        names = self.expert_names(layer)
        views = self.moe_views(n)
        p = self._prefix[layer] if local is None else local
        w13, w2 = p + _MOE_W13, p + _MOE_W2
        p13: list[Piece] = []
        p2: list[Piece] = []
        for j in range(n):
            g, u, dn = names[phys[first_slot + j]]
            gv, uv, dv = views[j]
            p13.append(Piece(rank, w13, g, gbox, gv))
            p13.append(Piece(rank, w13, u, ubox, uv))
            p2.append(Piece(rank, w2, dn, dbox, dv))
        out.append(LocalParam(rank, w13, (n, 2 * f, H), s.dtype, tuple(p13)))
        out.append(LocalParam(rank, w2, (n, H, f), s.dtype, tuple(p2)))


# ----------------------------------------------------------------------------- public API

#: Layout rules of the hybrid families (``spec.hybrid``): ``(rank_params, layout)``,
#: registered by ``hybrid_rules`` (a module of its own, built on ``_Builder``).
HYBRID_RULES: list = []



def vllm_rank_params(spec: ModelSpec, par: VllmParallel, rank: int) -> list[LocalParam]:
    """The model-format parameters of one vLLM rank, each with its canonical (HF) pieces
    (of an FP8 engine: in bf16, as its loaders take them; ``vllm_layout`` describes the FP8 form)."""
    if spec.hybrid is not None:
        return HYBRID_RULES[0][0](spec, par, rank)
    return _Builder(spec, par).rank_params(rank)


def vllm_layout(spec: ModelSpec, par: VllmParallel) -> SideLayout:
    """Every rank's parameters: the inference side of a refit plan."""
    if spec.hybrid is not None:
        return HYBRID_RULES[0][1](spec, par)
    b = _Builder(spec, par)
    d = b.d
    params: list[LocalParam] = []
    for rank in range(par.world_size):
        params.extend(b.rank_params(rank))
    notes = [
        f"vllm model format: tp={par.tp} pp={par.pp} dp={par.dp} replicas={par.replicas}",
        f"vocab {spec.vocab} padded to {d.padded_vocab} ({d.vocab_rows} rows per TP rank)",
        f"pp layer bounds {list(d.stages)}",
    ]
    if spec.moe_layers:
        mode = f"EP over {d.ep} ranks, linear placement" if d.ep > 1 else f"MoE TP over {d.moe_tp} ranks (dp*tp)"
        notes.append(f"experts: {mode}, {d.physical} physical slots for {spec.num_experts} logical experts")
        if par.expert_placement == "round_robin":
            notes.append("round_robin placement needs grouped experts: vLLM falls back to linear")
    if spec.arch == "qwen3_moe" and par.pp > 1:
        notes.append("Qwen3-MoE holds embed_tokens, norm and lm_head on every PP stage")
    if spec.mla is not None:
        notes.append("MLA kv_b_proj: vLLM absorbs it into W_UK/W_UV after loading (kernel format != model "
                     "format): the applier writes it through the layerwise reload and rebuilds W_UK/W_UV")
    if spec.mtp_layers:
        notes.append(f"MTP layers {spec.num_layers}..{spec.num_layers + spec.mtp_layers - 1} "
                     f"(num_nextn_predict_layers={spec.mtp_layers}) are not held by the destination: vLLM's "
                     "main model skips them (only an MTP speculative-decoding draft loads them); not refit")
    tensors = spec.tensor_table()
    side = SideLayout("vllm", par.world_size, tuple(params), tensors, tuple(notes))
    fp8 = par.fp8
    if fp8 is None:
        return side
    side = quantize_side(side, fp8, "vllm")
    return replace(side, notes=side.notes + (
        f"block FP8 ({fp8.block}x{fp8.block} {fp8.dtype} codes + fp32 weight_scale_inv; kept in {spec.dtype}: "
        f"embeddings, lm_head, norms, modules matching {list(fp8.ignore)}); vLLM packs the codes after loading: "
        f"written through the layerwise reload",))
