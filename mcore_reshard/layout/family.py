"""A model family is one table: its canonical (HF) tensors, and where each library holds them.

In the spirit of Megatron-Bridge's mapping registry (``AutoMapping``, ``QKVMapping``,
``GatedMLPMapping``, ...), but for both ends of a refit and on metadata alone: a :class:`Row`
names one HF tensor (its name relative to the layer, its shape in named sizes) and, for each
library, a *placement* -- the local parameter that holds it and the shard rule that cuts it.
The adapters interpret placements (``adapters/megatron/rules.py``, ``adapters/vllm/rules.py``);
the canonical tensor list (``ModelSpec.tensors``) is the rows, in table order. A test builds
transformers' own model class on the meta device for every family's tiny and full-size config
and checks the rows against its checkpoint names and shapes (``tests/test_families.py``).

How a family is written (one module under ``layout/families/``; ``docs/families.md`` walks
through gpt-oss):

1. ``read(cfg)``: the :class:`~mcore_reshard.layout.spec.ModelSpec` fields from the HF config
   (sizes, which layers are MoE, flags such as ``qkv_bias``). Refuse here, in one line, what
   the family does not describe.
2. ``dims(spec)``: the named sizes the rows' shapes use. :func:`standard_dims` gives ``H``
   (hidden), ``V`` (vocab), ``D`` (head dim), ``heads``, ``kv_heads``, ``Q`` (heads * D),
   ``KV`` (kv_heads * D), ``F`` (dense intermediate), ``FE`` (expert intermediate), ``E``
   (experts), ``S`` (shared-expert intermediate); a family adds its own.
3. ``blocks``: named tuples of rows (``"attention"``, ``"mlp"``, ``"moe"``, ``"experts"``, a
   hybrid's ``"mamba"`` ...) and ``layers(spec, i)``: the blocks decoder layer ``i`` is made of,
   in HF order -- so per-layer mixer kinds (attention, MLA, Mamba, GDN) and MLP kinds (dense,
   MoE, MoE with a shared expert, dense first layers) are a choice per layer.
   A :class:`Block` with ``experts=True`` holds per-routed-expert rows: HF names carry
   ``{e}`` (one tensor per expert) or the tensor stacks the experts in dim 0 (``stacked``).
4. ``pre`` / ``post``: the rows outside the decoder layers (embedding on the first pipeline
   stage; final norm and output head on the last).
5. ``flags(spec)``: the names a row's ``when`` may test (default :func:`standard_flags`).
6. ``megatron_config(spec)``: the TransformerConfig fields megatron-core needs for the family,
   as data (named activations); ``tiny``: the config the tests write locally (``tiny-<name>``);
   ``hf_layer`` / ``vllm_layer``: a layer's prefix in the checkpoint and in vLLM; ``notes``.

A row, e.g. the fused QKV weight's query part::

    Row("self_attn.q_proj.weight", ("Q", "H"),
        megatron=QKV("self_attention.linear_qkv.weight"),
        vllm=Col("self_attn.qkv_proj.weight"))

Placements (what each adapter does with one is its library's rule, in its module):

- :class:`Rep`: the whole tensor on every rank of the group.
- :class:`Col`: rows chunked over TP (``units``: rows come in that many heads/groups; fewer
  units than ranks replicate each unit over ``tp // units`` ranks, vLLM's KV heads).
- :class:`RowPar`: columns chunked over TP.
- :class:`Vocab`: vocabulary rows, padded by the library's rule, chunked over TP.
- :class:`QKV`: megatron's fused ``linear_qkv``: the rows that name it are interleaved per KV
  group (``[q_g; k_g; v_g]``) and the result is chunked over TP.
- :class:`Split`: a stacked or transposed tensor (gpt-oss's experts): which HF dims the local
  rows walk (``rows``, outermost first), which the local columns walk (``cols``), and which
  HF dim the parallel group chunks (``split``; None: replicated; ``"rank0"``: held by rank 0
  of the group and zero elsewhere, as vLLM's row-parallel expert bias).

Rows that name the **same local parameter** are concatenated along dim 0 in table order, each
rank's part after the previous row's: ``[gate_r; up_r]`` (megatron ``linear_fc1``, vLLM
``gate_up_proj``), vLLM's ``[q_r; k_s; v_s]`` and ``fused_qkv_a_proj``. A fused tensor whose
megatron side is ``[z_r | x_r | B_r | C_r | dt_r]`` per TP rank is rows of ``Col`` placements
with one name; where the parts come from one HF tensor, each row carries ``part=(offset,
rows)``: the HF rows it takes from that tensor.

Hybrid families (Nemotron-H, Qwen3-Next: ``families/nemotron_h.py``, ``qwen3_next.py``) use
a few more pieces of the form:

- ``Block.symbol``: megatron-core's ``HybridModel`` builds one decoder layer per symbol of its
  ``hybrid_layer_pattern`` (``M`` Mamba2, ``G`` GDN, ``*`` attention, ``-`` MLP, ``E`` MoE);
  ``Block.megatron_layer`` says which of an HF layer's megatron layers holds the block (a
  Qwen3-Next HF layer is two). ``Family.megatron_layers`` / ``megatron_pattern`` derive both
  from the table.
- ``Col(units=, parts=)``: a local tensor that takes, per unit (head, group) of the rank, some
  rows of each, part by part -- megatron's GDN ``in_proj`` ``[q_r | k_r | v_r | z_r | b_r | a_r]``
  of HF's per-key-head ``[q_g; k_g; v_g; z_g]`` and ``[b_g; a_g]``; ``QKV(units=, parts=)`` the
  same inside each KV group (a gated attention's ``q_proj``, ``[q_h; gate_h]`` per head).
- rows of any rank concatenate (a conv weight ``[C, 1, k]``'s ``[x | B | C]`` parts).
- ``Family.hf_layer`` (HF's layer prefix: Nemotron-H's ``backbone.layers.{layer}.``),
  ``vllm_experts`` (vLLM's expert container), ``vllm_every_stage`` (the ``pre``/``post`` rows
  vLLM builds on every PP stage) and ``check(spec, library, tp)``: a refusal in one line of a TP
  one library cannot shard, and the notes the plan report carries there.

A ``Placement`` may carry ``te=``: megatron's Transformer-Engine spec holds it elsewhere (a
norm fused into the next linear) or differently; ``widened=True``: the library holds the model's
dtype where the row carries a wider one, and widens its copy when sending. None placements mean
the library holds no such tensor (the adapter refuses a layout that needs it, in one line
naming the tensor).

Pure metadata: no torch, megatron or vllm import (``layout``'s contract).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, Union

from .descriptor import Box, LayoutError, View

__all__ = [
    "Dim", "Placement", "Rep", "Col", "RowPar", "Vocab", "QKV", "Split", "Row", "Block", "Family", "Tower",
    "standard_dims", "standard_flags", "check_tower_tp", "Window", "window", "split_shape", "split_window", "unit_runs", "col_runs",
]

#: A size: an int, or a name that the family's ``dims(spec)`` resolves.
Dim = Union[int, str]


# ----------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class Placement:
    """Where one library holds a canonical tensor: the local parameter's name (relative to
    the row's module prefix) and, through its class, the shard rule."""

    name: str
    #: megatron's Transformer-Engine layer spec holds it as this placement instead (a norm
    #: fused into the following linear, an MLA down-projection replicated, ...).
    te: "Placement | None" = None
    #: The library holds this tensor in the model's dtype although the row's is wider (the
    #: other library's): its side describes the row's dtype and widens its copy when sending
    #: (exact; megatron's bf16 router weight for vLLM's fp32 GLM-4.5 router).
    widened: bool = False


