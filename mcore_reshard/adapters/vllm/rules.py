"""vLLM parameter layouts (model format) as pure functions of (model spec, parallel sizes, rank).

Model format is what vLLM's weight loaders write, before ``process_weights_after_loading``
repacks anything; names are those of ``model.named_parameters()`` in vLLM 0.32 for Llama,
Qwen2, Qwen3, Qwen3-MoE and DeepSeek-V3 (``DeepseekV2ForCausalLM``). The rules mirror, in the
vLLM source:

- ``layers/linear.py``: ``QKVParallelLinear`` local ``[q_r; k_s; v_s]`` (KV heads replicated
  over ``tp // nKV`` ranks when ``tp > nKV``), ``MergedColumnParallelLinear`` ``[gate_r; up_r]``,
  ``RowParallelLinear`` column slices;
- ``layers/mamba/mamba_mixer2.py`` (Nemotron-H): ``in_proj`` ``[z_r | x_r | B_r | C_r | dt_r]``
  and ``conv1d`` ``[x_r | B_r | C_r]``, a single group held whole by every rank
  (``mamba_v2_sharded_weight_loader``); ``models/qwen3_next.py``: ``in_proj_qkvz`` /
  ``in_proj_ba`` chunks of whole key-head groups (the families' tables say which rows);
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

import copy
import math
from dataclasses import replace
from typing import Sequence

from ...layout import Box, LayoutError, LocalParam, ModelSpec, Piece, SideLayout, View, contiguous_strides
from ...layout.family import (Block, Col, Placement, Rep, Row, RowPar, Split, Vocab, check_tower_tp, col_runs,
                              split_shape, split_window)
from ...layout.quant import quantize_side
from ...layout.mtp import skipped_note
from .parallel import QUANTIZATIONS, VllmParallel, check_dims, expert_slots

__all__ = ["QUANTIZATIONS", "VllmParallel", "vllm_layout", "vllm_rank_params"]


def _rows(offset: int, rows: int, cols: int, local_off: int) -> tuple[Box, View]:
    """Rows ``[offset, offset+rows)`` of a ``[*, cols]`` tensor, stored densely at ``local_off``."""
    return Box((offset, 0), (rows, cols)), View(local_off, (rows, cols), (cols, 1))


def _cols(offset: int, rows: int, cols: int, local_cols: int, local_off: int = 0) -> tuple[Box, View]:
    """Columns ``[offset, offset+cols)`` stored as a ``[rows, local_cols]`` local block."""
    return Box((0, offset), (rows, cols)), View(local_off, (rows, cols), (local_cols, 1))


def _full(shape: tuple[int, ...]) -> tuple[Box, View]:
    return Box.full(shape), View(0, shape, contiguous_strides(shape))


def _run(start: int, n: int, shape: tuple[int, ...], local_off: int) -> tuple[Box, View]:
    """Rows ``[start, start+n)`` of a tensor of any rank, stored densely at local row ``local_off``."""
    if len(shape) == 1:
        return Box((start,), (n,)), View(local_off, (n,), (1,))
    if len(shape) == 2:
        return _rows(start, n, shape[1], local_off * shape[1])
    inner = math.prod(shape[1:])
    box = (n, *shape[1:])
    return Box((start,) + (0,) * (len(shape) - 1), box), View(local_off * inner, box, contiguous_strides(box))


# A template entry: (local suffix, local shape, ((canonical suffix, box, view), ...), dtype or None).
_Entry = tuple


class _Builder:
    """Builds rank parameters from the family's table (``layout.family``) read with vLLM's
    placements, per-coordinate templates shared by every rank and layer holding the same
    geometry (boxes and views interned: one object per value)."""

    def __init__(self, spec: ModelSpec, par: VllmParallel) -> None:
        self.spec, self.par = spec, par
        self.fam = spec.family
        #: The family's own refusals first (one line naming the tensor), and its notes at this TP.
        self.family_notes = self.fam.check(spec, "vllm", par.tp) if self.fam.check is not None else ()
        #: ``mm_encoder_tp_mode="data"`` where the model supports it: the tower whole on every rank.
        self.tower_whole = self.fam.tower is not None and par.mm_encoder_tp_mode == "data" and \
            self.fam.tower.vllm_data_parallel
        if self.fam.tower is not None:
            check_tower_tp(self.fam, spec, "vllm", 1 if self.tower_whole else par.tp)
        if self.fam.tower is not None and par.pp > 1:
            raise LayoutError(f"{self.fam.title} with vllm pipeline_parallel_size={par.pp}: vLLM builds the vision "
                              f"tower on every stage; not described, use pp=1")
        self.d = check_dims(spec, par)
        self.dims, self.flags = self.fam.dims(spec), self.fam.flags(spec)
        self._blocks: dict[tuple[str, int], tuple[_Entry, ...]] = {}
        self._slots: dict[tuple[str, int], tuple[tuple[str, tuple[int, ...], tuple, str | None], ...]] = {}
        self._boxes: dict[tuple, Box] = {}
        self._views: dict[tuple, View] = {}
        self._views_by_slot: dict[tuple, list] = {}
        self._names: dict[tuple[int, str], tuple[str, ...]] = {}
        #: A VLM's tower and projector read the same rules in the tower's sizes (``Family.tower``).
        self.tower = None
        if self.fam.tower is not None:
            self.tower = copy.copy(self)
            self.tower.dims, self.tower.flags = self.fam.tower.dims(spec), self.fam.tower.flags(spec)
            self.tower._blocks = {}
            if self.tower_whole:
                self.tower.par = replace(par, tp=1)
        layers = range(spec.num_layers + spec.mtp_layers)
        self._prefix = [self.fam.hf_layer.format(layer=i) for i in layers]  # canonical names
        self._local = [self.fam.vllm_layer.format(layer=i) for i in layers]  # vLLM's

    def _intern(self, box: Box, view: View) -> tuple[Box, View]:
        box = self._boxes.setdefault((box.offsets, box.sizes), box)
        return box, self._views.setdefault((view.offset, view.shape, view.stride), view)

    # -- one table row group on one coordinate

    def entries(self, rows: Sequence[Row], n: int, r: int) -> tuple[_Entry, ...]:
        """The local tensors of ``rows`` on rank ``r`` of a group of ``n`` (canonical names
        relative, rows naming one local tensor concatenated in table order)."""
        groups: dict[str, list[tuple[Row, Placement]]] = {}
        for row in rows:
            if not self.fam.present(row, self.flags):
                continue
            if row.vllm is None:
                raise LayoutError(f"{self.fam.title}: vLLM holds no {row.hf}; this layout cannot be served")
            groups.setdefault(row.vllm.name, []).append((row, row.vllm))
        out = []
        for name, members in groups.items():
            out.append(self._group(name, members, n, r))
        return tuple(out)

    def _group(self, name: str, members: list, n: int, r: int) -> _Entry:
        fam, s = self.fam, self.spec
        row, pl = members[0]
        dtype = row.dtype
        shape = fam.resolve(row.shape, self.dims)
        kinds = {type(p) for _, p in members}
        if len(members) > 1 and not kinds <= {Rep, Col}:
            raise LayoutError(f"{fam.title}: vLLM's {name} fuses {[m.hf for m, _ in members]}: only Rep and Col "
                              f"placements concatenate")
        if kinds == {Vocab}:
            (lo, hi), rows = self._vocab_range(r)
            pieces = ((row.hf, *self._intern(*_rows(lo, hi - lo, shape[1], 0))),) if hi > lo else ()
            return (name, (rows, shape[1]), pieces, dtype)
        if kinds == {RowPar}:
            k = shape[1] // n
            return (name, (shape[0], k), ((row.hf, *self._intern(*_cols(r * k, shape[0], k, k))),), dtype)
        if kinds == {Split}:
            return self._split(name, row, pl, shape, n, r, None, 0)[0] + (dtype,)
        if len(members) == 1 and kinds == {Rep} and row.part is None:
            return (name, shape, ((row.hf, *self._intern(*_full(shape))),), dtype)
        pieces, at = [], 0
        cols = shape[1:]
        for m, p in members:
            mshape = fam.resolve(m.shape, self.dims)
            if mshape[1:] != cols:
                raise LayoutError(f"{fam.title}: vLLM's {name} concatenates {m.hf} {mshape}: parts must have "
                                  f"{cols} columns")
            start, rows = (0, mshape[0]) if m.part is None else fam.resolve(m.part, self.dims)
            runs = [(start, rows)]
            if isinstance(p, Col):
                runs = col_runs(m.hf, p, start, rows, n, r, lambda d: fam.resolve(d, self.dims), replicate=True)
            for start, rows in runs:
                pieces.append((m.hf, *self._intern(*_run(start, rows, mshape, at))))
                at += rows
        return (name, (at, *cols), tuple(pieces), dtype)

    def _split(self, name: str, row: Row, pl: Split, shape: tuple[int, ...], n: int, r: int, expert: int | None,
               offset: int):
        """A ``Split`` placement's local shape and its piece (none on a ``rank0`` placement's
        other ranks, which hold zeros)."""
        local = split_shape(shape, pl, n, expert)
        geo = split_window(row.hf, shape, pl, n, r, expert, offset)
        pieces = () if geo is None else ((row.hf, *self._intern(geo.box, geo.view)),)
        return (name, local, pieces), local

    def _vocab_range(self, r: int) -> tuple[tuple[int, int], int]:
        s, d = self.spec, self.d
        return (min(r * d.vocab_rows, s.vocab), min((r + 1) * d.vocab_rows, s.vocab)), d.vocab_rows

    def block(self, name: str, rows: Sequence[Row], r: int) -> tuple[_Entry, ...]:
        """A non-expert block's entries on TP rank ``r`` (cached)."""
        key = (name, r)
        if key not in self._blocks:
            self._blocks[key] = self.entries(rows, self.par.tp, r)
        return self._blocks[key]

    def experts(self, name: str, block: Block, mr: int) -> tuple:
        """A routed-expert block's slot layout on MoE-TP rank ``mr``: per local tensor, its
        per-slot shape and, per row, (canonical suffix with ``{e}``, box, view offset in the
        slot, placement) -- the boxes shared by every slot, layer and rank."""
        key = (name, mr)
        if key in self._slots:
            return self._slots[key]
        d, fam = self.d, self.fam
        n, r = (1, 0) if d.ep > 1 else (d.moe_tp, mr)
        groups: dict[str, list[tuple[Row, Placement]]] = {}
        for row in block.rows:
            if fam.present(row, self.flags):
                if row.vllm is None:
                    raise LayoutError(f"{fam.title}: vLLM holds no {row.hf}; this layout cannot be served")
                groups.setdefault(row.vllm.name, []).append((row, row.vllm))
        out = []
        for lname, members in groups.items():
            if block.stacked:
                (row, pl), = members
                shape = fam.resolve(row.shape, self.dims)
                out.append((lname, split_shape(shape, pl, n, 0), ((row, pl, shape, n, r),),
                            row.dtype))
            else:
                entry = self._group(lname, members, n, r)
                out.append((lname, entry[1], entry[2], entry[3]))
        self._slots[key] = tuple(out)
        return self._slots[key]

    # -- one rank

    def rank_params(self, rank: int) -> list[LocalParam]:
        s, par, d, fam = self.spec, self.par, self.d, self.fam
        if not 0 <= rank < par.world_size:
            raise LayoutError(f"rank {rank} outside the vLLM world of {par.world_size} ranks")
        tp_r = rank % par.tp
        pp_r = rank // par.tp % par.pp
        first, last = pp_r == 0, pp_r == par.pp - 1
        out: list[LocalParam] = []

        def add(entries) -> None:
            for name, shape, pieces, dtype in entries:
                out.append(LocalParam(rank, name, shape, dtype or s.dtype,
                                      tuple(Piece(rank, name, c, b, v) for c, b, v in pieces)))

        # Some families build embed_tokens, norm and lm_head on every PP stage (Qwen3-MoE); the
        # others the embedding on the first stage (also the last when tied: the head *is* it)
        # and the norm and head on the last.
        everywhere = fam.vllm_top_on_every_stage
        if first and self.tower is not None:
            self.tower_params(out, rank)
        if first or everywhere or (s.tied and last):
            add(self.block("<pre>", fam.pre, tp_r))
        elif fam.vllm_every_stage:
            add(self.block("<pre*>", [r for r in fam.pre if r.hf in fam.vllm_every_stage], tp_r))
        start, end = d.stages[pp_r]
        for layer in range(start, end):
            self.layer_params(out, rank, layer)
        if last or everywhere:
            add(self.block("<post>", fam.post, tp_r))
        elif fam.vllm_every_stage:
            add(self.block("<post*>", [r for r in fam.post if r.hf in fam.vllm_every_stage], tp_r))
        return out

    def tower_params(self, out: list[LocalParam], rank: int) -> None:
        """A VLM's vision tower and projector on ``rank`` (``clip.py``, ``llava.py``)."""
        tower, tb, tp_r = self.fam.tower, self.tower, rank % self.par.tp
        if self.tower_whole:  # mm_encoder_tp_mode="data": every rank holds the whole tower
            tp_r = 0
        for key, rows, layers in (("<tower-pre>", tower.pre, [None]), ("<tower-layer>", tower.layer,
                                  range(tower.layers(self.spec))), ("<tower-post>", tower.post_rows(self.spec), [None])):
            for layer in layers:
                p = "" if layer is None else tower.hf_layer.format(layer=layer)
                q = "" if layer is None else tower.vllm_layer.format(layer=layer)
                for suffix, shape, pieces, dtype in tb.block(key, rows, tp_r):
                    name = q + suffix
                    out.append(LocalParam(rank, name, shape, dtype or self.spec.dtype,
                                          tuple(Piece(rank, name, p + c, b, v) for c, b, v in pieces)))

    def layer_params(self, out: list[LocalParam], rank: int, layer: int, local: str | None = None) -> None:
        """Decoder layer ``layer``'s parameters on ``rank``, named under ``local`` (default
        the family's ``vllm_layer``; a draft's MTP layer: ``...mtp_block.``), boxes of its
        ``hf_layer`` tensors."""
        s, par = self.spec, self.par
        tp_r = rank % par.tp
        mr = rank // (par.tp * par.pp) % par.dp * par.tp + tp_r  # flattened MoE rank (ep_rank with EP)
        p = self._prefix[layer]
        q = self._local[layer] if local is None else local
        for bname, block in self.fam.layer_blocks(s, layer):
            if block.experts:
                self._add_experts(out, rank, layer, bname, block, mr, q)
                continue
            for suffix, shape, pieces, dtype in self.block(bname, block.rows, tp_r):
                name = q + suffix
                out.append(LocalParam(rank, name, shape, dtype or s.dtype,
                                      tuple(Piece(rank, name, p + c, b, v) for c, b, v in pieces)))

    def _slot_views(self, bname: str, mr: int, lname: str, parts: tuple, slot: int, n: int) -> list:
        """Per slot, each part's view (slot ``j``'s part at ``j * slot`` + its offset), shared
        by every layer and rank of the block."""
        views = self._views_by_slot.setdefault((bname, mr, lname), [])
        for j in range(len(views), n):
            views.append(tuple(self._views.setdefault((j * slot + v.offset, v.shape, v.stride),
                                                      View(j * slot + v.offset, v.shape, v.stride)) for _, _, v in parts))
        return views

    def _expert_names(self, layer: int, suffix: str) -> tuple[str, ...]:
        """Canonical names of ``suffix`` (with ``{e}``) for every expert of ``layer``."""
        key = (layer, suffix)
        if key not in self._names:
            p = self._prefix[layer]
            self._names[key] = tuple(p + suffix.format(e=e) for e in range(self.spec.num_experts))
        return self._names[key]

    def _add_experts(self, out: list[LocalParam], rank: int, layer: int, bname: str, block: Block, mr: int,
                     local: str) -> None:
        s, d = self.spec, self.d
        if d.ep > 1:
            first_slot, n = expert_slots(d, mr)
        else:
            first_slot, n = 0, d.physical
        phys = d.maps.get(layer, d.initial_map)
        p = self._prefix[layer]
        for lname, slot_shape, parts, dtype in self.experts(bname, block, mr):
            name = local + self.fam.vllm_experts + lname
            slot = math.prod(slot_shape)
            pieces: list[Piece] = []
            if block.stacked:  # one piece per run of slots holding consecutive experts, as vLLM copies them
                (row, pl, shape, gn, gr), = parts
                for j0, e0, run in _runs([phys[first_slot + j] for j in range(n)]):
                    geo = split_window(row.hf, shape, pl, gn, gr, e0, j0 * slot)
                    if geo is not None:
                        b, v = geo.box, geo.view
                        box, view = self._intern(Box((e0, *b.offsets[1:]), (run, *b.sizes[1:])),
                                                 View(v.offset, (run, *v.shape[1:]), (slot, *v.stride[1:])))
                        pieces.append(Piece(rank, name, p + row.hf, box, view))
            if not block.stacked:
                views = self._slot_views(bname, mr, lname, parts, slot, n)
                names = [self._expert_names(layer, c) for c, _, _ in parts]
                for j in range(n):
                    e = phys[first_slot + j]
                    for k, (_, box, _) in enumerate(parts):
                        pieces.append(Piece(rank, name, names[k][e], box, views[j][k]))
            out.append(LocalParam(rank, name, (n, *slot_shape), dtype or s.dtype, tuple(pieces)))


