"""vLLM model-format layout rules: pinned facts, exact coverage, and vLLM's own helpers as oracle."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout, vllm_rank_params
from mcore_reshard.layout import LayoutError, spec_from_hf_config
from mcore_reshard.transport.views import materialize_local
from mcore_reshard.infra.checkpoint import TINY_DENSE, TINY_MOE

QWEN3_235B = dict(
    architectures=["Qwen3MoeForCausalLM"], hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
    head_dim=128, num_hidden_layers=94, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
    num_experts_per_tok=8, vocab_size=151936, torch_dtype="bfloat16",
)


def _spec(base=TINY_DENSE, **overrides):
    # The pinned shapes below were derived for head_dim 16 (metadata only; no engine runs it).
    return spec_from_hf_config({**base, "head_dim": 16, **overrides}, dtype="float32")


def _params(spec, par, rank):
    return {p.name: p for p in vllm_rank_params(spec, par, rank)}


def _random_canonical(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) for n, t in spec.tensors().items()}


# ----------------------------------------------------------------------------- pinned facts


def test_vocab_151936_is_already_pad64():
    spec = _spec(QWEN3_235B)
    p = _params(spec, VllmParallel(tp=8), 7)["model.embed_tokens.weight"]
    assert p.shape == (151936 // 8, 4096)
    assert p.padding == 0
    assert p.pieces[0].box.offsets == (7 * 18992, 0)


def test_vocab_1000_pads_to_1024_real_rows_first():
    spec = _spec()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        r0 = _params(spec, VllmParallel(tp=2), 0)[name]
        r1 = _params(spec, VllmParallel(tp=2), 1)[name]
        assert r0.shape == r1.shape == (512, 64)
        assert r0.padding == 0 and r0.pieces[0].box.offsets == (0, 0)
        (piece,) = r1.pieces
        assert piece.canonical == name
        assert piece.box.offsets == (512, 0) and piece.box.sizes == (488, 64)
        assert piece.view.offset == 0  # real rows first, 24 zero rows after
        assert r1.padding == 24 * 64


def test_kv_heads_replicated_when_tp_exceeds_nkv():
    spec = _spec()  # 8 heads, 2 KV heads, head_dim 16
    for r in range(4):
        qkv = _params(spec, VllmParallel(tp=4), r)["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape == (2 * 16 + 16 + 16, 64)
        q, k, v = qkv.pieces
        assert q.canonical.endswith("q_proj.weight") and q.box.offsets == (r * 32, 0)
        assert k.box.offsets == v.box.offsets == ((r // 2) * 16, 0) and k.box.sizes == (16, 64)
        assert (q.view.offset, k.view.offset, v.view.offset) == (0, 32 * 64, 48 * 64)


def test_moe_names_and_shapes():
    spec = _spec(TINY_MOE)
    ps = _params(spec, VllmParallel(tp=2), 1)
    w13 = ps["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    w2 = ps["model.layers.0.mlp.experts.routed_experts.w2_weight"]
    assert w13.shape == (8, 2 * 16, 64) and w2.shape == (8, 64, 16)
    assert ps["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    gate, up = w13.pieces[2], w13.pieces[3]  # slot 1
    assert gate.canonical == "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert gate.box.offsets == up.box.offsets == (16, 0)
    assert (gate.view.offset, up.view.offset) == (32 * 64, 32 * 64 + 16 * 64)
    assert w2.pieces[1].box.offsets == (0, 16) and w2.pieces[1].view.stride == (16, 1)
    assert not any("gate_up_proj" in n for n in ps)


def test_moe_tp_flattened_over_dp_without_ep():
    spec = _spec(TINY_MOE)
    par = VllmParallel(tp=2, dp=2)
    for rank in range(4):
        tp_r, dp_r = rank % 2, rank // 2
        ps = _params(spec, par, rank)
        w2 = ps["model.layers.1.mlp.experts.routed_experts.w2_weight"]
        assert w2.shape == (8, 64, 8)
        assert {p.box.offsets for p in w2.pieces} == {(0, (dp_r * 2 + tp_r) * 8)}
        # attention is only TP-sharded: the DP ranks hold the same rows
        q = ps["model.layers.1.self_attn.qkv_proj.weight"].pieces[0]
        assert q.box.offsets == (tp_r * 64, 0)


def _local_experts(spec, par, rank, layer=0):
    w13 = _params(spec, par, rank)[f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"]
    return [int(p.canonical.split(".experts.")[1].split(".")[0]) for p in w13.pieces[::2]]


def test_ep_linear_placement_with_redundant_experts():
    spec = _spec(TINY_MOE)  # E = 8
    par = VllmParallel(tp=2, enable_ep=True, num_redundant_experts=2)  # G = 10 over ep = 2
    assert _local_experts(spec, par, 0) == [0, 1, 2, 3, 4]
    assert _local_experts(spec, par, 1) == [5, 6, 7, 0, 1]
    w13 = _params(spec, par, 1)["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (5, 64, 64) and w13.padding == 0  # whole experts, no MoE TP


@pytest.mark.heavy  # imports vLLM (~5 s)
def test_ep_placement_matches_vllm_determine_expert_map():
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    spec = _spec(TINY_MOE)
    par = VllmParallel(tp=1, dp=3, enable_ep=True)  # 8 experts over 3 ranks: uneven, no EPLB
    for ep_rank in range(3):
        n, expert_map, _ = determine_expert_map(3, ep_rank, 8, "linear")
        expected = [e for e in range(8) if expert_map[e] >= 0]
        assert _local_experts(spec, par, ep_rank) == expected and len(expected) == n


#: sha256[:16] of vLLM 0.32.0's own sources of what ``adapters/vllm/stamps.py`` copies.
VLLM_STAMP_SOURCES = {
    "ShardedRDTWeightTransferEngine._install_recording_stamps": "1ee6d2c00df677d4",
    "ShardedRDTWeightTransferEngine._restore_after_dry_run": "635a268f6da7dbf8",
    "_get_original_loader": "451476e6c046a6b1",
    "_place_kernel_tensors": "9a7d866d7e5dcac8",
}


@pytest.mark.heavy  # imports vLLM (~5 s)
def test_the_recording_stamps_copy_still_matches_vllms_own():
    """``stamps.py`` copies four private vLLM functions instead of calling them. When a vLLM
    upgrade changes one, this names it: re-read the copy against it, then pin the new digest."""
    import hashlib
    import importlib
    import inspect
    import textwrap

    from mcore_reshard.adapters.vllm.stamps import VLLM_SOURCES

    got = {}
    for module, qualname in VLLM_SOURCES:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        got[qualname] = hashlib.sha256(textwrap.dedent(inspect.getsource(obj)).encode()).hexdigest()[:16]
    drifted = sorted(q for q, d in got.items() if VLLM_STAMP_SOURCES.get(q) != d)
    assert not drifted, f"vLLM changed {drifted}: re-check mcore_reshard/adapters/vllm/stamps.py against them"


def test_explicit_physical_map_duplicates_are_separate_destinations():
    spec = _spec(TINY_MOE, num_hidden_layers=2)
    phys = (3, 3, 0, 1, 2, 4, 5, 6, 7, 3)  # logical 3 in three slots
    par = VllmParallel(tp=2, enable_ep=True, num_redundant_experts=2,
                       physical_to_logical=((0, phys), (1, tuple(range(8)) + (0, 1))))
    assert _local_experts(spec, par, 0, layer=0) + _local_experts(spec, par, 1, layer=0) == list(phys)
    lay = vllm_layout(spec, par)
    dests = [p for p in lay.pieces() if p.canonical == "model.layers.0.mlp.experts.3.down_proj.weight"]
    assert sorted((p.rank, p.view.offset) for p in dests) == [(0, 0), (0, 64 * 32), (1, 4 * 64 * 32)]


def test_round_robin_falls_back_to_linear():
    spec = _spec(TINY_MOE)
    rr = VllmParallel(tp=2, dp=2, enable_ep=True, expert_placement="round_robin")
    lin = VllmParallel(tp=2, dp=2, enable_ep=True)
    assert [_local_experts(spec, rr, r) for r in range(4)] == [_local_experts(spec, lin, r) for r in range(4)]


@pytest.mark.heavy  # imports vLLM (~5 s)
def test_pp_partition_matches_get_pp_indices(monkeypatch):
    from vllm.distributed.utils import get_pp_indices

    spec = _spec(TINY_DENSE, num_hidden_layers=94)

    def stage_layers(par, pp_r):
        names = _params(spec, par, pp_r * par.tp)
        return sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for pp in (3, 8):
        for pp_r in range(pp):
            lo, hi = get_pp_indices(94, pp_r, pp)
            assert stage_layers(VllmParallel(pp=pp), pp_r) == list(range(lo, hi))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "10,20,30,34")
    for pp_r in range(4):
        lo, hi = get_pp_indices(94, pp_r, 4)
        assert stage_layers(VllmParallel(pp=4, pp_partition=(10, 20, 30, 34)), pp_r) == list(range(lo, hi))


def test_pp_embedding_and_head_placement():
    dense, tied, moe = _spec(), _spec(tie_word_embeddings=True), _spec(TINY_MOE)
    par = VllmParallel(pp=2)
    first, last = _params(dense, par, 0), _params(dense, par, 1)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "model.embed_tokens.weight" not in last and {"lm_head.weight", "model.norm.weight"} <= set(last)
    # tied: lm_head *is* embed_tokens, so the last stage builds the embedding and no lm_head
    assert "model.embed_tokens.weight" in _params(tied, par, 1)
    assert not any(n == "lm_head.weight" for r in (0, 1) for n in _params(tied, par, r))
    # Qwen3-MoE builds embed_tokens, norm and lm_head on every stage
    for r in (0, 1):
        assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= set(_params(moe, par, r))


def test_full_size_qwen3_235b_ep_holds_each_expert_once_per_engine():
    spec = _spec(QWEN3_235B)
    lay = vllm_layout(spec, VllmParallel(tp=8, dp=8, enable_ep=True))
    assert lay.world_size == 64
    w13 = [p for p in lay.params if p.name.endswith("w13_weight")]
    assert {p.shape for p in w13} == {(2, 2 * 1536, 4096)}
    counts = Counter(pc.canonical for p in w13 for pc in p.pieces)
    assert len(counts) == 94 * 128 * 2 and set(counts.values()) == {1}


# ----------------------------------------------------------------------------- coverage

SMALL = [
    ("dense tp1", TINY_DENSE, {}, VllmParallel()),
    ("dense tp4 pp2 dp2", TINY_DENSE, {}, VllmParallel(tp=4, pp=2, dp=2)),
    ("dense tp8 bias tied x2", TINY_DENSE, {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
     VllmParallel(tp=8, replicas=2)),
    ("llama tp2 pp3", TINY_DENSE, {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 5},
     VllmParallel(tp=2, pp=3)),
    ("moe tp2 dp2", TINY_MOE, {}, VllmParallel(tp=2, dp=2)),
    ("moe ep tp2 dp2 pp2", TINY_MOE, {"mlp_only_layers": [1]}, VllmParallel(tp=2, dp=2, pp=2, enable_ep=True)),
    ("moe ep redundant x2", TINY_MOE, {}, VllmParallel(tp=4, enable_ep=True, num_redundant_experts=4, replicas=2)),
]


@pytest.mark.parametrize("base,overrides,par", [c[1:] for c in SMALL], ids=[c[0] for c in SMALL])
def test_local_elements_covered_once_and_every_canonical_element_per_replica(base, overrides, par):
    spec = _spec(base, **overrides)
    lay = vllm_layout(spec, par)
    for p in lay.params:
        seen = [i for pc in p.pieces for i in pc.view.elements()]
        assert len(seen) == len(set(seen)), p.name
        assert all(0 <= i < p.numel for i in seen), p.name
        assert p.numel - len(seen) == p.padding
        assert all(pc.rank == p.rank and pc.local_name == p.name for pc in p.pieces)
        assert all(pc.view.shape == pc.box.sizes for pc in p.pieces)
        assert p.dtype == spec.dtype
    per_replica = par.dp * par.pp * par.tp
    for replica in range(par.replicas):
        cover = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in spec.tensors().items()}
        for pc in lay.pieces():
            if pc.rank // per_replica == replica:
                box = cover[pc.canonical][tuple(slice(o, o + n) for o, n in zip(pc.box.offsets, pc.box.sizes))]
                box += 1
        uncovered = [n for n, c in cover.items() if not bool((c > 0).all())]
        assert not uncovered, uncovered[:5]
    assert set(lay.tensors) == set(spec.tensors())


def _chunk(t, n, i, dim=0):
    return t.chunk(n, dim)[i]


def test_materialized_locals_match_an_independent_torch_construction():
    """Local tensors built from the descriptors equal what vLLM's loaders compute with torch ops."""
    spec = _spec(TINY_MOE, attention_bias=True, mlp_only_layers=[1])
    ref = _random_canonical(spec)
    tp, dp = 4, 2
    for ep in (False, True):
        par = VllmParallel(tp=tp, dp=dp, enable_ep=ep)
        for rank in range(tp * dp):
            tp_r, mr = rank % tp, rank
            ps = _params(spec, par, rank)
            got = {n: materialize_local(p, ref) for n, p in ps.items()}
            a = "model.layers.0.self_attn."
            kv = tp_r // 2  # 2 KV heads over 4 ranks
            q = [_chunk(ref[a + f"q_proj.{w}"], tp, tp_r) for w in ("weight", "bias")]
            k = [_chunk(ref[a + f"k_proj.{w}"], 2, kv) for w in ("weight", "bias")]
            v = [_chunk(ref[a + f"v_proj.{w}"], 2, kv) for w in ("weight", "bias")]
            assert torch.equal(got[a + "qkv_proj.weight"], torch.cat([q[0], k[0], v[0]]))
            assert torch.equal(got[a + "qkv_proj.bias"], torch.cat([q[1], k[1], v[1]]))
            assert torch.equal(got[a + "o_proj.weight"], _chunk(ref[a + "o_proj.weight"], tp, tp_r, 1))
            m = "model.layers.1.mlp."
            gu = torch.cat([_chunk(ref[m + "gate_proj.weight"], tp, tp_r), _chunk(ref[m + "up_proj.weight"], tp, tp_r)])
            assert torch.equal(got[m + "gate_up_proj.weight"], gu)
            assert torch.equal(got[m + "down_proj.weight"], _chunk(ref[m + "down_proj.weight"], tp, tp_r, 1))
            x = "model.layers.0.mlp.experts."
            if ep:
                experts, n_tp, r_tp = range(mr, mr + 1), 1, 0  # 8 experts over 8 ranks
            else:
                experts, n_tp, r_tp = range(8), tp * dp, mr
            w13 = torch.stack([torch.cat([_chunk(ref[f"{x}{e}.gate_proj.weight"], n_tp, r_tp),
                                          _chunk(ref[f"{x}{e}.up_proj.weight"], n_tp, r_tp)]) for e in experts])
            w2 = torch.stack([_chunk(ref[f"{x}{e}.down_proj.weight"], n_tp, r_tp, 1) for e in experts])
            assert torch.equal(got[x + "routed_experts.w13_weight"], w13)
            assert torch.equal(got[x + "routed_experts.w2_weight"], w2)
            emb = torch.zeros(256, 64)
            rows = ref["model.embed_tokens.weight"][tp_r * 256 : (tp_r + 1) * 256]
            emb[: rows.shape[0]] = rows
            assert torch.equal(got["model.embed_tokens.weight"], emb)
            assert torch.equal(got["model.layers.0.mlp.gate.weight"], ref["model.layers.0.mlp.gate.weight"])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "base,overrides,par,match",
    [
        (TINY_DENSE, {}, VllmParallel(tp=3), "num_attention_heads=8 is not divisible by tp=3"),
        (TINY_DENSE, {"num_attention_heads": 12, "num_key_value_heads": 3}, VllmParallel(tp=2), "num_key_value_heads=3"),
        (TINY_DENSE, {"num_attention_heads": 12, "num_key_value_heads": 3}, VllmParallel(tp=4), "KV replication"),
        (TINY_DENSE, {"num_attention_heads": 12, "num_key_value_heads": 12, "intermediate_size": 96},
         VllmParallel(tp=3), "padded vocab 1024"),
        (TINY_DENSE, {"intermediate_size": 100}, VllmParallel(tp=8), "intermediate_size=100"),
        (TINY_DENSE, {}, VllmParallel(pp=5), "pp=5 exceeds num_layers=4"),
        (TINY_DENSE, {}, VllmParallel(pp=2, pp_partition=(1, 2)), "does not split num_layers=4"),
        (TINY_DENSE, {}, VllmParallel(pp=2, pp_partition=(4,)), "pp=2"),
        (TINY_DENSE, {}, VllmParallel(tp=0), "tp=0"),
        (TINY_DENSE, {"architectures": ["LlamaForCausalLM"], "attention_bias": True}, VllmParallel(), "o_proj.bias"),
        (TINY_DENSE, {}, VllmParallel(tp=2, enable_ep=True, num_redundant_experts=1), "without MoE layers"),
        (TINY_MOE, {"moe_intermediate_size": 36}, VllmParallel(tp=8), "moe_intermediate_size=36"),
        (TINY_MOE, {"num_experts": 4, "num_experts_per_tok": 2}, VllmParallel(tp=8), "greater than num_experts=4"),
        (TINY_MOE, {}, VllmParallel(tp=2, num_redundant_experts=2), "needs enable_ep"),
        (TINY_MOE, {}, VllmParallel(tp=1, enable_ep=True, num_redundant_experts=2), "needs enable_ep"),
        (TINY_MOE, {}, VllmParallel(tp=2, enable_ep=True, num_redundant_experts=1), "even split"),
        (TINY_MOE, {}, VllmParallel(tp=2, enable_ep=True, expert_placement="random"), "expert_placement"),
        (TINY_MOE, {"num_hidden_layers": 1}, VllmParallel(tp=2, enable_ep=True, physical_to_logical=((0, tuple(range(7))),)),
         "maps 7 physical slots"),
        (TINY_MOE, {"num_hidden_layers": 1}, VllmParallel(tp=2, enable_ep=True, physical_to_logical=((0, (0,) * 8),)),
         "no slot for logical experts"),
        (TINY_MOE, {"num_hidden_layers": 2}, VllmParallel(tp=2, enable_ep=True, physical_to_logical=((0, tuple(range(8))),)),
         "no map for MoE layers \\[1\\]"),
        (TINY_MOE, {"mlp_only_layers": [0]}, VllmParallel(tp=2, enable_ep=True,
                                                          physical_to_logical=((0, tuple(range(8))),)), "not a MoE layer"),
    ],
)
def test_impossible_layouts_are_rejected(base, overrides, par, match):
    with pytest.raises(LayoutError, match=match):
        vllm_layout(_spec(base, **overrides), par)


def test_rank_outside_world_is_rejected():
    with pytest.raises(LayoutError, match="rank 4 outside"):
        vllm_rank_params(_spec(), VllmParallel(tp=2, pp=2), 4)