@dataclass(frozen=True)
class Rep(Placement):
    """The whole tensor on every rank."""

    #: The library's local shape where it holds the same row-major storage in another shape
    #: (megatron-core's CLIP ``class_token`` is ``(1, 1, H)``, HF's ``class_embedding`` ``(H,)``).
    shape: tuple[Dim, ...] | None = None


@dataclass(frozen=True)
class Col(Placement):
    """Rows chunked over the tensor-parallel group (column-parallel linears, per-head vectors)."""

    #: Rows come in this many units (heads, groups); fewer units than ranks: each unit is
    #: replicated over ``tp // units`` ranks (vLLM's ``QKVParallelLinear`` KV heads).
    units: Dim | None = None
    #: Per unit, the rows ``(offset, rows)`` this local tensor takes, part after part: TP
    #: chunks the units, and the rank holds the first part of each of its units, then the
    #: second ... (megatron's GDN ``in_proj`` = ``[q_r | k_r | v_r | z_r]`` of HF's
    #: per-key-head ``[q_g; k_g; v_g; z_g]``). Needs ``units``.
    parts: tuple[tuple[Dim, Dim], ...] = ()


@dataclass(frozen=True)
class RowPar(Placement):
    """Columns chunked over the tensor-parallel group (row-parallel linears)."""


