"""Record a live vLLM worker's destination pieces from vLLM's own weight loaders.

No per-model code: the model's ``load_weights`` is driven with zero-storage placeholder
tensors (vLLM's ``FakeRDTTensor``, the sharded-RDT bake) that log every slicing op and every
``copy_`` destination while the layers sit on meta in model format (layerwise reload's
meta restore). The op chain, replayed on a meta tensor of the canonical shape, gives the
source window in canonical flat storage; the copy destination gives the window in the
local parameter. Both together are exactly one :class:`Piece` (a box and a view).

Imports vllm lazily (inside functions) so the package imports without it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from ...layout.descriptor import Box, LayoutError, LocalParam, Piece, View, contiguous_strides, unravel
from ...layout.spec import ModelSpec, spec_from_hf_config
from ...transport.views import TORCH_DTYPES
from .stamps import install_recording_stamps, restore_after_recording

__all__ = ["record_local_params", "pieces_from_copy", "chain_geometry", "served_spec", "canonical_tensors"]

#: (offset, shape, stride) of a strided window, in elements.
Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]


def served_spec(vllm_config: Any) -> ModelSpec:
    """The served model's spec, from its HF config, in the engine's dtype."""
    mc = vllm_config.model_config
    return spec_from_hf_config(mc.hf_config, dtype=str(mc.dtype).replace("torch.", ""))


def canonical_tensors(vllm_config: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical HF tensors (name -> shape, dtype) of the served model, from its HF config: what
    the recording replays vLLM's loaders on."""
    return served_spec(vllm_config).tensor_table()


def chain_geometry(shape: Sequence[int], ops: Sequence[tuple], *, what: str) -> Geometry:
    """Replay a recorded op chain on a meta tensor of ``shape``: the window it selects.

    Every op must stay a view of the canonical storage (a copy would break the mapping);
    ``contiguous``/``reshape`` are accepted only where they do not copy.
    """
    root = torch.empty(tuple(shape), device="meta")
    cur: Any = root
    for i, (op, args, kwargs) in enumerate(ops):
        if isinstance(cur, (tuple, list)):
            if op != "__getitem__":
                raise LayoutError(f"{what}: op {op!r} applied to a multi-output result")
            cur = cur[args[0]]
            continue
        if op == "contiguous":
            # A copy of a strided slice, then copied elementwise into the destination: the
            # same elements land in the same places (gpt-oss's ``permute(...).contiguous()``).
            # Only as the chain's last op: a view of the copy would not be a view of the window.
            if not cur.is_contiguous() and i != len(ops) - 1:
                raise LayoutError(f"{what}: .contiguous() on a strided slice copies; not a window")
            continue
        name = "view" if op == "reshape" else op
        try:
            res = getattr(torch.Tensor, name)(cur, *args, **dict(kwargs))
        except RuntimeError as exc:
            raise LayoutError(f"{what}: op {op}{args} is not a view of the canonical tensor: {exc}") from exc
        outs = res if isinstance(res, (tuple, list)) else (res,)
        for r in outs:
            if r is not root and r._base is not root:
                raise LayoutError(f"{what}: op {op}{args} copies instead of viewing")
            if r.dtype != root.dtype:
                raise LayoutError(f"{what}: op {op}{args} reinterprets the dtype")
        cur = res
    if not isinstance(cur, torch.Tensor):
        raise LayoutError(f"{what}: op chain ends in a multi-output result")
    return cur.storage_offset(), tuple(cur.shape), tuple(cur.stride())