def _runs(experts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first slot, first expert, length) of each run of slots holding consecutive experts."""
    out: list[tuple[int, int, int]] = []
    for j, e in enumerate(experts):
        if out and out[-1][1] + out[-1][2] == e:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((j, e, 1))
    return out


# ----------------------------------------------------------------------------- public API


def vllm_rank_params(spec: ModelSpec, par: VllmParallel, rank: int) -> list[LocalParam]:
    """The model-format parameters of one vLLM rank, each with its canonical (HF) pieces
    (of an FP8 engine: in bf16, as its loaders take them; ``vllm_layout`` describes the FP8 form)."""
    return _Builder(spec, par).rank_params(rank)


def vllm_layout(spec: ModelSpec, par: VllmParallel) -> SideLayout:
    """Every rank's parameters: the inference side of a refit plan."""
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
    if spec.family.vllm_top_on_every_stage and par.pp > 1:
        notes.append(f"{spec.family.title} holds embed_tokens, norm and lm_head on every PP stage")
    if spec.family.vllm_every_stage and par.pp > 1:
        notes.append(f"{spec.family.title} holds {', '.join(spec.family.vllm_every_stage)} on every PP stage")
    notes.extend(b.family_notes)
    if spec.mla is not None:
        notes.append("MLA kv_b_proj: vLLM absorbs it into W_UK/W_UV after loading (kernel format != model "
                     "format): the applier writes it through the layerwise reload and rebuilds W_UK/W_UV")
    if spec.mtp_layers:
        notes.append(skipped_note(spec))
    notes.extend(spec.family.notes)
    tensors = spec.tensor_table()
    side = SideLayout("vllm", par.world_size, tuple(params), tensors, tuple(notes))
    fp8 = par.fp8
    if fp8 is None:
        return side
    if spec.hybrid is not None:
        raise LayoutError(f"{spec.family.title}: FP8 rollout of a hybrid family is not built (its Mamba / GDN "
                          "mixers' block-FP8 layout is not described); leave vllm.quantization null")
    side = quantize_side(side, fp8, "vllm")
    return replace(side, notes=side.notes + (
        f"block FP8 ({fp8.block}x{fp8.block} {fp8.dtype} codes + fp32 weight_scale_inv; kept in {spec.dtype}: "
        f"embeddings, lm_head, norms, modules matching {list(fp8.ignore)}); vLLM packs the codes after loading: "
        f"written through the layerwise reload",))