@dataclass(frozen=True)
class Vocab(Placement):
    """Vocabulary rows, padded by the library's rule and chunked over TP."""


@dataclass(frozen=True)
class QKV(Placement):
    """megatron-core's fused ``linear_qkv``: the rows naming it interleaved per KV group, then
    chunked over TP (a chunk may end inside a group or a head). ``units`` / ``parts`` as
    :class:`Col`'s, inside each group: a gated attention's ``q_proj`` (``[q_h; gate_h]`` per
    head) gives the group's block its heads' queries, then their gates."""

    units: Dim | None = None
    parts: tuple[tuple[Dim, Dim], ...] = ()


@dataclass(frozen=True)
class Split(Placement):
    """A tensor whose local layout is a transpose or reshape of HF's (gpt-oss's stacked
    experts). HF dims are counted *after* a stacked tensor's expert dim. The local tensor is
    ``rows`` then ``cols`` HF dims, each group row-major; ``split`` is the HF dim the group
    chunks (None: replicated; ``"rank0"``: rank 0 of the group holds it, the others zeros)."""

    rows: tuple[int, ...] = (0,)
    cols: tuple[int, ...] = ()
    split: int | str | None = None


# ----------------------------------------------------------------------------- rows, blocks, families


@dataclass(frozen=True)
class Row:
    """One canonical HF tensor and where each library holds it."""

    #: HF name relative to the layer prefix (``{e}``: the routed expert's index).
    hf: str
    shape: tuple[Dim, ...]
    megatron: Placement | None
    vllm: Placement | None
    #: Element type when it is not the model's (DeepSeek's ``e_score_correction_bias``: fp32).
    dtype: str | None = None
    #: A flag of ``family.flags(spec)`` the row exists under (``"!x"``: unless ``x``).
    when: str | None = None
    #: The HF checkpoint's shape where the plan addresses the same row-major storage in a
    #: finer shape (gpt-oss's interleaved gate/up as ``(E, H, FE, 2)``): loaders reshape.
    checkpoint: tuple[Dim, ...] | None = None
    #: ``(offset, rows)``: this row takes these HF rows of a tensor several rows share
    #: (a fused tensor's parts); None: the whole tensor.
    part: tuple[Dim, Dim] | None = None


@dataclass(frozen=True)
class Block:
    """Rows that appear together in a layer (an attention, an MLP, the routed experts)."""

    rows: tuple[Row, ...]
    #: Per routed expert: HF names carry ``{e}``, or (``stacked``) dim 0 of each tensor is the
    #: expert. Each library holds them in its expert container (the adapter's rule).
    experts: bool = False
    stacked: bool = False
    #: megatron-core's ``HybridModel`` builds a decoder layer per mixer: the symbol of
    #: ``hybrid_layer_pattern`` (``M`` Mamba, ``G`` GDN, ``*`` attention, ``-`` MLP, ``E``
    #: MoE) of the megatron layer holding this block; "" for ``GPTModel`` families.
    symbol: str = ""
    #: Which of the HF layer's megatron layers holds the block (a Qwen3-Next HF layer is two:
    #: its token mixer, then its MLP or MoE).
    megatron_layer: int = 0