def _refined(sizes: Sequence[int], strides: Sequence[int], dst_strides: Sequence[int], cshape: tuple[int, ...],
             cstride: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Source dims, each split where it walks past the end of the canonical dim it starts in
    (a checkpoint dim the plan addresses as several: gpt-oss's ``2F`` as ``(F, 2)``)."""
    out = []
    for n, st, ds in zip(sizes, strides, dst_strides):
        while n > 1:
            d = next((d for d in range(len(cshape)) if cstride[d] == st and cshape[d] > 1), None)
            if d is None or n <= cshape[d] or n % cshape[d]:
                break
            out.append((cshape[d], st, ds))
            n, st, ds = n // cshape[d], st * cshape[d], ds * cshape[d]
        out.append((n, st, ds))
    return out


def _natural_strides(sizes: Sequence[int], strides: list[int | None]) -> tuple[int, ...]:
    """Fill strides of size-1 dims (free choice) so a full box in a contiguous tensor
    gets exactly the contiguous strides."""
    out = list(strides)
    for d in range(len(sizes) - 1, -1, -1):
        if out[d] is None:
            out[d] = 1 if d == len(sizes) - 1 else out[d + 1] * sizes[d + 1]  # type: ignore[operator]
    return tuple(out)  # type: ignore[arg-type]


def pieces_from_copy(canonical_shape: Sequence[int], src: Geometry, dst: Geometry, *, what: str) -> tuple[Box, View]:
    """Turn one elementwise copy (source window in canonical storage -> destination
    window in local storage, equal shapes) into a canonical box and its local view.

    Each source dim must walk one canonical dim with unit step; several source dims
    may split one canonical dim (a reshape) if the destination splits it the same way.
    """
    cshape = tuple(canonical_shape)
    cstride = contiguous_strides(cshape)
    soff, sshape, sstride = src
    doff, dshape, dstride = dst
    if sshape != dshape:
        raise LayoutError(f"{what}: copy_ source shape {sshape} != destination shape {dshape}")
    groups: dict[int, list[tuple[int, int, int]]] = {}  # canon dim -> [(multiplier, size, dst stride)]
    for size, st, dst_st in _refined(sshape, sstride, dstride, cshape, cstride):
        if size == 1:
            continue
        for d in range(len(cshape) - 1, -1, -1):
            if cshape[d] > 1 and st % cstride[d] == 0 and st // cstride[d] < cshape[d]:
                groups.setdefault(d, []).append((st // cstride[d], size, dst_st))
                break
        else:
            raise LayoutError(f"{what}: source stride {st} walks no canonical dim of {cshape}")
    offsets = unravel(soff, cshape)
    sizes: list[int] = [1] * len(cshape)
    lstrides: list[int | None] = [None] * len(cshape)
    for d, items in groups.items():
        items.sort(key=lambda x: -x[0])
        if items[-1][0] != 1:
            raise LayoutError(f"{what}: strided (step {items[-1][0]}) slice of canonical dim {d}")
        for (m_hi, _, ds_hi), (m_lo, n_lo, ds_lo) in zip(items, items[1:]):
            if m_hi != m_lo * n_lo or ds_hi != ds_lo * n_lo:
                raise LayoutError(f"{what}: canonical dim {d} is split non-contiguously")
        sizes[d] = math.prod(n for _, n, _ in items)
        lstrides[d] = items[-1][2]
    for d in range(len(cshape)):
        if offsets[d] + sizes[d] > cshape[d]:
            raise LayoutError(f"{what}: window leaves canonical dim {d} ({offsets[d]}+{sizes[d]} > {cshape[d]})")
    if math.prod(sizes) != math.prod(sshape):
        raise LayoutError(f"{what}: source window {sshape} is not a box of {cshape}")
    return Box(tuple(offsets), tuple(sizes)), View(doff, tuple(sizes), _natural_strides(sizes, lstrides))


def _refuse_rebalanced_experts(model: torch.nn.Module, vllm_config: Any) -> None:
    """vLLM's loaders place experts by the initial physical->logical map; after an EPLB
    rebalance that is wrong, so recording (which follows the loaders) must refuse."""
    par = getattr(vllm_config, "parallel_config", None)
    if par is None or not getattr(par, "enable_eplb", False):
        return
    raise LayoutError(
        "vLLM EPLB is enabled: expert placement can change at runtime and vLLM's weight loaders "
        "follow only the initial physical->logical map; recording pieces from them would "
        "silently target the wrong experts after a rebalance. Disable EPLB for refits."
    )


def record_local_params(
    model: torch.nn.Module,
    tensors: Mapping[str, tuple[Sequence[int], str]],
    rank: int,
    *,
    vllm_config: Any = None,
    device: torch.device | str = "cpu",
    checkpoint: Mapping[str, Sequence[int]] | None = None,
) -> list[LocalParam]:
    """The worker's destination pieces in model format, learnt from ``model.load_weights``.

    ``tensors``: canonical (HF) name -> (shape, dtype name) of every checkpoint tensor;
    ``checkpoint``: the checkpoint's own shape of those the plan addresses in a finer shape
    of the same storage (``ModelSpec.checkpoint_shapes``): the loaders see that shape.
    The model's parameters are put back untouched (kernel tensors restored).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS

    BakeSink, FakeRDTTensor = _recording_types()
    checkpoint = checkpoint or {}

    _refuse_rebalanced_experts(model, vllm_config)
    if any(info.can_load() for info in LAYERWISE_INFO.values()):
        raise RuntimeError("a layerwise reload is in progress; record before or after it, not during")
    module_names = {id(m): n for n, m in model.named_modules()}
    sink = BakeSink()
    meta_shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    live_only: dict[str, tuple[tuple[int, ...], str]] = {}
    fakes = [
        (name, FakeRDTTensor(name=name, shape=torch.Size(tuple(checkpoint.get(name, shape))), dtype=TORCH_DTYPES[dt],
                             device=torch.device(device), sink=sink))
        for name, (shape, dt) in tensors.items()
    ]
    dtype_names = {v: k for k, v in TORCH_DTYPES.items()}
    with torch.device(device):
        initialize_layerwise_reload(model)
        try:
            install_recording_stamps(model, sink)
            for mname, module in model.named_modules():
                for pname, p in module._parameters.items():
                    if p is None:
                        continue
                    full = f"{mname}.{pname}" if mname else pname
                    if p.storage_offset() != 0 or not p.is_contiguous():
                        raise LayoutError(f"{full}: model-format parameter is not a contiguous tensor")
                    # The reload leaves SKIP_LOAD_TENSORS live (e.g. DeepSeek's router
                    # e_score_correction_bias); such a parameter is described only if the
                    # loaders write it.
                    into = live_only if pname in SKIP_LOAD_TENSORS else meta_shapes
                    into[full] = (tuple(p.shape), dtype_names.get(p.dtype, str(p.dtype)))
                    sink.owners[p.untyped_storage()._cdata] = (module, pname)
            model.load_weights(fakes)
        finally:
            restore_after_recording(model)

    pieces: dict[str, list[Piece]] = {n: [] for n in meta_shapes}
    for layer, scatters in sink.copies_by_layer.items():
        mname = module_names.get(id(layer))
        if mname is None:
            raise LayoutError(f"copy_ into a module outside the model ({type(layer).__name__})")
        for sc in scatters:
            if sc is None:
                raise LayoutError(f"{mname}: unattributable copy_ during recording")
            local = f"{mname}.{sc.param_name}" if mname else sc.param_name
            if local not in pieces and local in live_only:
                meta_shapes[local] = live_only[local]
                pieces[local] = []
            if local not in pieces:
                raise LayoutError(f"{local}: copy_ into a tensor that is not a loadable parameter")
            canon, ops = sc.src
            cshape = tuple(tensors[canon][0])
            what = f"{local} <- {canon}"
            src = chain_geometry(tuple(checkpoint.get(canon, cshape)), ops, what=what)
            box, view = pieces_from_copy(cshape, src, (sc.offset, sc.shape, sc.stride), what=what)
            pieces[local].append(Piece(rank, local, canon, box, view))
    unattributed = sink.copied_names - {c.src[0] for s in sink.copies_by_layer.values() for c in s if c} - sink.zeroed
    if unattributed:
        raise LayoutError(f"copies of {sorted(unattributed)[:3]} could not be attributed to a parameter")
    out = []
    for local, (shape, dt) in meta_shapes.items():
        ps = tuple(sorted(pieces[local], key=lambda p: (p.view.offset, p.canonical)))
        if local.rpartition(".")[2] in SKIP_TENSORS:
            dt = _model_dtype(dt, ps, tensors)
        lp = LocalParam(rank, local, shape, dt, ps)
        if lp.padding < 0:
            raise LayoutError(f"{local}: recorded pieces cover more elements ({-lp.padding} extra) than it holds")
        out.append(lp)
    return out


def _model_dtype(live: str, pieces: Sequence[Piece], tensors: Mapping[str, tuple[Sequence[int], str]]) -> str:
    """The dtype a tensor vLLM's reload leaves live (``SKIP_TENSORS``: a linear's ``bias``) is
    written in: its canonical tensors' (model format), where processing changed the live one in
    place -- vLLM's CPU AMX GEMM (``check_cpu_sgl_kernel``) widens a bf16 linear's bias to fp32.
    The applier stages such a tensor in model format and copies it into the live one at the
    commit (``Shadows``)."""
    held = {tensors[q.canonical][1] for q in pieces}
    return held.pop() if len(held) == 1 else live


def _recording_types():
    """vLLM's bake sink and fake tensor, extended for loaders that bypass a weight loader.

    gpt-oss's unquantized loader copies straight into parameters (``param.copy_``, no
    ``weight_loader`` to stamp) and zeroes its row-parallel expert bias on MoE-TP ranks other
    than 0 (``weight.zero_()``). The sink attributes an unstamped copy by the destination's
    storage (every loadable parameter's, noted before loading); a fake that was zeroed records
    no piece: that part of the destination holds zeros, not a box of the tensor.

    The fake also takes two idioms vLLM's refuses, both still plain windows of the checkpoint
    tensor: ``x.view_as(t)`` (``view(t.shape)``) and ``param[idx] = x`` (``param[idx].copy_(x)``).
    Mamba2's ``mamba_v2_sharded_weight_loader`` (the group-replicating loader of
    ``n_groups % tp != 0``) writes with exactly these.
    """
    from vllm.distributed.weight_transfer.sharded_rdt_fake import BakeSink, FakeRDTTensor, _meta_copy_

    class Sink(BakeSink):
        def __init__(self) -> None:
            super().__init__()
            self.owners: dict[int, tuple[Any, str]] = {}
            self.zeroed: set[str] = set()

        def accept_copy(self, dest: torch.Tensor, src: Any) -> torch.Tensor:
            if getattr(src, "_zeroed", False):
                self.zeroed.add(src._name)
                return _meta_copy_(dest, src)
            if self.current is None:
                owner = self.owners.get(dest.untyped_storage()._cdata)
                if owner is not None:
                    self.current = owner
                    try:
                        return super().accept_copy(dest, src)
                    finally:
                        self.current = None
            return super().accept_copy(dest, src)

    class Fake(FakeRDTTensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.zero_ and isinstance(args[0], FakeRDTTensor):
                args[0]._zeroed = True
                return args[0]
            if func is torch.Tensor.view_as and isinstance(args[0], FakeRDTTensor):
                return args[0].view(tuple(args[1].shape))
            if func is torch.Tensor.__setitem__ and isinstance(args[2], FakeRDTTensor) \
                    and not isinstance(args[0], FakeRDTTensor):
                return args[0][args[1]].copy_(args[2])
            return super().__torch_function__(func, types, args, kwargs)

        def _make_child(self, new_shape, new_dtype, *new_ops):
            child = Fake(name=self._name, shape=new_shape, dtype=new_dtype, device=self.device,
                         ops=self._ops + new_ops, sink=self._sink)
            child._zeroed = getattr(self, "_zeroed", False)
            return child

    return Sink, Fake
