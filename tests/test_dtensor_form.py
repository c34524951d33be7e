"""DTensor form of a layout: the placements found must be what torch itself would split."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard, _StridedShardOffsetMode

import mcore_reshard.layout.dtensor as dt
from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.layout import Box, LayoutError, LocalParam, Piece, SideLayout, View, contiguous_strides
from mcore_reshard.layout.dtensor import DTensorForm, NotExpressible, dtensor_form, dtensor_forms, dtensor_report, \
    dtensor_summary
from mcore_reshard.transport.views import torch_placements

from toy_layouts import tiny_spec

L0 = "model.layers.0."


# --------------------------------------------------------------------------- oracles


def torch_mask(form: DTensorForm, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Elements ``rank`` holds under ``form``, walking the mesh dims with torch's own helpers."""
    coord = form.coordinates()[rank]
    idx = [list(range(s)) for s in shape]
    for mdim, p in enumerate(torch_placements(form)):
        n = form.mesh_shape[mdim]
        if isinstance(p, _StridedShard):
            size, offs = p._local_shard_size_and_offset(len(idx[p.dim]), n, coord[mdim],
                                                        offset_mode=_StridedShardOffsetMode.ALL)
            idx[p.dim] = [idx[p.dim][o] for o in offs][:size]
        elif isinstance(p, Shard):
            size, off = Shard.local_shard_size_and_offset(len(idx[p.dim]), n, coord[mdim])
            idx[p.dim] = idx[p.dim][off:off + size]
        else:
            assert isinstance(p, Replicate)
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[torch.meshgrid(*[torch.tensor(i, dtype=torch.long) for i in idx], indexing="ij")] = True
    return mask


def pieces_mask(side: SideLayout, canonical: str, rank: int) -> torch.Tensor:
    mask = torch.zeros(side.tensors[canonical][0], dtype=torch.bool)
    for p in side.pieces():
        if p.rank == rank and p.canonical == canonical:
            mask[tuple(slice(o, o + s) for o, s in zip(p.box.offsets, p.box.sizes))] = True
    return mask


def assert_round_trip(side: SideLayout) -> int:
    """Every expressible tensor: torch's split of the form == the pieces, rank by rank;
    ranks outside the mesh hold nothing. Returns how many tensors were checked."""
    holders: dict[str, set[int]] = {}
    for p in side.pieces():
        holders.setdefault(p.canonical, set()).add(p.rank)
    checked = 0
    for name, form in dtensor_forms(side).items():
        if isinstance(form, NotExpressible):
            continue
        shape = side.tensors[name][0]
        assert sorted(form.ranks) == sorted(holders[name]), name
        assert len(form.placements) == len(form.mesh_shape), name
        for rank in form.ranks:
            assert torch.equal(torch_mask(form, shape, rank), pieces_mask(side, name, rank)), (name, rank, str(form))
        if not any(p[0] == "strided_shard" for p in form.placements):  # torch's global-offset helper agrees
            for rank, coord in form.coordinates().items():
                local, offset = _compute_local_shape_and_global_offset(shape, form.mesh_shape, list(coord),
                                                                       list(torch_placements(form)))
                assert pieces_mask(side, name, rank).sum() == torch.Size(local).numel()
                assert pieces_mask(side, name, rank)[tuple(offset)], (name, rank)
        checked += 1
    return checked


def toy_side(shape: tuple[int, ...], held: dict[int, list[Box]], name: str = "t") -> SideLayout:
    """One canonical tensor; ``held[rank]`` lists the boxes of that rank's pieces."""
    params = []
    for rank, boxes in held.items():
        pieces = []
        off = 0
        for b in boxes:
            pieces.append(Piece(rank, "local", name, b, View(off, b.sizes, contiguous_strides(b.sizes))))
            off += b.numel
        params.append(LocalParam(rank, "local", (off,), "float32", tuple(pieces)))
    return SideLayout("toy", max(held) + 1, tuple(params), {name: (shape, "float32")})


def rows(lo: int, n: int, cols: int = 4) -> Box:
    return Box((lo, 0), (n, cols))


# --------------------------------------------------------------------------- vLLM