@dataclass(frozen=True)
class Tower:
    """A vision encoder and its projector beside the language model (LLaVA): the rows before
    its layers (patch and position embeddings), one encoder layer's rows, the rows after (the
    projector), each library's layer prefix, and the tower's own named sizes (``dims``: the
    same names as the language model's -- ``H``, ``heads``, ``kv_heads``, ``Q``, ``F`` ... --
    for the tower, so that the shared rules read its rows unchanged). ``pre`` / ``post`` rows
    carry full names on every side. Both libraries hold the tower on the first pipeline stage.
    """

    pre: tuple[Row, ...]
    layer: tuple[Row, ...]
    post: tuple[Row, ...]
    #: The encoder layers both libraries build (``spec -> n``).
    layers: Callable[[Any], int]
    dims: Callable[[Any], Mapping[str, int]]
    flags: Callable[[Any], frozenset[str]]
    hf_layer: str
    megatron_layer: str
    vllm_layer: str
    #: Rows after ``post`` that the spec decides (Qwen3-VL's deepstack mergers, one per
    #: ``deepstack_visual_indexes`` entry), full names on every side.
    extra: Callable[[Any], tuple[Row, ...]] | None = field(default=None, compare=False)
    #: vLLM can keep the tower whole on every TP rank (``mm_encoder_tp_mode="data"``,
    #: ``supports_encoder_tp_data``); False: it shards it by weights whatever the mode says.
    vllm_data_parallel: bool = False
    #: The part of ``post`` + ``extra`` that projects into the language model (what
    #: ``freeze_vision_projection`` freezes): names starting with one of these.
    projector: tuple[str, ...] = ()
    #: The sizes a TP that shards the tower must divide, as ``(config key, size, the tensor
    #: it cuts)`` (``spec -> ...``): :func:`check_tower_tp` refuses any other TP in one line.
    tp_sizes: Callable[[Any], tuple[tuple[str, int, str], ...]] | None = field(default=None, compare=False)
    #: megatron holds the tower whole on every rank (Megatron-Bridge's Qwen2.5-VL: HF's module).
    megatron_whole: bool = False

    def post_rows(self, spec: Any) -> tuple[Row, ...]:
        """``post`` and the spec's ``extra`` rows."""
        return self.post + (self.extra(spec) if self.extra is not None else ())


def check_tower_tp(fam: "Family", spec: Any, library: str, tp: int) -> None:
    """Refuse, in one line naming the tensor, a TP that ``library`` ("megatron" or "vllm")
    would shard ``fam``'s vision tower over and that does not divide it (``Tower.tp_sizes``).
    ``tp`` is the tower's own: 1 where the library holds it whole (vLLM's
    ``mm_encoder_tp_mode="data"``, ``Tower.megatron_whole``)."""
    tower = fam.tower
    if tower is None or tower.tp_sizes is None or tp == 1:
        return
    who = "megatron-core" if library == "megatron" else "vLLM"
    hint = "; mm_encoder_tp_mode=data keeps it whole" if library == "vllm" and tower.vllm_data_parallel else ""
    for what, n, tensor in tower.tp_sizes(spec):
        if n % tp:
            raise LayoutError(f"{fam.title} {tensor} ({what}={n}): {who} shards the vision tower over tp={tp}, "
                              f"which does not divide it{hint}")


def standard_dims(spec: Any) -> dict[str, int]:
    """The named sizes every family has (see the module docstring)."""
    D = spec.head_dim
    return dict(H=spec.hidden, V=spec.vocab, D=D, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                Q=spec.num_heads * D, KV=spec.num_kv_heads * D, F=spec.intermediate, FE=spec.moe_intermediate,
                E=spec.num_experts, S=spec.shared_intermediate)


