"""Megatron layout rules: pinned facts, coverage/consistency, rejections (no processes)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from mcore_reshard.adapters.megatron.rules import (
    TIED_OUTPUT_NOTE,
    MegatronParallel,
    megatron_layout,
    megatron_rank_params,
    padded_vocab,
    rank_coords,
    stage_layers,
)
from mcore_reshard.layout import Box, LayoutError, spec_from_hf_config
from mcore_reshard.infra.checkpoint import TINY_DENSE, TINY_MOE

QWEN3_30B = dict(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    intermediate_size=6144, vocab_size=151936, torch_dtype="bfloat16",
)
QWEN3_235B = dict(QWEN3_30B, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                  moe_intermediate_size=1536, intermediate_size=12288)


def _params(spec, par, rank):
    return {p.name: p for p in megatron_rank_params(spec, par, rank)}


def _rows(piece):
    return piece.canonical.rsplit(".", 2)[-2], piece.box.offsets[0], piece.box.sizes[0], piece.view.offset


# --------------------------------------------------------------------------- pinned facts


def test_qwen3_30b_tp8_qkv_heads():
    spec = spec_from_hf_config(QWEN3_30B)
    par = MegatronParallel(tp=8, ep=8, etp=1)
    hn, H = 128, 2048
    for g in range(4):
        even = _params(spec, par, 2 * g)["decoder.layers.0.self_attention.linear_qkv.weight"]
        odd = _params(spec, par, 2 * g + 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert even.shape == odd.shape == (5 * hn, H)
        # rank 2g: q heads 8g..8g+4; rank 2g+1: q heads 8g+5..8g+7, then k_g, then v_g
        assert [_rows(p) for p in even.pieces] == [("q_proj", 8 * g * hn, 5 * hn, 0)]
        assert [_rows(p) for p in odd.pieces] == [
            ("q_proj", (8 * g + 5) * hn, 3 * hn, 0),
            ("k_proj", g * hn, hn, 3 * hn * H),
            ("v_proj", g * hn, hn, 4 * hn * H),
        ]
        assert all(p.box.sizes[1] == H and p.view.stride == (H, 1) for p in odd.pieces)


def test_qkv_boundary_inside_a_head_and_bias_in_the_same_order():
    # P = 4 query heads per group, 2 groups, tp 8: 1.5 heads per rank, boundaries inside heads
    spec = spec_from_hf_config(dict(TINY_DENSE, architectures=["Qwen2ForCausalLM"], head_dim=16), dtype="float32")
    assert spec.qkv_bias
    par = MegatronParallel(tp=8)
    hn = 16
    expect = {
        0: [("q_proj", 0, 24, 0)],
        1: [("q_proj", 24, 24, 0)],
        2: [("q_proj", 48, 16, 0), ("k_proj", 0, 8, 16)],
        3: [("k_proj", 8, 8, 0), ("v_proj", 0, 16, 8)],
        4: [("q_proj", 64, 24, 0)],
        7: [("k_proj", 24, 8, 0), ("v_proj", 16, 16, 8)],
    }
    for rank, rows in expect.items():
        params = _params(spec, par, rank)
        w = params["decoder.layers.1.self_attention.linear_qkv.weight"]
        b = params["decoder.layers.1.self_attention.linear_qkv.bias"]
        assert w.shape == (24, 64) and b.shape == (24,)
        assert [_rows(p)[:3] + (p.view.offset // 64,) for p in w.pieces] == rows
        assert [_rows(p) for p in b.pieces] == rows
    assert 1.5 * hn == 24


@pytest.mark.parametrize("tp, vp", [(1, 151936), (2, 152064), (4, 152064), (8, 152576)])
def test_vocab_padding(tp, vp):
    spec = spec_from_hf_config(QWEN3_30B)
    par = MegatronParallel(tp=tp, ep=8 // tp if tp < 8 else 1, etp=1, dp=8 // tp)
    assert padded_vocab(spec, par) == vp
    last = _params(spec, par, tp - 1)
    emb = last["embedding.word_embeddings.weight"]
    assert emb.shape == (vp // tp, 2048)
    assert emb.padding == (vp - 151936) * 2048
    assert emb.pieces[0].box == Box(((tp - 1) * vp // tp, 0), (151936 - (tp - 1) * vp // tp, 2048))
    out = last["output_layer.weight"]
    assert out.pieces[0].canonical == "lm_head.weight" and out.padding == emb.padding


def test_swiglu_fc1_stride2_dense_and_experts():
    spec = spec_from_hf_config(TINY_MOE, dtype="float32")
    par = MegatronParallel(tp=2)  # etp defaults to tp: experts TP-sharded too
    for rank in range(2):
        p = _params(spec, par, rank)["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
        assert p.shape == (32, 64)
        assert [_rows(x) for x in p.pieces] == [("gate_proj", 16 * rank, 16, 0), ("up_proj", 16 * rank, 16, 16 * 64)]
        fc2 = _params(spec, par, rank)["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"]
        assert fc2.shape == (64, 16) and fc2.pieces[0].box == Box((0, 16 * rank), (64, 16))
    dense = spec_from_hf_config(TINY_DENSE, dtype="float32")
    p = _params(dense, MegatronParallel(tp=4), 3)["decoder.layers.2.mlp.linear_fc1.weight"]
    assert [_rows(x) for x in p.pieces] == [("gate_proj", 96, 32, 0), ("up_proj", 96, 32, 32 * 64)]
    assert p.pieces[0].canonical == "model.layers.2.mlp.gate_proj.weight"


def test_expert_ownership_under_ep_and_grouped_names():
    spec = spec_from_hf_config(QWEN3_30B)
    par = MegatronParallel(tp=2, ep=4, etp=1, dp=2, experts="grouped")
    for rank in range(4):
        c = rank_coords(par, rank)
        params = _params(spec, par, rank)
        fc1 = [n for n in params if n.startswith("decoder.layers.5.mlp.experts.linear_fc1.weight")]
        assert len(fc1) == 32
        experts = {params[n].pieces[0].canonical.split(".")[5] for n in fc1}
        assert experts == {str(e) for e in range(32 * c["ep"], 32 * c["ep"] + 32)}
        p = params["decoder.layers.5.mlp.experts.linear_fc2.weight7"]
        assert p.pieces[0].canonical == f"model.layers.5.mlp.experts.{32 * c['ep'] + 7}.down_proj.weight"
        assert p.shape == (2048, 768)


def test_vpp_layer_assignment_and_chunk_names():
    par = MegatronParallel(pp=2, vpp=2)
    assert stage_layers(8, par) == (((0, 1), (4, 5)), ((2, 3), (6, 7)))
    spec = spec_from_hf_config(dict(TINY_DENSE, num_hidden_layers=8), dtype="float32")
    p0 = _params(spec, par, 0)
    assert "chunk0.embedding.word_embeddings.weight" in p0
    assert p0["chunk1.decoder.layers.0.input_layernorm.weight"].pieces[0].canonical == \
        "model.layers.4.input_layernorm.weight"
    p1 = _params(spec, par, 1)
    assert {"chunk1.decoder.final_layernorm.weight", "chunk1.output_layer.weight"} <= set(p1)
    assert p1["chunk0.decoder.layers.1.self_attention.linear_proj.weight"].pieces[0].canonical == \
        "model.layers.3.self_attn.o_proj.weight"


def test_uneven_pp():
    par = MegatronParallel(pp=8, first_stage_layers=10, last_stage_layers=12)
    stages = stage_layers(94, par)
    assert [len(s[0]) for s in stages] == [10] + [12] * 7
    assert stages[0][0] == tuple(range(10)) and stages[-1][0] == tuple(range(82, 94))
    par = MegatronParallel(pp=3, vpp=2, last_stage_layers=2)  # 10 layers: 4 | 4 | 2, interleaved
    assert stage_layers(10, par) == (((0, 1), (5, 6)), ((2, 3), (7, 8)), ((4,), (9,)))


@pytest.mark.heavy  # imports megatron-core (~4 s)
@pytest.mark.parametrize("num_layers, pp, vpp, first, last", [
    (8, 2, 2, None, None), (12, 3, 2, None, None), (16, 4, 4, None, None), (94, 8, 1, 10, 12),
    (10, 3, 2, None, 2), (10, 3, 2, 2, None), (14, 4, 2, 2, 4), (9, 2, 1, 4, None), (9, 2, 1, None, 4),
])
def test_stage_layers_match_megatron(num_layers, pp, vpp, first, last):
    """Layer placement equals megatron's own get_transformer_layer_offset / get_num_layers_to_build."""
    torch = pytest.importorskip("torch")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    ours = stage_layers(num_layers, MegatronParallel(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last))
    for r in range(pp):
        for v in range(vpp):
            vp = v if vpp > 1 else None
            n = get_num_layers_to_build(cfg, vp_stage=vp, pp_rank=r)
            off = get_transformer_layer_offset(cfg, vp_stage=vp, pp_rank=r)
            assert ours[r][v] == tuple(range(off, off + n)), (r, v)