def test_vllm_tp4_replicas2():
    side = vllm_layout(tiny_spec(moe=False, nkv=4), VllmParallel(tp=4, replicas=2))
    engines = ((0, 1, 2, 3), (4, 5, 6, 7))
    o = dtensor_form(side, L0 + "self_attn.o_proj.weight")
    assert o == DTensorForm(engines, (("replicate",), ("shard", 1)))
    assert str(o) == "mesh (2, 4) [Replicate(), Shard(1)]"
    assert torch_placements(o) == (Replicate(), Shard(1))
    assert dtensor_form(side, L0 + "self_attn.q_proj.weight") == DTensorForm(engines, (("replicate",), ("shard", 0)))
    assert dtensor_form(side, L0 + "mlp.down_proj.weight").placements == (("replicate",), ("shard", 1))
    for norm in (L0 + "input_layernorm.weight", L0 + "self_attn.q_norm.weight", "model.norm.weight"):
        assert dtensor_form(side, norm) == DTensorForm(tuple(range(8)), (("replicate",),))


@pytest.mark.parametrize("replicas, mesh, placements", [
    (1, ((0, 1), (2, 3)), (("shard", 0), ("replicate",))),
    (2, (((0, 1), (2, 3)), ((4, 5), (6, 7))), (("replicate",), ("shard", 0), ("replicate",))),
])
def test_vllm_kv_heads_replicated_over_tp(replicas, mesh, placements):
    """tp=4 > nKV=2: neighbouring TP ranks share a KV head, an inner ``Replicate()`` mesh dim
    of size tp/nKV after the ``Shard(0)`` over nKV; engine replicas are the outer dim."""
    side = vllm_layout(tiny_spec(moe=False, nkv=2), VllmParallel(tp=4, replicas=replicas))
    for proj in ("k", "v"):
        form = dtensor_form(side, f"{L0}self_attn.{proj}_proj.weight")
        assert form == DTensorForm(mesh, placements), str(form)
    want = "mesh (2, 2) [Shard(0), Replicate()]" if replicas == 1 else \
        "mesh (2, 2, 2) [Replicate(), Shard(0), Replicate()]"
    assert str(dtensor_form(side, L0 + "self_attn.k_proj.weight")) == want
    assert assert_round_trip(side) > 0


def test_vllm_pad64_vocab_not_expressible():
    """vocab 250 -> 256 padded rows, 64 per rank: the last rank's 58 rows are not torch.chunk's."""
    side = vllm_layout(tiny_spec(moe=False, vocab=250), VllmParallel(tp=4))
    form = dtensor_form(side, "model.embed_tokens.weight")
    assert isinstance(form, NotExpressible)
    assert "uneven rows" in form.reason and "(64, 64, 64, 58)" in form.reason and "(63, 63, 63, 61)" in form.reason
    assert "\n" not in form.reason
    even = vllm_layout(tiny_spec(moe=False, vocab=256), VllmParallel(tp=4))  # no padding: plain Shard(0)
    assert dtensor_form(even, "model.embed_tokens.weight") == DTensorForm((0, 1, 2, 3), (("shard", 0),))


def test_vllm_experts_ep_and_pp():
    spec = tiny_spec(moe=True, layers=2, vocab=256)
    ep = vllm_layout(spec, VllmParallel(tp=2, dp=2, enable_ep=True, num_redundant_experts=4))
    # 12 physical slots over 4 EP ranks, linear: expert 0 in slot 0 (rank 0) and slot 8 (rank 2)
    assert dtensor_form(ep, L0 + "mlp.experts.0.gate_proj.weight") == DTensorForm((0, 2), (("replicate",),))
    assert dtensor_form(ep, L0 + "mlp.experts.5.down_proj.weight") == DTensorForm((1,), (("replicate",),))
    tp = vllm_layout(spec, VllmParallel(tp=2, dp=2, pp=2))  # MoE TP over dp*tp, stage 0 = ranks 0, 1, 4, 5
    assert dtensor_form(tp, L0 + "mlp.experts.3.up_proj.weight") == DTensorForm((0, 1, 4, 5), (("shard", 0),))
    assert dtensor_form(tp, "model.layers.1.self_attn.q_proj.weight") == \
        DTensorForm(((2, 3), (6, 7)), (("replicate",), ("shard", 0)))


# --------------------------------------------------------------------------- megatron