def standard_flags(spec: Any) -> frozenset[str]:
    """The flags every family has: ``tied``, ``qkv_bias``, ``o_bias``, ``qk_norm``,
    ``router_bias`` (``e_score_correction_bias``), ``shared`` (a shared expert)."""
    names = {"tied": spec.tied, "qkv_bias": spec.qkv_bias, "o_bias": getattr(spec, "o_bias", False),
             "qk_norm": spec.qk_norm, "router_bias": spec.router_bias, "shared": bool(spec.shared_intermediate)}
    return frozenset(k for k, v in names.items() if v)


@dataclass(frozen=True)
class Family:
    """A model family: how to read its HF config, and its table (see the module docstring)."""

    name: str
    #: How people write its name (plan notes, refusals).
    title: str
    architectures: tuple[str, ...]
    #: ``model_type`` values of configs without ``architectures`` (Kimi-K2: ``kimi_k2``).
    model_types: tuple[str, ...]
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    blocks: Mapping[str, Block]
    layers: Callable[[Any, int], tuple[str, ...]]
    pre: tuple[Row, ...]
    post: tuple[Row, ...]
    dims: Callable[[Any], Mapping[str, int]] = standard_dims
    flags: Callable[[Any], frozenset[str]] = standard_flags
    #: vLLM builds the embedding, final norm and output head on every pipeline stage (Qwen3-MoE).
    vllm_top_on_every_stage: bool = False
    #: Where decoder layer ``{layer}``'s rows live: the HF checkpoint's prefix (Nemotron-H:
    #: ``backbone.layers.{layer}.``) and vLLM's local one (megatron's is ``decoder.layers.{i}.``
    #: with the stage-local index, its own rule).
    hf_layer: str = "model.layers.{layer}."
    vllm_layer: str = "model.layers.{layer}."
    #: Of ``pre`` / ``post``, the rows (HF names) vLLM builds on every stage where it does not
    #: build them all there (Qwen3-Next: the embedding and the head, not the final norm).
    vllm_every_stage: tuple[str, ...] = ()
    #: vLLM's container of a MoE layer's routed experts, under the layer (FusedMoE's ``w13`` ...).
    vllm_experts: str = "mlp.experts.routed_experts."
    #: ``check(spec, library, tp)``: refuses, in one line naming the tensor, a TP that
    #: ``library`` ("megatron" or "vllm") cannot shard this spec at (a Mamba head count TP
    #: does not divide), before any layout is built; returns the lines the plan report carries
    #: about how that library holds it there (vLLM replicating a single Mamba group). None:
    #: nothing to refuse or say.
    check: Callable[[Any, str, int], tuple[str, ...]] | None = field(default=None, compare=False)
    #: Lines the vLLM side's layout adds to the plan report for this family (what a refit of
    #: it carries differently from its published checkpoints, and why).
    notes: tuple[str, ...] = ()
    #: TransformerConfig fields for megatron-core (pure data, ``adapters/megatron/build.py``
    #: resolves named callables such as ``"silu"``); None: the adapter's defaults.
    megatron_config: Callable[[Any], dict[str, Any]] | None = field(default=None, compare=False)
    #: The tiny config the tests write locally (an HF ``config.json``'s contents), and the
    #: spread its random matrices are drawn with (``infra.checkpoint.make_tiny_checkpoint``).
    tiny: Mapping[str, Any] = field(default_factory=dict, compare=False)
    tiny_std: float = 0.05
    #: How the tiny checkpoint draws biases: "one" (1 + N(0, 0.1), as norm weights) or "zero"
    #: (N(0, 0.1): a vision tower whose biases are all near 1 hides the image).
    tiny_biases: str = "one"
    #: A vision-language family: the vision tower and projector (``Tower``); the language
    #: model's sizes are read from ``cfg[text_config]``, its megatron-core parameters are under
    #: ``megatron_prefix`` (LLaVAModel's ``language_model.``).
    tower: "Tower | None" = None
    text_config: str | None = None
    megatron_prefix: str = ""

    def __post_init__(self) -> None:
        for name, block in self.blocks.items():
            for row in block.rows:
                if block.experts and not block.stacked and "{e}" not in row.hf:
                    raise LayoutError(f"family {self.name}: expert row {row.hf!r} of block {name!r} has no {{e}}")

    # -- the table, evaluated for one spec

    def present(self, row: Row, flags: frozenset[str]) -> bool:
        """Whether ``row`` exists under ``flags`` (its ``when``)."""
        if row.when is None:
            return True
        return (row.when[1:] not in flags) if row.when.startswith("!") else (row.when in flags)

    def layer_blocks(self, spec: Any, layer: int) -> tuple[tuple[str, Block], ...]:
        """The blocks of decoder layer ``layer``, in HF order, with their names."""
        try:
            return tuple((b, self.blocks[b]) for b in self.layers(spec, layer))
        except KeyError as exc:
            raise LayoutError(f"family {self.name}: layer {layer} names an unknown block {exc.args[0]!r}") from None

    def megatron_layers(self, spec: Any) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """megatron-core's decoder layers in order: (HF layer, the names of its blocks there)
        each. ``GPTModel`` families: one per HF layer; a hybrid HF layer is one megatron layer
        per ``Block.megatron_layer``."""
        return _megatron_layers(self, spec)

    def megatron_pattern(self, spec: Any) -> str:
        """megatron-core's ``hybrid_layer_pattern`` (no ``|``: stages come from the parallel
        sizes), from the blocks' symbols; "" for a ``GPTModel`` family."""
        out = []
        for layer, names in self.megatron_layers(spec):
            symbols = {self.blocks[n].symbol for n in names} - {""}
            if not symbols:
                return ""
            if len(symbols) > 1:
                raise LayoutError(f"family {self.name}: HF layer {layer}'s megatron layer holds blocks of "
                                  f"several symbols {sorted(symbols)}")
            out.append(symbols.pop())
        return "".join(out)

    def resolve(self, shape: Sequence[Dim], dims: Mapping[str, int]) -> tuple[int, ...]:
        """A row's shape in elements."""
        try:
            return tuple(d if isinstance(d, int) else int(dims[d]) for d in shape)
        except KeyError as exc:
            raise LayoutError(f"family {self.name}: no size named {exc.args[0]!r} in its dims") from None


