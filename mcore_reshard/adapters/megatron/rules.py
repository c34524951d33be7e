"""Megatron-Core 0.19 parameter layouts as pure functions of (model spec, parallel sizes, rank).

No megatron or torch import: the planner and the tests build a whole training world's
descriptors from sizes alone. The live adapter (``live.py``) checks these predictions
against a real model, parameter by parameter.

Facts encoded here (megatron-core 0.19.2):

* fused ``linear_qkv`` rows are interleaved per KV group ``[q_g (P heads); k_g; v_g]`` and TP
  takes plain row chunks of that tensor (with ng < tp a chunk boundary may fall inside a group
  or a head);
* SwiGLU ``linear_fc1`` holds ``[gate_r; up_r]`` on each rank (stride-2 sharding), for dense
  MLPs under TP and routed experts under expert-TP;
* row-parallel ``linear_proj`` / ``linear_fc2`` hold column slices;
* the vocab is padded to a multiple of ``make_vocab_size_divisible_by * tp``; rows >= V are
  padding and covered by no piece;
* layer offsets follow ``transformer_layer.get_transformer_layer_offset`` (even, uneven first /
  last stage, interleaved virtual pipeline);
* MLA (``multi_latent_attention.MLASelfAttention``): the up-projections ``linear_q_up_proj``
  / ``linear_kv_up_proj`` / ``linear_q_proj`` are column-parallel by heads (each head's rows
  ``[nope; rope]`` resp. ``[k_nope; v]`` as in HF); the down-projections are column-parallel
  ``ColumnParallelLinear`` row chunks in the local spec and replicated ``TELinear``
  ("duplicated") in the TE spec; ``q_layernorm`` / ``kv_layernorm`` are separate in the local
  spec (``qk_layernorm=True``) and fused into the up-projections (``layer_norm_weight``) in
  the TE spec; ``input_layernorm`` stays separate in both;
* shared experts ``mlp.shared_experts.linear_fc1/fc2`` are a SwiGLU MLP on the dense TP group;
  the router's ``expert_bias`` (a persistent fp32 buffer, not a parameter) is HF's
  ``e_score_correction_bias``.
* hybrid families (``HybridModel``: Nemotron-H, Qwen3-Next) build one decoder layer per symbol
  of ``hybrid_layer_pattern`` (the table's ``Block.symbol`` / ``megatron_layer``); without
  ``|`` in the pattern its stages are the same even or first/last-stage split of those layers,
  and virtual stages need ``|``: refused. The family's ``check`` refuses what its mixers
  cannot shard (``MambaMixer``: heads and groups divisible by TP; ``GatedDeltaNet``: key and
  value heads).

Layouts are computed once per (stage, tp rank) for dense parameters and once per
(stage, ep rank, etp rank) for experts, then stamped with each rank: the immutable
``Box``/``View`` objects are shared between replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ...layout import LayoutError, LocalParam, ModelSpec, Piece, SideLayout
from ...layout.family import check_tower_tp
from .table import (Tmpl, _col_parallel, _full, _qkv_pieces, _row_parallel, _rows, _swiglu_fc1, _vocab_rows,
                    row_templates)

__all__ = [
    "MegatronParallel",
    "megatron_rank_params",
    "megatron_layout",
    "padded_vocab",
    "stage_layers",
    "rank_coords",
    "TIED_OUTPUT_NOTE",
]

TIED_OUTPUT_NOTE = (
    "tied embeddings with pp > 1: the last stage's output_layer.weight is a synchronised copy "
    "of model.embed_tokens.weight; it is not described (never a sender), the first stage's "
    "embedding.word_embeddings.weight is"
)


@dataclass(frozen=True)
class MegatronParallel:
    """Training-side parallel sizes, as passed to ``initialize_model_parallel`` + TransformerConfig.

    Rank order is megatron's ``tp-cp-ep-dp-pp``: dense rank = tp_r + tp*(cp_r + cp*(dp_r + dp*pp_r));
    expert rank = etp_r + etp*(ep_r + ep*(edp_r + edp*pp_r)).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: megatron's default (= tp)
    cp: int = 1
    dp: int = 1  # dense data-parallel size; world = tp * cp * dp * pp
    vpp: int = 1  # virtual pipeline chunks per stage
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage
    make_vocab_size_divisible_by: int = 128
    layer_spec: str = "local"  # "local" | "te"
    experts: str = "sequential"  # "sequential" (local_experts.{i}) | "grouped" (TEGroupedMLP weight{i})
    sequence_parallel: bool = False  # no layout change; recorded for reports
    #: The model's padded vocab when known (live models); None: Megatron-LM's padding rule.
    vocab_padded: int | None = None
    #: Megatron-FSDP (``use_megatron_fsdp``; NeMo RL's ``use_custom_fsdp``): each rank holds
    #: only its data-parallel slice of every parameter (rows of it, ``fsdp_rules``).
    fsdp: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def etp_size(self) -> int:
        """Expert-TP size; megatron defaults ``expert_tensor_parallel_size`` to the dense TP size."""
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size = world / (etp * ep * pp)."""
        return self.world_size // (self.etp_size * self.ep * self.pp)


# --------------------------------------------------------------------------- validation


def padded_vocab(spec: ModelSpec, par: MegatronParallel) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round V up to ``divisible_by * tp``."""
    if par.vocab_padded is not None:
        if par.vocab_padded < spec.vocab or par.vocab_padded % par.tp:
            raise LayoutError(
                f"padded vocab {par.vocab_padded} must be >= vocab {spec.vocab} and a multiple of tp={par.tp}"
            )
        return par.vocab_padded
    multiple = par.make_vocab_size_divisible_by * par.tp
    return -(-spec.vocab // multiple) * multiple


def _check(spec: ModelSpec, par: MegatronParallel) -> None:
    """Reject what megatron rejects (``initialize_model_parallel``, TransformerConfig, MoELayer)."""
    for field_name in ("tp", "pp", "ep", "cp", "dp", "vpp"):
        if getattr(par, field_name) < 1:
            raise LayoutError(f"parallel size {field_name}={getattr(par, field_name)} must be >= 1")
    if par.etp_size < 1:
        raise LayoutError(f"expert_tensor_parallel_size={par.etp} must be >= 1")
    if par.layer_spec not in ("local", "te"):
        raise LayoutError(f"layer_spec={par.layer_spec!r} is not 'local' or 'te'")
    if par.experts not in ("sequential", "grouped"):
        raise LayoutError(f"experts={par.experts!r} is not 'sequential' or 'grouped'")
    if par.fsdp and par.pp > 1:
        raise LayoutError(f"Megatron-FSDP with pipeline_model_parallel_size={par.pp}: megatron-core 0.19.2's FSDP "
                          f"builds its device mesh over the whole world as dp_cp x ep x tp (_get_dp_tp_mesh), so "
                          f"it does not compose with pipeline parallelism; use pp=1")
    fam = spec.family
    if fam.check is not None:
        fam.check(spec, "megatron", par.tp)  # the family's own refusals, one line naming the tensor
    if fam.tower is not None:
        check_tower_tp(fam, spec, "megatron", 1 if fam.tower.megatron_whole else par.tp)
    if fam.tower is not None and par.pp > 1:
        raise LayoutError(f"{fam.title} with pipeline_model_parallel_size={par.pp}: LLaVAModel's encoder stage "
                          f"split (add_encoder per stage) is not described; use pp=1")
    if par.vpp > 1 and fam.megatron_pattern(spec):
        raise LayoutError(f"{fam.name}: virtual pipeline stages need '|' stage boundaries in megatron's "
                          "hybrid_layer_pattern (select_pipeline_segment); use vpp=1")
    if par.ep > 1 and not spec.moe_layers:
        raise LayoutError(f"expert_model_parallel_size={par.ep} needs MoE layers: num_moe_experts must be "
                          f"non None to use expert-parallel (model {spec.name or spec.arch} is dense)")
    tp, etp = par.tp, par.etp_size
    if spec.num_heads % tp:
        raise LayoutError(f"num_attention_heads={spec.num_heads} must be a multiple of tp={tp}")
    ng = spec.num_kv_heads
    if spec.mla is not None:
        m = spec.mla
        if m.q_lora_rank is None and par.layer_spec == "te":
            raise LayoutError(
                "MLA without q_lora_rank in the TE spec: megatron-core 0.19 (QKNormConfigResolver) builds "
                "linear_q_proj as a fused norm+linear whose layer_norm_weight has no HF tensor; not supported")
        if par.layer_spec == "local":  # ColumnParallelLinear down-projections split their rows
            for what, rows in (("q_lora_rank", m.q_lora_rank or 0), ("kv_lora_rank + qk_rope_head_dim",
                                                                   m.kv_lora_rank + m.qk_rope_head_dim)):
                if rows % tp:
                    raise LayoutError(f"MLA local spec: {what}={rows} (a column-parallel down-projection) "
                                      f"must be divisible by tp={tp}")
    elif ng % tp and tp % ng:
        raise LayoutError(f"num_query_groups={ng} must be a multiple or divisor of tp={tp}")
    elif ((spec.num_heads + 2 * ng) * spec.head_dim) % tp:
        raise LayoutError(f"linear_qkv rows {(spec.num_heads + 2 * ng) * spec.head_dim} not divisible by tp={tp}")
    if spec.shared_intermediate % tp:
        raise LayoutError(f"moe_shared_expert_intermediate_size={spec.shared_intermediate} must be divisible by tp={tp}")
    dense_layers = [l for l in range(spec.num_layers) if not spec.is_moe(l)]
    if dense_layers and spec.intermediate % tp:
        raise LayoutError(f"ffn_hidden_size={spec.intermediate} must be divisible by tp={tp}")
    if spec.moe_layers:
        if spec.num_experts % par.ep:
            raise LayoutError(f"num_moe_experts={spec.num_experts} must be divisible by ep={par.ep}")
        if spec.moe_intermediate % etp:
            raise LayoutError(f"moe_ffn_hidden_size={spec.moe_intermediate} must be divisible by etp={etp}")
    if (par.tp * par.cp * par.dp) % (etp * par.ep):
        raise LayoutError(
            f"world_size={par.world_size} is not divisible by expert_tensor_model_pipeline_parallel size "
            f"etp*ep*pp={etp * par.ep * par.pp}"
        )
    _check_family(spec, par)
    if par.vpp > 1 and par.pp == 1:
        raise LayoutError("pipeline-model-parallel size should be greater than 1 with interleaved schedule (vpp > 1)")
    if par.pp == 1 and (par.first_stage_layers is not None or par.last_stage_layers is not None):
        raise LayoutError("num_layers_in_first/last_pipeline_stage need pp > 1")
    stage_layers(len(_megatron_layers(spec)), par)  # raises on impossible PP / VPP splits


def _check_family(spec: ModelSpec, par: MegatronParallel) -> None:
    """What megatron-core 0.19.2 refuses for a family's table: biases on routed experts only
    with expert-TP 1 (``TransformerConfig``: "Bias in Moe is only supported when ETP==1")."""
    if par.etp_size == 1 or not spec.moe_layers:
        return
    fam = spec.family
    flags = fam.flags(spec)
    for block in fam.blocks.values():
        for row in block.rows if block.experts else ():
            if row.megatron is not None and row.megatron.name.endswith(".bias") and fam.present(row, flags):
                raise LayoutError(f"{fam.title}: {row.hf.format(e='{e}')} (routed-expert bias): megatron-core 0.19.2 "
                                  f"supports MoE biases only with expert_tensor_parallel_size=1 (got etp="
                                  f"{par.etp_size}: 'Bias in Moe is only supported when ETP==1'); set etp=1")


def _stage_sizes(num_layers: int, par: MegatronParallel) -> tuple[int, ...]:
    """Layers per pipeline stage (TransformerConfig's checks + ``get_num_layers_to_build``)."""
    pp, vpp, first, last = par.pp, par.vpp, par.first_stage_layers, par.last_stage_layers
    if first is None and last is None:
        if num_layers % pp:
            raise LayoutError(f"num_layers={num_layers} should be divisible by pp={pp}")
        per = num_layers // pp
        if per % vpp:
            raise LayoutError(f"num_layers_per_pipeline_rank={per} should be divisible by vpp={vpp}")
        return (per,) * pp
    middle_layers, middle_stages = num_layers, pp
    for what, n in (("first", first), ("last", last)):
        if n is None:
            continue
        if n <= 0:
            raise LayoutError(f"num_layers_in_{what}_pipeline_stage must be larger than 0, got {n}")
        if n % vpp:
            raise LayoutError(f"number of layers at {what} stage: {n} must be divisible by vpp={vpp}")
        middle_layers -= n
        middle_stages -= 1
    if bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
        raise LayoutError(
            f"uneven PP does not add up: {middle_layers} middle layers remaining but {middle_stages} middle PP stages"
        )
    per = 0
    if middle_stages:
        if middle_layers % middle_stages:
            raise LayoutError(
                f"number of layers at middle stages: {middle_layers} must be divisible by the "
                f"middle pipeline size {middle_stages}"
            )
        per = middle_layers // middle_stages
        if per % vpp:
            raise LayoutError(f"number of layers on each middle pipeline rank: {per} must be divisible by vpp={vpp}")
    sizes = [per] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return tuple(sizes)


def stage_layers(num_layers: int, par: MegatronParallel) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``[pp_rank][vp_stage]`` -> global layer indices, per ``get_transformer_layer_offset``.

    Interleaved chunks: chunk v of every stage comes before chunk v+1 of any stage (8 layers,
    pp 2, vpp 2: stage 0 holds [0, 1] and [4, 5]).
    """
    return _stage_layers(num_layers, par.pp, par.vpp, par.first_stage_layers, par.last_stage_layers)


@lru_cache(maxsize=64)
def _stage_layers(num_layers, pp, vpp, first, last):
    par = MegatronParallel(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    sizes = _stage_sizes(num_layers, par)
    per_chunk = [n // vpp for n in sizes]
    round_size = sum(per_chunk)  # layers in one virtual round over all stages
    out = []
    for s in range(pp):
        before = sum(per_chunk[:s])
        out.append(tuple(tuple(range(v * round_size + before, v * round_size + before + per_chunk[s]))
                         for v in range(vpp)))
    return tuple(out)


def rank_coords(par: MegatronParallel, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` in the dense (tp-cp-dp-pp) and expert (etp-ep-edp-pp) grids."""
    if not 0 <= rank < par.world_size:
        raise LayoutError(f"rank {rank} outside world of size {par.world_size} (tp*cp*dp*pp)")
    tp_r = rank % par.tp
    cp_r = rank // par.tp % par.cp
    dp_r = rank // (par.tp * par.cp) % par.dp
    pp_r = rank // (par.tp * par.cp * par.dp)
    etp, ep = par.etp_size, par.ep
    within = rank % (par.world_size // par.pp)
    return dict(tp=tp_r, cp=cp_r, dp=dp_r, pp=pp_r, etp=within % etp, ep=within // etp % ep, edp=within // (etp * ep))


# --------------------------------------------------------------------------- templates
# The family's table (``layout.family``) read with megatron's placements (``table.py``); a
# template is (local name, local shape, ((canonical, box, view), ...), dtype or None), rank-free.


def _chunk_prefix(par: MegatronParallel, v: int) -> str:
    return f"chunk{v}." if par.vpp > 1 else ""


def _table(spec: ModelSpec):
    fam = spec.family
    return fam, fam.dims(spec), fam.flags(spec)


@lru_cache(maxsize=64)
def _megatron_layers(spec: ModelSpec) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """megatron-core's decoder layers: (HF layer, its blocks there) each (``Family.megatron_layers``)."""
    return spec.family.megatron_layers(spec)


def _blocks(spec: ModelSpec, layer: int, blocks: tuple[str, ...] | None):
    fam = spec.family
    return fam.layer_blocks(spec, layer) if blocks is None else tuple((b, fam.blocks[b]) for b in blocks)


def _dense_layer(spec: ModelSpec, par: MegatronParallel, layer: int, prefix: str, tp_r: int,
                 blocks: tuple[str, ...] | None = None) -> list[Tmpl]:
    """Non-expert parameters of one decoder layer on TP rank ``tp_r`` (names as named_parameters);
    ``blocks``: the HF layer's blocks this megatron layer holds (None: all)."""
    fam, dims, flags = _table(spec)
    out: list[Tmpl] = []
    for _, block in _blocks(spec, layer, blocks):
        if not block.experts:
            out += row_templates(fam, block.rows, hf=fam.hf_layer.format(layer=layer), local=lambda n: prefix + n,
                                 tp=par.tp, tp_r=tp_r, te=par.layer_spec == "te", dims=dims, flags=flags)
    return out


def _expert_layer(spec: ModelSpec, par: MegatronParallel, layer: int, prefix: str, ep_r: int, etp_r: int,
                  blocks: tuple[str, ...] | None = None) -> list[Tmpl]:
    """Routed experts of one MoE layer on (ep_r, etp_r): global expert = ep_r * E/ep + i, each in
    ``SequentialMLP``'s ``local_experts.{i}`` (or ``TEGroupedMLP``'s ``linear_fc1.weight{i}``)."""
    fam, dims, flags = _table(spec)
    n_local = spec.num_experts // par.ep
    out: list[Tmpl] = []
    for _, block in _blocks(spec, layer, blocks):
        if not block.experts:
            continue
        for i in range(n_local):
            if par.experts == "sequential":
                local = lambda n, i=i: f"{prefix}mlp.experts.local_experts.{i}.{n}"
            else:
                local = lambda n, i=i: f"{prefix}mlp.experts.{n}{i}"
            out += row_templates(fam, block.rows, hf=fam.hf_layer.format(layer=layer), local=local, tp=par.etp_size,
                                 tp_r=etp_r, te=False, dims=dims, flags=flags, expert=ep_r * n_local + i,
                                 stacked=block.stacked)
    return out


@lru_cache(maxsize=4096)
def _dense_templates(spec: ModelSpec, par: MegatronParallel, pp_r: int, tp_r: int):
    """(pre, per-layer lists, post) of non-expert templates for one (stage, tp rank)."""
    fam, dims, flags = _table(spec)
    mlayers = _megatron_layers(spec)
    chunks = stage_layers(len(mlayers), par)[pp_r]
    Vp = padded_vocab(spec, par)
    te = par.layer_spec == "te"
    pre: list[Tmpl] = []
    post: list[Tmpl] = []
    lm = fam.megatron_prefix
    if pp_r == 0:
        if fam.tower is not None:
            pre += _tower_templates(spec, par, tp_r)
        first = _chunk_prefix(par, 0) + lm
        pre += row_templates(fam, fam.pre, hf="", local=lambda n: first + n, tp=par.tp, tp_r=tp_r, te=te, dims=dims,
                             flags=flags, padded_vocab=Vp)
    layers = []
    for v, chunk in enumerate(chunks):
        for i, j in enumerate(chunk):
            layer, blocks = mlayers[j]
            prefix = f"{_chunk_prefix(par, v)}{lm}decoder.layers.{i}."
            layers.append(_dense_layer(spec, par, layer, prefix, tp_r, blocks))
    if pp_r == par.pp - 1:
        last = _chunk_prefix(par, par.vpp - 1) + lm
        post += row_templates(fam, fam.post, hf="", local=lambda n: last + n, tp=par.tp, tp_r=tp_r, te=te, dims=dims,
                              flags=flags, padded_vocab=Vp)
    return tuple(pre), tuple(tuple(l) for l in layers), tuple(post)


def _tower_templates(spec: ModelSpec, par: MegatronParallel, tp_r: int) -> list[Tmpl]:
    """LLaVAModel's vision tower and projector on TP rank ``tp_r`` (first stage): the family's
    ``Tower`` rows in the tower's own sizes, its layers under ``vision_model.decoder.layers.{i}.``."""
    fam, tower = spec.family, spec.family.tower
    kw = dict(tp=par.tp, tp_r=tp_r, te=par.layer_spec == "te", dims=tower.dims(spec), flags=tower.flags(spec))
    out = row_templates(fam, tower.pre, hf="", local=lambda n: n, **kw)
    for i in range(tower.layers(spec)):
        out += row_templates(fam, tower.layer, hf=tower.hf_layer.format(layer=i),
                             local=lambda n, i=i: tower.megatron_layer.format(layer=i) + n, **kw)
    return out + row_templates(fam, tower.post_rows(spec), hf="", local=lambda n: n, **kw)


@lru_cache(maxsize=4096)
def _expert_templates(spec: ModelSpec, par: MegatronParallel, pp_r: int, ep_r: int, etp_r: int):
    """Per-layer expert templates for one (stage, ep rank, etp rank); empty for dense layers."""
    out = []
    mlayers = _megatron_layers(spec)
    fam = spec.family
    for v, chunk in enumerate(stage_layers(len(mlayers), par)[pp_r]):
        for i, j in enumerate(chunk):
            layer, blocks = mlayers[j]
            if spec.is_moe(layer) and any(fam.blocks[b].experts for b in blocks):
                out.append(tuple(_expert_layer(spec, par, layer, f"{_chunk_prefix(par, v)}{fam.megatron_prefix}decoder.layers.{i}.",
                                               ep_r, etp_r, blocks)))
            else:
                out.append(())
    return tuple(out)


def _stamp(rank: int, dtype: str, tmpls, out: list[LocalParam]) -> None:
    for t in tmpls:
        name, shape, pieces = t[0], t[1], t[2]
        # A template's own dtype where the table gives one: the router's expert_bias stays fp32
        # under a bf16 Float16Module (megatron casts it back at every forward, load and save;
        # ``live.named_local_params`` does the same).
        dt = t[3] if len(t) > 3 and t[3] else dtype
        out.append(LocalParam(rank, name, shape, dt,
                              tuple(Piece(rank, name, c, b, v) for c, b, v in pieces)))


# --------------------------------------------------------------------------- public API


def megatron_rank_params(spec: ModelSpec, par: MegatronParallel, rank: int) -> list[LocalParam]:
    """Every parameter ``rank`` holds, named as ``GPTModel.named_parameters()`` names it
    (``chunk{v}.`` prefixed when vpp > 1), with its pieces in HF coordinates.

    The tied last-stage ``output_layer.weight`` copy (pp > 1) is left out: never a sender.
    """
    _check(spec, par)
    c = rank_coords(par, rank)
    pre, layers, post = _dense_templates(spec, par, c["pp"], c["tp"])
    experts = _expert_templates(spec, par, c["pp"], c["ep"], c["etp"])
    out: list[LocalParam] = []
    _stamp(rank, spec.dtype, pre, out)
    for dense, routed in zip(layers, experts):
        _stamp(rank, spec.dtype, dense, out)
        _stamp(rank, spec.dtype, routed, out)
    _stamp(rank, spec.dtype, post, out)
    if par.fsdp:
        out = _fsdp(spec, par, rank, out)
    return out


def _fsdp(spec: ModelSpec, par: MegatronParallel, rank: int, params: list[LocalParam]) -> list[LocalParam]:
    """``params`` cut to the rows Megatron-FSDP leaves ``rank`` (``fsdp_rules``). A tied
    embedding shared across pipeline stages is a bucket of its own on both ends (megatron's
    ``shared_embedding``), the last stage's copy included (not described: never a sender)."""
    from .fsdp_rules import fsdp_cut, fsdp_slices

    shared: frozenset[str] = frozenset()
    extra: tuple = ()
    if spec.tied and par.pp > 1:
        pp_r = rank_coords(par, rank)["pp"]
        shared = frozenset(p.name for p in params if p.name.endswith("embedding.word_embeddings.weight"))
        if pp_r == par.pp - 1:
            last = _chunk_prefix(par, par.vpp - 1)
            extra = ((last + "output_layer.weight", (padded_vocab(spec, par) // par.tp, spec.hidden)),)
    c = rank_coords(par, rank)  # the rank's place in the dense and the expert shard groups
    groups = {False: (c["cp"] + par.cp * c["dp"], par.cp * par.dp), True: (c["edp"], par.edp)}
    return fsdp_cut(params, fsdp_slices(params, groups, shared, extra))


def megatron_layout(spec: ModelSpec, par: MegatronParallel) -> SideLayout:
    """All ranks of the training world; every DP / CP / expert-DP replica is listed (under
    Megatron-FSDP each with its own rows instead)."""
    _check(spec, par)
    params: list[LocalParam] = []
    for rank in range(par.world_size):
        params.extend(megatron_rank_params(spec, par, rank))
    notes = []
    if spec.tied and par.pp > 1:
        notes.append(TIED_OUTPUT_NOTE)
    if spec.family.check is not None:
        notes.extend(spec.family.check(spec, "megatron", par.tp))
    pattern = spec.family.megatron_pattern(spec)
    if pattern:
        notes.append(f"{spec.family.title}: megatron-core HybridModel, hybrid_layer_pattern {pattern!r}")
    return SideLayout(
        name=f"megatron(tp={par.tp},pp={par.pp},vpp={par.vpp},ep={par.ep},etp={par.etp_size},cp={par.cp},dp={par.dp}"
             f"{',fsdp' if par.fsdp else ''})",
        world_size=par.world_size,
        params=tuple(params),
        tensors=spec.tensor_table(),
        notes=tuple(notes),
    )