def test_te_layer_spec_names():
    spec = spec_from_hf_config(dict(TINY_MOE, mlp_only_layers=[0]), dtype="float32")
    assert not spec.is_moe(0) and spec.is_moe(1)
    params = _params(spec, MegatronParallel(layer_spec="te"), 0)
    assert params["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].pieces[0].canonical == \
        "model.layers.0.input_layernorm.weight"
    assert params["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].pieces[0].canonical == \
        "model.layers.0.post_attention_layernorm.weight"
    assert params["decoder.layers.1.pre_mlp_layernorm.weight"].pieces[0].canonical == \
        "model.layers.1.post_attention_layernorm.weight"
    assert "decoder.layers.0.input_layernorm.weight" not in params
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in params
    assert params["decoder.layers.1.mlp.router.weight"].pieces[0].canonical == "model.layers.1.mlp.gate.weight"


def test_tied_embeddings():
    spec = spec_from_hf_config(dict(TINY_DENSE, tie_word_embeddings=True), dtype="float32")
    one = megatron_layout(spec, MegatronParallel(tp=2))
    assert not any("output_layer" in p.name for p in one.params) and not one.notes
    two = megatron_layout(spec, MegatronParallel(pp=2))
    assert two.notes == (TIED_OUTPUT_NOTE,)
    assert not any("output_layer" in p.name for p in two.params)
    assert "lm_head.weight" not in two.tensors
    assert any(p.name == "decoder.final_layernorm.weight" and p.rank == 1 for p in two.params)


# --------------------------------------------------------------------------- consistency


LAYOUTS = [
    (TINY_DENSE, MegatronParallel(tp=2, dp=2)),
    (TINY_DENSE, MegatronParallel(tp=8)),
    (TINY_DENSE, MegatronParallel(tp=2, pp=2, vpp=2, cp=2)),
    (TINY_MOE, MegatronParallel(tp=2, ep=4, etp=1, dp=2)),
    (TINY_MOE, MegatronParallel(tp=4, ep=2, etp=2, pp=2, first_stage_layers=1, experts="grouped")),
    (dict(TINY_MOE, tie_word_embeddings=True, num_key_value_heads=1), MegatronParallel(tp=4, ep=4, etp=1, pp=2)),
]


@pytest.mark.parametrize("cfg, par", LAYOUTS)
def test_every_element_covered_and_replicas_agree(cfg, par):
    spec = spec_from_hf_config(cfg, dtype="float32")
    layout = megatron_layout(spec, par)
    assert layout.world_size == par.world_size and {p.rank for p in layout.params} == set(range(par.world_size))
    boxes = defaultdict(lambda: defaultdict(int))
    for lp in layout.params:
        local = set()
        for pc in lp.pieces:
            assert pc.rank == lp.rank and pc.local_name == lp.name and pc.view.shape == pc.box.sizes
            assert all(0 <= o and o + n <= s for o, n, s in zip(pc.box.offsets, pc.box.sizes,
                                                                layout.tensors[pc.canonical][0]))
            elems = set(pc.view.elements())
            assert not local & elems and max(elems) < lp.numel
            local |= elems
            boxes[pc.canonical][pc.box] += 1
        assert lp.padding == lp.numel - len(local) >= 0
    assert set(boxes) == set(layout.tensors)
    edp = par.world_size // (par.etp_size * par.ep * par.pp)
    for name, reps in boxes.items():
        shape = layout.tensors[name][0]
        distinct = list(reps)
        # an exact partition: pairwise disjoint boxes whose sizes add up to the tensor
        assert sum(b.numel for b in distinct) == Box.full(shape).numel, name
        for i, a in enumerate(distinct):
            assert all(a.intersect(b) is None for b in distinct[i + 1:]), name
        counts = set(reps.values())
        if ".experts." in name:
            assert counts == {edp}, name
        elif name.endswith(("norm.weight", "mlp.gate.weight")):
            assert counts == {par.tp * par.cp * par.dp}, name
        else:
            assert counts == {par.cp * par.dp}, name


def test_qwen3_235b_layout_builds():
    spec = spec_from_hf_config(QWEN3_235B)
    par = MegatronParallel(tp=4, pp=8, ep=16, etp=1, dp=4, first_stage_layers=10, last_stage_layers=12)
    layout = megatron_layout(spec, par)
    assert layout.world_size == 128
    assert len(layout.tensors) == len(spec.tensors())
    expert_pieces = sum(1 for p in layout.pieces() if ".experts." in p.canonical)
    assert expert_pieces == 94 * 128 * 3  # edp = 1: each expert tensor exactly once
    rank0 = layout.for_rank(0)
    assert sum(".mlp.experts.local_experts." in p.name for p in rank0) == 10 * 8 * 2


# --------------------------------------------------------------------------- rejections


@pytest.mark.parametrize("cfg, par, rule", [
    (dict(TINY_DENSE, num_attention_heads=6, num_key_value_heads=2), MegatronParallel(tp=4), "num_attention_heads"),
    (dict(TINY_DENSE, num_attention_heads=12, num_key_value_heads=4), MegatronParallel(tp=3), "num_query_groups"),
    (TINY_MOE, MegatronParallel(ep=3, dp=3), "num_moe_experts"),
    (TINY_MOE, MegatronParallel(tp=2, ep=2), "expert_tensor_model_pipeline"),
    (TINY_DENSE, MegatronParallel(pp=3), "divisible by pp"),
    (TINY_DENSE, MegatronParallel(pp=2, first_stage_layers=3, last_stage_layers=3), "uneven PP"),
    (TINY_DENSE, MegatronParallel(pp=3, first_stage_layers=1), "middle"),
    (TINY_DENSE, MegatronParallel(vpp=2), "interleaved"),
    (TINY_DENSE, MegatronParallel(pp=2, vpp=4), "vpp"),
    (TINY_DENSE, MegatronParallel(pp=2, vpp=2, first_stage_layers=1), "first stage"),
    (dict(TINY_DENSE, intermediate_size=100), MegatronParallel(tp=8), "ffn_hidden_size"),
    (TINY_MOE, MegatronParallel(tp=2, etp=2, layer_spec="mcore"), "layer_spec"),
    (TINY_DENSE, MegatronParallel(tp=2, ep=2, etp=1), "is dense"),
])
def test_rejections(cfg, par, rule):
    spec = spec_from_hf_config(cfg, dtype="float32")
    with pytest.raises(LayoutError, match=rule):
        megatron_layout(spec, par)


def test_rank_out_of_range():
    spec = spec_from_hf_config(TINY_DENSE, dtype="float32")
    with pytest.raises(LayoutError, match="outside world"):
        megatron_rank_params(spec, MegatronParallel(tp=2), 2)
