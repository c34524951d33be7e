"""Block-FP8 layouts: which canonical tensors an FP8 engine holds quantized, and the pieces of
their scales.

DeepSeek-style block FP8 (vLLM's ``fp8_per_block``): a quantized weight ``W`` [N, K] is held as
``float8_e4m3fn`` codes of the same shape plus ``W_scale_inv`` [ceil(N/128), ceil(K/128)] in
fp32, one scale per 128x128 block. Both are canonical tensors here (HF's names for a serialized
block-FP8 checkpoint: ``<module>.weight_scale_inv``), so a quantized refit is planned like any
other: the sender's side is described in FP8 too (it quantizes what it owns before sending),
and scales are boxes like weights.

The one rule that makes this exact: every 128x128 block a rank holds lies inside one of its
pieces, at block-aligned coordinates of both the canonical and the local tensor. Then
quantizing a local tensor block by block (what vLLM's online quantization does to a worker's
shard, and what a training rank does to its shard) gives the same codes and scales as
quantizing the canonical tensor, and a scale piece is the weight piece divided by 128. A
layout that cuts a block is refused in one line naming the tensor: no silent re-blocking.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

from .descriptor import Box, LayoutError, LocalParam, Piece, SideLayout, View, contiguous_strides
from .memo import IdentityCache

__all__ = ["FP8", "BLOCK", "SCALE_SUFFIX", "BlockFp8", "scale_name", "quantized_tensors", "quantize_side", "held_tensors",
           "fp8_sides"]

FP8 = "float8_e4m3fn"
#: vLLM's ``fp8_per_block``: ``weight_block_size = [128, 128]``.
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
#: Modules never quantized whatever the ignore list says: the engine keeps them in its dtype.
#: (vLLM's online FP8 quantizes ``LinearBase`` layers only: embeddings, the LM head and norms
#: are not linears; the MoE router is one, hence the default ignore list.)
_LINEAR_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")  # MLA: kv_a_proj_with_mqa


def scale_name(weight: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (HF's and vLLM's name; ``w13_weight`` ->
    ``w13_weight_scale_inv`` likewise)."""
    return weight + SCALE_SUFFIX


@dataclass(frozen=True)
class BlockFp8:
    """What an FP8 engine quantizes: vLLM's ``quantization="fp8_per_block"`` with
    ``quantization_config={"ignore": ignore}`` (module-name patterns, fnmatch, as vLLM matches
    them). The router must stay in the model dtype (vLLM's CPU kernel refuses a quantized one)."""

    ignore: tuple[str, ...] = ("*.mlp.gate",)
    block: int = BLOCK
    dtype: str = FP8

    def __post_init__(self) -> None:
        if self.block != BLOCK:
            raise LayoutError(f"fp8 block={self.block}: only vLLM's fp8_per_block 128x128 blocks are supported")

    def quantizes(self, name: str) -> bool:
        """Whether canonical tensor ``name`` (HF name) is held quantized."""
        if not name.endswith(_LINEAR_SUFFIXES):
            return False
        module = name.rpartition(".")[0]
        return not any(fnmatch.fnmatchcase(module, pat) for pat in self.ignore)

    def engine_config(self) -> dict:
        """vLLM's engine arguments for it."""
        return {"quantization": "fp8_per_block", "quantization_config": {"ignore": list(self.ignore)}}


def quantized_tensors(tensors: Mapping[str, tuple[tuple[int, ...], str]], quant: BlockFp8) -> tuple[str, ...]:
    """The canonical tensors of ``tensors`` that ``quant`` holds in FP8, in table order."""
    out = []
    for name, (shape, _) in tensors.items():
        if quant.quantizes(name):
            if len(shape) != 2:
                raise LayoutError(f"{name}: block FP8 needs a 2-D weight, got shape {tuple(shape)}")
            out.append(name)
    return tuple(out)


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def quantize_side(side: SideLayout, quant: BlockFp8, what: str) -> SideLayout:
    """``side`` as an FP8 engine holds it: every
    local tensor of quantized canonical tensors becomes FP8 codes of the same shape plus a
    ``<local>_scale_inv`` tensor [..., ceil(rows/128), ceil(cols/128)] of fp32 scales, whose
    pieces are the weight pieces divided by 128. ``what`` names the side in errors."""
    names = set(quantized_tensors(side.tensors, quant))
    if not names or all(side.tensors[n][1] == quant.dtype and scale_name(n) in side.tensors for n in names):
        return side  # nothing to quantize, or described in FP8 already (an engine's own description)
    return _quantize(side, names, quant.block, quant.dtype, what, at_sender=False)