def test_megatron_tp2_dp2_q_proj():
    side = megatron_layout(tiny_spec(moe=False, nkv=2), MegatronParallel(tp=2, dp=2))  # ng=2 >= tp
    q = dtensor_form(side, L0 + "self_attn.q_proj.weight")
    assert q == DTensorForm(((0, 1), (2, 3)), (("replicate",), ("shard", 0)))
    ng4 = megatron_layout(tiny_spec(moe=False, nkv=4, p=2), MegatronParallel(tp=2, dp=2))  # 2 groups per rank
    assert dtensor_form(ng4, L0 + "self_attn.q_proj.weight") == q  # adjacent per-group pieces merge
    assert dtensor_form(ng4, L0 + "self_attn.k_proj.weight") == q


def test_megatron_groups_split_inside_heads():
    """ng=1, P=4, tp=4: linear_qkv rows chunk 1.5 heads per rank, so q_proj rows are
    (1.5, 1.5, 1) heads on ranks 0-2 and rank 3 holds none."""
    spec = dataclasses.replace(tiny_spec(moe=False, nkv=1, p=4), head_dim=8)
    side = megatron_layout(spec, MegatronParallel(tp=4))
    q = dtensor_form(side, L0 + "self_attn.q_proj.weight")
    assert isinstance(q, NotExpressible)
    assert q.reason.startswith("uneven rows") and "(12, 12, 8)" in q.reason and "(11, 11, 10)" in q.reason
    # k rows split evenly between ranks 2 and 3; v lies whole on rank 3
    assert dtensor_form(side, L0 + "self_attn.k_proj.weight") == DTensorForm((2, 3), (("shard", 0),))
    assert dtensor_form(side, L0 + "self_attn.v_proj.weight") == DTensorForm((3,), (("replicate",),))


def test_megatron_head_split_can_coincide_with_torch_chunk():
    """head_dim=4: q rows (6, 6, 4) over ranks 0-2 happen to be torch.chunk(16, 3); the form is true."""
    side = megatron_layout(tiny_spec(moe=False, nkv=1, p=4), MegatronParallel(tp=4))
    assert dtensor_form(side, L0 + "self_attn.q_proj.weight") == DTensorForm((0, 1, 2), (("shard", 0),))
    assert assert_round_trip(side) > 0


def test_megatron_experts_under_ep():
    spec = tiny_spec(moe=True, layers=2, vocab=256)
    side = megatron_layout(spec, MegatronParallel(tp=1, ep=2, dp=4))  # edp=2: ep rank 0 = ranks 0, 2
    for e, ranks in ((0, (0, 2)), (3, (0, 2)), (4, (1, 3)), (7, (1, 3))):
        for w in ("gate", "up", "down"):
            assert dtensor_form(side, f"{L0}mlp.experts.{e}.{w}_proj.weight") == DTensorForm(ranks, (("replicate",),))
    etp = megatron_layout(spec, MegatronParallel(tp=2, ep=2, dp=2))  # expert-TP 2 inside each EP group
    assert dtensor_form(etp, L0 + "mlp.experts.5.gate_proj.weight") == DTensorForm((2, 3), (("shard", 0),))
    assert dtensor_form(etp, L0 + "mlp.experts.5.down_proj.weight") == DTensorForm((2, 3), (("shard", 1),))


def test_megatron_padded_vocab_not_expressible():
    side = megatron_layout(tiny_spec(moe=False, vocab=250), MegatronParallel(tp=2))  # 256 rows, 128 each
    form = dtensor_form(side, "model.embed_tokens.weight")
    assert isinstance(form, NotExpressible) and "(128, 122)" in form.reason and "(125, 125)" in form.reason


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("side", [
    pytest.param(lambda: megatron_layout(tiny_spec(moe=True, layers=2), MegatronParallel(tp=2, ep=2, dp=2)),
                 id="mcore-tp2-ep2"),
    pytest.param(lambda: megatron_layout(tiny_spec(moe=False, nkv=2, p=2, vocab=256),
                                         MegatronParallel(tp=2, pp=2, dp=2)), id="mcore-tp2-pp2-dp2"),
    pytest.param(lambda: megatron_layout(tiny_spec(moe=True, layers=2, bias=True),
                                         MegatronParallel(tp=2, etp=1, ep=4, dp=2)), id="mcore-tp2-dp2-etp1-ep4"),
    pytest.param(lambda: vllm_layout(tiny_spec(moe=True, layers=2, vocab=256), VllmParallel(tp=2, dp=2, pp=2)),
                 id="vllm-moe-tp"),
    pytest.param(lambda: vllm_layout(tiny_spec(moe=True, layers=2), VllmParallel(tp=4, enable_ep=True, replicas=2)),
                 id="vllm-ep"),
    pytest.param(lambda: vllm_layout(tiny_spec(moe=False, nkv=1, tied=True, bias=True),
                                     VllmParallel(tp=4, pp=2)), id="vllm-kvrep-tied-pp"),
])
def test_round_trip_with_torch_helpers(side):
    side = side()
    forms = dtensor_forms(side)
    checked = assert_round_trip(side)
    assert checked == sum(isinstance(f, DTensorForm) for f in forms.values())
    assert checked >= len(forms) - 2  # only embed_tokens / lm_head may be uneven (padded vocab)