def _megatron_layers(fam: Family, spec: Any) -> tuple[tuple[int, tuple[str, ...]], ...]:
    out = []
    for layer in range(spec.num_layers):
        subs: dict[int, list[str]] = {}
        for name, block in fam.layer_blocks(spec, layer):
            subs.setdefault(block.megatron_layer, []).append(name)
        out += [(layer, tuple(subs[k])) for k in sorted(subs)]
    return tuple(out)


# ----------------------------------------------------------------------------- geometry


def unit_runs(offset: int, unit_rows: int, units: range, parts: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """HF row runs ``(row0, rows)`` in local order: each of ``parts`` (``(offset, rows)``
    inside a unit of ``unit_rows`` rows) of every unit in ``units``, part-major; runs that
    touch in both orders are one."""
    out: list[tuple[int, int]] = []
    for po, pn in parts:
        for u in units:
            r0 = offset + u * unit_rows + po
            if out and out[-1][0] + out[-1][1] == r0:
                out[-1] = (out[-1][0], out[-1][1] + pn)
            else:
                out.append((r0, pn))
    return out


def col_runs(what: str, pl: "Col | QKV", start: int, rows: int, tp: int, r: int, resolve: Callable[[Sequence[Dim]], tuple[int, ...]],
             *, replicate: bool) -> list[tuple[int, int]]:
    """Rank ``r``'s HF rows of a column-parallel part ``[start, start + rows)``, as runs in
    local order. Without ``parts``: a chunk of ``rows / tp`` (with ``replicate`` -- vLLM's
    rule -- fewer ``units`` than ranks hold whole units, each on ``tp // units`` ranks). With
    ``parts``: the rank's chunk of units, part by part (:func:`unit_runs`)."""
    units = None if pl.units is None else resolve((pl.units,))[0]
    if pl.parts:
        if units is None or rows % units:
            raise LayoutError(f"{what}: {rows} rows do not come in {units} units (parts {pl.parts})")
        if units % tp:
            raise LayoutError(f"{what}: {units} units (heads or groups) are not divisible by tp={tp}")
        n = units // tp
        return unit_runs(start, rows // units, range(r * n, (r + 1) * n), [resolve(p) for p in pl.parts])
    if replicate and units is not None and units < tp:
        if tp % units:
            raise LayoutError(f"{what}: tp={tp} is not a multiple of its {units} heads (replication)")
        per = rows // units
        return [(start + (r // (tp // units)) * per, per)]
    if rows % tp:
        raise LayoutError(f"{what}: {rows} rows are not divisible by tp={tp}")
    return [(start + r * (rows // tp), rows // tp)]


@dataclass(frozen=True)
class Window:
    """Where a local tensor holds a box of a canonical tensor: the box, and the local view."""

    box: Box
    view: View


def window(hf_shape: Sequence[int], fixed: Mapping[int, int], axes: Sequence[int], starts: Sequence[int],
           sizes: Sequence[int], local_strides: Sequence[int], offset: int) -> Window:
    """The box of an HF tensor that a local block holds, and its view.

    Local dim ``i`` walks HF dim ``axes[i]`` from ``starts[i]`` for ``sizes[i]`` elements,
    with local stride ``local_strides[i]``; the HF dims not in ``axes`` are fixed at
    ``fixed[d]`` (an expert's index). The view's strides follow the HF dim order, as a
    ``View`` of a ``Box`` does; a fixed dim's stride is that of a contiguous box.
    """
    n = len(hf_shape)
    offs, szs, strides = [0] * n, [1] * n, [0] * n
    for d, at in fixed.items():
        offs[d] = at
    for ax, s0, sz, st in zip(axes, starts, sizes, local_strides):
        offs[ax], szs[ax], strides[ax] = s0, sz, st
    for d in range(n - 1, -1, -1):  # a size-1 dim's stride is free: the contiguous one
        if d not in axes:
            strides[d] = strides[d + 1] * szs[d + 1] if d + 1 < n else 1
    if any(o + s > h for o, s, h in zip(offs, szs, hf_shape)):
        raise LayoutError(f"window {offs}+{szs} leaves the tensor of shape {tuple(hf_shape)}")
    return Window(Box(tuple(offs), tuple(szs)), View(offset, tuple(szs), tuple(strides)))


def split_shape(shape: tuple[int, ...], pl: Split, tp: int, expert: int | None) -> tuple[int, ...]:
    """The local shape of a ``Split`` placement: ``(prod(rows), prod(cols))`` or ``(prod(rows),)``."""
    sizes = list(shape[1:] if expert is not None else shape)
    if isinstance(pl.split, int):
        sizes[pl.split] //= tp
    rows = 1
    for d in pl.rows:
        rows *= sizes[d]
    if not pl.cols:
        return (rows,)
    cols = 1
    for d in pl.cols:
        cols *= sizes[d]
    return (rows, cols)


def split_window(canonical: str, shape: tuple[int, ...], pl: Split, tp: int, tp_r: int, expert: int | None,
                 offset: int):
    """The window a ``Split`` placement holds on rank ``tp_r`` (None: rank-0-only, not this
    rank), placed at local element ``offset``. HF dims count after a stacked expert dim."""
    inner = shape[1:] if expert is not None else shape
    lead = 1 if expert is not None else 0
    sizes, starts = list(inner), [0] * len(inner)
    if isinstance(pl.split, int):
        if sizes[pl.split] % tp:
            raise LayoutError(f"{canonical}: dim {pl.split + lead} ({sizes[pl.split]}) not divisible by tp={tp}")
        sizes[pl.split] //= tp
        starts[pl.split] = tp_r * sizes[pl.split]
    elif pl.split == "rank0" and tp_r:
        return None
    axes = tuple(pl.rows) + tuple(pl.cols)
    local = tuple(sizes[d] for d in axes)
    return window(shape, {0: expert} if expert is not None else {}, tuple(a + lead for a in axes),
                  tuple(starts[d] for d in axes), local, contiguous(local), offset)


def contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides (a local helper: the descriptor module's, without importing it twice)."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))