def held_tensors(tensors: Mapping[str, tuple[tuple[int, ...], str]],
                 params: Sequence[LocalParam]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``tensors`` (the model's table) as the local tensors ``params`` hold them: a canonical
    tensor held as FP8 codes is FP8 in the table, beside its ``_scale_inv`` scales (fp32, one
    per 128x128 block) -- the table an FP8 engine's own description implies (its workers
    describe what they hold, ``adapters/vllm/fp8.py``)."""
    return _quantized_table(tensors, {q.canonical for p in params if p.dtype == FP8 for q in p.pieces}, BLOCK, FP8)


def _quantized_table(tensors: Mapping[str, tuple[tuple[int, ...], str]], names: set[str], b: int,
                     dtype: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``tensors`` with ``names`` in ``dtype``, each followed by its fp32 scales (one per
    ``b``x``b`` block), in table order."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, d) in tensors.items():
        if name in names:
            out[name] = (tuple(shape), dtype)
            out[scale_name(name)] = ((_blocks(shape[0], b), _blocks(shape[1], b)), "float32")
        else:
            out[name] = (tuple(shape), d)
    return out


def fp8_sides(src: SideLayout, dst: SideLayout) -> tuple[SideLayout, SideLayout, tuple[tuple[str, str, str], ...]]:
    """(``src`` as it sends, ``dst`` as it receives, what the receiver quantizes) for a refit
    into ``dst``, which holds some tensors in block FP8 (codes + ``_scale_inv`` scales) that
    ``src`` holds unquantized.

    The senders quantize every such tensor whose blocks each lie whole on one training rank
    (``SideLayout.quantize``). One the training layout cuts (a block split between two ranks,
    e.g. megatron's TP split of MLA's 576-row ``kv_a_proj_with_mqa``) cannot be quantized by
    any single sender: it travels unquantized and the receiver quantizes it as vLLM's online
    quantization does; so does every tensor sharing a local tensor with it on either side (a
    local tensor is FP8 or not as a whole). Returned as (tensor, its unquantized dtype, why),
    in ``dst``'s order."""
    names = {n for n, (_, d) in dst.tensors.items()
             if d == FP8 and scale_name(n) in dst.tensors and n in src.tensors and src.tensors[n][1] != FP8
             and scale_name(n) not in src.tensors}
    if not names:
        return src, dst, ()
    b = _block_of(dst, next(iter(sorted(names))))
    why: dict[str, str] = {}
    for p in src.params:
        strides = None  # the local tensor's, once it has a piece to check
        for q in p.pieces:
            if q.canonical in names and q.canonical not in why:
                strides = strides or contiguous_strides(p.shape)
                cut = _cut(p, q, src.tensors[q.canonical][0], b, "training", strides)
                if cut:
                    why[q.canonical] = cut
    changed = bool(why)
    while changed:  # a local tensor is FP8 or not as a whole, on both sides
        changed = False
        for params in (src.params, dst.params):
            for p in params:
                mine = {q.canonical for q in p.pieces if q.canonical in names}
                bad = next((c for c in mine if c in why), None)
                for c in mine - set(why) if bad else ():
                    why[c] = f"shares {p.name} with {bad}"
                    changed = True
    good = names - set(why)
    sent = _sent(src, good, b) if good else src
    received = _unquantize(dst, {n: src.tensors[n][1] for n in why}) if why else dst
    return sent, received, tuple((n, src.tensors[n][1], why[n]) for n in dst.tensors if n in why)


#: ``fp8_sides``' sending sides by (training layout identity, tensors, block): it is asked
#: once per plan from one training layout (the settings' check, the direct plan, each relayed
#: one).
_SENT = IdentityCache(2)


def _sent(src: SideLayout, good: set[str], b: int) -> SideLayout:
    """``src`` as it sends with ``good`` quantized (cached)."""
    return _SENT.get((src,), (frozenset(good), b), lambda: _quantize(src, good, b, FP8, "training", at_sender=True))


def clear_quant_cache() -> None:
    """Forget the cached sending sides (``plan.cache.clear_plan_cache`` calls it)."""
    _SENT.clear()


def _unquantize(side: SideLayout, held: dict[str, str]) -> SideLayout:
    """``side`` with the FP8 tensors of ``held`` (name -> unquantized dtype) back in that
    dtype, their scales gone: what a receiver that quantizes them itself takes in."""
    scales = {scale_name(n) for n in held}
    tensors = {n: ((shape, held[n]) if n in held else (shape, d)) for n, (shape, d) in side.tensors.items()
               if n not in scales}
    params = []
    for p in side.params:
        if any(q.canonical in scales for q in p.pieces):
            continue
        if any(q.canonical in held for q in p.pieces):
            p = LocalParam(p.rank, p.name, p.shape, held[p.pieces[0].canonical], p.pieces)
        params.append(p)
    return SideLayout(side.name, side.world_size, tuple(params), tensors, side.notes, side.quantize)


def _block_of(side: SideLayout, name: str) -> int:
    (rows, cols), (srows, scols) = side.tensors[name][0], side.tensors[scale_name(name)][0]
    if _blocks(rows, BLOCK) != srows or _blocks(cols, BLOCK) != scols:
        raise LayoutError(f"{scale_name(name)}: shape {(srows, scols)} is not {BLOCK}x{BLOCK} blocks of "
                          f"{name} {(rows, cols)}; only vLLM's fp8_per_block is supported")
    return BLOCK


def _quantize(side: SideLayout, names: set[str], b: int, dtype: str, what: str, *, at_sender: bool) -> SideLayout:
    """``side`` with ``names`` in ``dtype`` plus their scales (``at_sender``: recorded in
    ``SideLayout.quantize`` as what this side quantizes before sending)."""
    tensors = _quantized_table(side.tensors, names, b, dtype)
    params: list[LocalParam] = []
    shared: _Shared = ({}, {}, {})
    for p in side.params:
        inside = [q.canonical in names for q in p.pieces]
        if not any(inside):
            params.append(p)
            continue
        if not all(inside):
            q = p.pieces[inside.index(False)]
            raise LayoutError(f"{p.name} ({what} rank {p.rank}) holds {q.canonical}, which stays unquantized, "
                              f"beside FP8 weights: one local tensor cannot be both")
        if len(p.shape) < 2:
            raise LayoutError(f"{p.name} ({what} rank {p.rank}): a 1-D local tensor cannot hold 128x128 blocks")
        sshape = (*p.shape[:-2], _blocks(p.shape[-2], b), _blocks(p.shape[-1], b))
        pieces = _scale_pieces(p, side.tensors, sshape, b, what, shared)
        params.append(LocalParam(p.rank, p.name, p.shape, dtype, p.pieces))
        params.append(LocalParam(p.rank, scale_name(p.name), sshape, "float32", pieces))
    held = tuple((n, side.tensors[n][1]) for n in side.tensors if n in names) if at_sender else ()
    return SideLayout(side.name, side.world_size, tuple(params), tensors, side.notes, held)


def _cut(p: LocalParam, q: Piece, shape: Sequence[int], b: int, what: str,
         strides: tuple[int, ...] | None = None) -> str:
    """Why piece ``q`` of local tensor ``p`` (canonical ``shape``) does not hold whole
    ``b``x``b`` blocks at aligned coordinates of both tensors (one line), or "" when it does.
    ``strides``: ``p``'s contiguous strides, when the caller has them."""
    v, box = q.view, q.box
    if strides is None:
        strides = contiguous_strides(p.shape)
    if len(box.sizes) != 2 or len(p.shape) < 2 or any(n != 1 and s != strides[d - 2] for d, (n, s) in
                                                      enumerate(zip(v.shape, v.stride))):
        return (f"{_where(p, q, what)} at strides {v.stride}: FP8 blocks need the rows and columns of a "
                f"{len(p.shape)}-D tensor's last two dims")
    local = _unravel(v.offset, strides)[-2:]
    for d in range(2):
        start, size, full = box.offsets[d], box.sizes[d], shape[d]
        ends_here = start + size == full and local[d] + size == p.shape[d - 2]
        if start % b or local[d] % b or (size % b and not ends_here):
            return (f"{_where(p, q, what)}: it cuts a {b}x{b} FP8 block (its {('rows', 'columns')[d]} are not "
                    f"whole blocks of {b} there); FP8 needs every shard a whole number of blocks")
    return ""


def _where(p: LocalParam, q: Piece, what: str) -> str:
    """Where piece ``q`` lies, for ``_cut``'s message (formatted only when there is one: it
    is asked of every weight piece of a full-size side)."""
    return f"{q.canonical}: {what} rank {p.rank} holds rows {_span(q.box, 0)} x cols {_span(q.box, 1)} in {p.name}"


def _unravel(offset: int, strides: Sequence[int]) -> list[int]:
    """``descriptor.unravel`` with the shape's strides at hand."""
    coords = []
    for stride in strides:
        coords.append(offset // stride)
        offset %= stride
    return coords


#: One ``_quantize`` call's scale boxes by weight box (by identity), scale views by (offset,
#: scale box identity, row stride), and both by what decides them -- (local shape, weight box
#: and view identities, canonical shape) -- once ``_cut`` passed them: the rules share Box and
#: View objects between ranks (a full-size side: ~300k pieces, ~1k boxes), so each distinct
#: piece is checked and scaled once, and the scale pieces share their objects likewise (what
#: reads the side next -- digests, relays, reports -- meets ~1k objects, not one per piece).
_Shared = tuple[dict[int, Box], dict[tuple[int, int, int], View], dict[tuple, tuple[Box, View]]]


def _scale_pieces(p: LocalParam, tensors: Mapping[str, tuple[tuple[int, ...], str]], sshape: tuple[int, ...],
                  b: int, what: str, shared: _Shared) -> tuple[Piece, ...]:
    """The scale pieces of the weight pieces of local tensor ``p`` (in ``sshape``), in order."""
    boxes, views, done = shared
    local_shape, strides, sstrides = tuple(p.shape), None, None
    name = scale_name(p.name)
    out = []
    for q in p.pieces:
        box, shape = q.box, tensors[q.canonical][0]
        key = (local_shape, id(box), id(q.view), tuple(shape))
        hit = done.get(key)
        if hit is None:
            if strides is None:
                strides, sstrides = contiguous_strides(p.shape), contiguous_strides(sshape)
            cut = _cut(p, q, shape, b, what, strides)
            if cut:
                raise LayoutError(cut)
            sbox = boxes.get(id(box))
            if sbox is None:
                sbox = boxes[id(box)] = Box((box.offsets[0] // b, box.offsets[1] // b),
                                            (_blocks(box.sizes[0], b), _blocks(box.sizes[1], b)))
            coords = _unravel(q.view.offset, strides)
            scoords = (*coords[:-2], coords[-2] // b, coords[-1] // b)
            offset = sum(c * s for c, s in zip(scoords, sstrides))
            vkey = (offset, id(sbox), sstrides[-2])
            view = views.get(vkey)
            if view is None:
                view = views[vkey] = View(offset, sbox.sizes, (sstrides[-2], 1))
            hit = done[key] = (sbox, view)
        out.append(Piece(p.rank, name, scale_name(q.canonical), *hit))
    return tuple(out)


def _span(box: Box, d: int) -> str:
    return f"[{box.offsets[d]}, {box.offsets[d] + box.sizes[d]})"