# --------------------------------------------------------------------------- synthetic layouts


def test_strided_shard_for_disjoint_boxes():
    """Rank 0 rows [0,2)+[4,6), rank 1 [2,4)+[6,8): torch's right-to-left split, split_factor 2."""
    side = toy_side((8, 4), {0: [rows(0, 2), rows(4, 2)], 1: [rows(2, 2), rows(6, 2)]})
    form = dtensor_form(side, "t")
    assert form == DTensorForm((0, 1), (("strided_shard", 0, 2),))
    assert str(form) == "mesh (2,) [_StridedShard(0, split_factor=2)]"
    assert torch_placements(form) == (_StridedShard(0, split_factor=2),)
    assert assert_round_trip(side) == 1


@pytest.mark.parametrize("held, words", [
    ({0: [rows(0, 2), rows(6, 2)], 1: [rows(2, 4)]}, "disjoint boxes"),
    ({0: [rows(0, 4)], 1: [rows(0, 4)], 2: [rows(4, 4)]}, "uneven replication"),
    ({0: [rows(0, 4), rows(2, 4)], 1: [rows(4, 4)]}, "overlapping pieces"),
    ({0: [rows(0, 4)], 1: [rows(2, 6)]}, "overlap"),
    ({0: [rows(0, 3)], 1: [rows(3, 3)]}, "uncovered"),
    ({0: [rows(0, 2)], 1: [rows(2, 6)]}, "uneven rows"),
])
def test_not_expressible_reasons(held, words):
    form = dtensor_form(toy_side((8, 4), held), "t")
    assert isinstance(form, NotExpressible) and words in form.reason, form
    assert str(form).startswith("not expressible: ") and "\n" not in str(form)


def test_two_dim_sharding():
    """A 2x2 grid of blocks: Shard over both tensor dims, row-major ranks."""
    b = lambda r, c: Box((4 * r, 2 * c), (4, 2))
    side = toy_side((8, 4), {0: [b(0, 0)], 1: [b(0, 1)], 2: [b(1, 0)], 3: [b(1, 1)]})
    assert dtensor_form(side, "t") == DTensorForm(((0, 1), (2, 3)), (("shard", 0), ("shard", 1)))
    assert assert_round_trip(side) == 1


def test_unknown_and_unheld_tensors():
    side = toy_side((8, 4), {0: [rows(0, 8)]})
    with pytest.raises(LayoutError):
        dtensor_form(side, "nope")
    side = dataclasses.replace(side, tensors={**side.tensors, "u": ((2,), "float32")})
    assert dtensor_form(side, "u") == NotExpressible("held by no rank")


def test_report_and_summary():
    side = vllm_layout(tiny_spec(moe=False, vocab=250), VllmParallel(tp=4))
    report = dtensor_report(side)
    assert list(report) == list(side.tensors)
    assert report[L0 + "self_attn.o_proj.weight"] == "mesh (4,) [Shard(1)]"
    bad = [k for k, v in report.items() if v.startswith("not expressible: ")]
    assert bad == ["model.embed_tokens.weight", "lm_head.weight"]
    summary = dtensor_summary(report)
    assert summary.startswith(f"dtensor form: {len(report) - 2} of {len(report)} tensors expressible; 2 not")
    assert "\n" not in summary


