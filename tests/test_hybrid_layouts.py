"""Hybrid families (Nemotron-H: Mamba2 + attention + MLP/MoE; Qwen3-Next: GDN + gated attention
+ MoE with a shared expert): layout facts on both sides, refusals in one line, plans at the
per-rank minimum (uneven hybrid PP, EP, vLLM's group replication), full-size plans; then, in
processes, megatron-core's real HybridModel ranks refitting vLLM's own model class, bit for bit
against vLLM's own load (``mcore_reshard.testing.hybrid``)."""

from __future__ import annotations

import math

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout, megatron_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout, vllm_rank_params
from mcore_reshard.infra.checkpoint import TINY_FAMILIES
from mcore_reshard.layout import Box, LayoutError, load_model_spec, spec_from_hf_config
from mcore_reshard.plan.planner import build_plan
from mcore_reshard.settings.config import CONFIG_DIR


def _spec(family, dtype="float32", **kw):
    return spec_from_hf_config(dict(TINY_FAMILIES[family], **kw), dtype=dtype)


def _p(params):
    return {p.name: p for p in params}


def test_patterns_and_canonical_names():
    nh, qn = _spec("nemotron_h"), _spec("qwen3_next", "bfloat16")
    assert nh.family.megatron_pattern(nh) == "M-*M-" and qn.family.megatron_pattern(qn) == "GE*EGE*-"
    t = nh.tensor_table()
    assert t["backbone.layers.0.mixer.in_proj.weight"][0] == (2 * 128 + 2 * 2 * 16 + 8, 64)  # [z|x|B|C|dt]
    assert t["backbone.layers.0.mixer.conv1d.weight"][0] == (128 + 2 * 2 * 16, 1, 4)
    q = qn.tensor_table()
    assert q["model.layers.0.linear_attn.in_proj_qkvz.weight"][0] == (2 * (2 * 64 + 2 * 2 * 64), 64)
    assert q["model.layers.1.self_attn.q_proj.weight"][0] == (2 * 4 * 64, 64)  # [q_h; gate_h] per head
    assert q["model.layers.0.linear_attn.A_log"][1] == "float32"  # as both libraries hold it


def test_megatron_mamba_in_proj_is_five_row_runs_per_rank():
    spec = _spec("nemotron_h")
    for r in range(2):
        ip = _p(megatron_rank_params(spec, MegatronParallel(tp=2), r))["decoder.layers.0.mixer.in_proj.weight"]
        # z_r, x_r, B_r, C_r, dt_r: a plain gather of the ranks would interleave them
        assert [x.box.offsets[0] for x in ip.pieces] == [64 * r, 128 + 64 * r, 256 + 16 * r, 288 + 16 * r, 320 + 4 * r]
        assert [x.view.offset // 64 for x in ip.pieces] == [0, 64, 128, 144, 160]


def test_megatron_gdn_in_proj_against_hf_key_head_groups():
    spec = _spec("qwen3_next", "bfloat16")

    def runs(par, rank):
        ip = _p(megatron_rank_params(spec, par, rank))["decoder.layers.0.self_attention.in_proj.weight"]
        return [(x.canonical.rsplit(".", 2)[-2], x.box.offsets[0], x.box.sizes[0], x.view.offset // 64) for x in ip.pieces]

    # TP1 holds both key heads as [q0 q1 | k0 k1 | v0 v1 | z0 z1 | b0 b1 | a0 a1]; HF groups rows
    # per key head: in_proj_qkvz [q_g; k_g; v_g; z_g] (384 rows each), in_proj_ba [b_g; a_g]
    assert runs(MegatronParallel(), 0) == [
        ("in_proj_qkvz", 0, 64, 0), ("in_proj_qkvz", 384, 64, 64), ("in_proj_qkvz", 64, 64, 128),
        ("in_proj_qkvz", 448, 64, 192), ("in_proj_qkvz", 128, 128, 256), ("in_proj_qkvz", 512, 128, 384),
        ("in_proj_qkvz", 256, 128, 512), ("in_proj_qkvz", 640, 128, 640), ("in_proj_ba", 0, 2, 768),
        ("in_proj_ba", 4, 2, 770), ("in_proj_ba", 2, 2, 772), ("in_proj_ba", 6, 2, 774)]
    # TP2 rank 1 holds key head 1 alone: its [q | k | v | z] is HF's group 1 as it is, then [b | a]
    assert runs(MegatronParallel(tp=2), 1) == [("in_proj_qkvz", 384, 384, 0), ("in_proj_ba", 4, 4, 384)]


def test_megatron_gated_qkv_chunks_inside_a_kv_group():
    """Qwen3-Next's gated linear_qkv holds per KV group [q (its heads) | gate (its heads) | k | v];
    HF's q_proj holds [q_h; gate_h] per head. With 2 KV groups over TP4 each rank holds half a
    group's block (megatron's num_query_groups < tp path): rank 1 holds head 1's gate, k_0, v_0."""
    spec = _spec("qwen3_next", "bfloat16", linear_num_key_heads=4, linear_num_value_heads=8)
    qkv = _p(megatron_rank_params(spec, MegatronParallel(tp=4), 1))["decoder.layers.2.self_attention.linear_qkv.weight"]
    runs = [(x.canonical.rsplit(".", 2)[-2], x.box.offsets[0], x.box.sizes[0], x.view.offset // 64) for x in qkv.pieces]
    assert qkv.shape == (192, 64)
    assert runs == [("q_proj", 192, 64, 0), ("k_proj", 0, 64, 64), ("v_proj", 0, 64, 128)]


def test_vllm_replicates_a_single_group_on_every_rank():
    spec = _spec("nemotron_h_g1")
    for r in range(4):
        ip = _p(vllm_rank_params(spec, VllmParallel(tp=4), r))["model.layers.0.mixer.in_proj.weight"]
        B = ip.pieces[2]
        assert B.box == Box((256, 0), (16, 64))  # the whole group, on every rank


@pytest.mark.parametrize("mpar, vpar", [
    (MegatronParallel(tp=2), VllmParallel(tp=1)),
    (MegatronParallel(tp=1, pp=2, first_stage_layers=2), VllmParallel(tp=2)),  # uneven hybrid stages
    (MegatronParallel(tp=2, pp=2, last_stage_layers=3), VllmParallel(tp=2, replicas=2)),
])
def test_nemotron_h_plans_at_the_minimum(mpar, vpar):
    spec = _spec("nemotron_h")
    plan = build_plan(megatron_layout(spec, mpar), vllm_layout(spec, vpar))
    assert plan.bytes_planned == plan.bytes_min


@pytest.mark.parametrize("mpar, vpar", [
    (MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2)),
    (MegatronParallel(tp=1, pp=2, first_stage_layers=3, ep=2, dp=2), VllmParallel(tp=2, enable_ep=True)),  # cut inside HF layer 1
])
def test_qwen3_next_plans_at_the_minimum(mpar, vpar):
    spec = _spec("qwen3_next", "bfloat16")
    plan = build_plan(megatron_layout(spec, mpar), vllm_layout(spec, vpar))
    assert plan.bytes_planned == plan.bytes_min


def test_group_replication_plans_at_the_minimum():
    spec = _spec("nemotron_h_g1")
    plan = build_plan(megatron_layout(spec, MegatronParallel()), vllm_layout(spec, VllmParallel(tp=4)))
    assert plan.bytes_planned == plan.bytes_min
    assert any("whole group" in n for n in vllm_layout(spec, VllmParallel(tp=4)).notes)


@pytest.mark.parametrize("family, side, par, match", [
    ("nemotron_h", "vllm", VllmParallel(tp=4), r"nemotron_h: mixer.in_proj B/C: n_groups=2 .* vLLM tp=4"),
    ("nemotron_h", "megatron", MegatronParallel(tp=4), r"nemotron_h: mixer.in_proj B/C: n_groups=2 .* megatron tp=4"),
    ("nemotron_h", "vllm", VllmParallel(tp=3), r"mamba_num_heads=8 is not divisible by vLLM tp=3"),
    ("qwen3_next", "megatron", MegatronParallel(tp=4), r"linear_attn.in_proj_qkvz: linear_num_key_heads=2 .* tp=4"),
    ("qwen3_next", "vllm", VllmParallel(tp=4), r"linear_attn.in_proj_qkvz: linear_num_key_heads=2 .* vLLM tp=4"),
    ("nemotron_h", "megatron", MegatronParallel(pp=2, vpp=2), r"virtual pipeline stages need '\|'"),
    ("qwen3_next", "vllm", VllmParallel(tp=2, quantization="fp8_per_block"), r"FP8 rollout of a hybrid family is not built"),
])
def test_layouts_one_side_cannot_hold_are_refused_in_one_line(family, side, par, match):
    spec = _spec(family)
    with pytest.raises(LayoutError, match=match) as exc:
        (vllm_layout if side == "vllm" else megatron_layout)(spec, par)
    assert "\n" not in str(exc.value)


def test_unsupported_hybrid_configs_are_named():
    with pytest.raises(LayoutError, match="latent MoE"):
        _spec("nemotron_h", moe_latent_size=32)
    with pytest.raises(LayoutError, match="layers_block_type 'mamba3'"):
        _spec("nemotron_h", layers_block_type=["mamba3"])


@pytest.mark.heavy  # full-size plans (~1 s and ~10 s here)
@pytest.mark.parametrize("name, mpar, vpar", [
    ("nemotron-nano-9b-v2", MegatronParallel(tp=4), VllmParallel(tp=2)),
    ("nemotron-h-8b", MegatronParallel(tp=8, pp=2, last_stage_layers=28, dp=2), VllmParallel(tp=8, replicas=2)),
    ("qwen3-next-80b-a3b", MegatronParallel(tp=2, pp=2, ep=8, etp=1, dp=8, first_stage_layers=47),
     VllmParallel(tp=4, enable_ep=True)),
])
def test_full_size_hybrids_plan_at_the_minimum(name, mpar, vpar):
    spec = load_model_spec(CONFIG_DIR / "models" / f"{name}.json")
    plan = build_plan(megatron_layout(spec, mpar), vllm_layout(spec, vpar))
    assert plan.bytes_planned == plan.bytes_min
    assert plan.bytes_min < plan.bytes_hf_broadcast  # below the HF broadcast


def test_nemotron_h_8b_config_is_the_published_shape():
    """configs/models/nemotron-h-8b.json against Nemotron-H's published 8B shape: 52 layers, of
    them 24 Mamba2, 24 MLP and 4 attention, about 8.1B parameters."""
    spec = load_model_spec(CONFIG_DIR / "models" / "nemotron-h-8b.json")
    mixers = "".join(spec.hybrid.mixers)
    assert (len(mixers), mixers.count("M"), mixers.count("-"), mixers.count("*")) == (52, 24, 24, 4)
    params = sum(math.prod(t.shape) for t in spec.tensors().values())
    assert 8.0e9 < params < 8.2e9


@pytest.mark.heavy  # a full-size plan each (Qwen3-Next: ~12 s); the Nemotron-H ones twice, in < 1 s
@pytest.mark.parametrize("name", ["nemotron-h-8b", "nemotron-nano-9b-v2", "qwen3-next-80b-a3b"])
def test_hybrid_recipes_plan_and_dry_run(name, capsys):
    """``grpo --dry-run`` of each hybrid recipe: a plan at the per-rank minimum, below the HF
    broadcast, a modelled time, and the reason the local job cannot train it; for the
    Nemotron-H recipes also ``mcore-reshard plan --recipe``: the same plan (digest, bytes), the
    inter-node floor met. (The 30B recipes' tests compare the two at full size already; one
    Qwen3-Next plan is ~12 s here.)"""
    import json

    from mcore_reshard.cli import main

    recipe = str(CONFIG_DIR.parent / "recipes" / f"grpo-{name}-megatron-reshard.yaml")
    assert main(["grpo", recipe, "--dry-run", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["bytes_planned"] == rep["bytes_min"] < rep["bytes_hf_broadcast"]
    assert rep["modelled_refit_seconds"] > 0 and rep["bytes_inter_node"] >= rep["bytes_inter_node_min"] > 0
    assert "the local job trains" in rep["local_problem"]
    if name.startswith("qwen3-next"):
        return
    assert main(["plan", "--json", "--recipe", recipe]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["bytes_planned"] == plan["bytes_min"] == rep["bytes_min"]
    assert plan["bytes_hf_broadcast"] == rep["bytes_hf_broadcast"] and plan["digest"] == rep["plan"]["digest"]
    assert plan["bytes_inter_node"] == plan["bytes_inter_node_min"] > 0  # one copy per inference node
    assert plan["modelled_seconds"] > 0


# --------------------------------------------------------------------------- in processes


#: Qwen3-Next with 4 GDN key heads and 2 KV heads: megatron TP4 chunks the gated linear_qkv
#: inside each KV group's [q | gate | k | v] block; vLLM TP4 replicates each KV head on 2 ranks.
QWEN3_NEXT_K4 = dict(linear_num_key_heads=4, linear_num_value_heads=8)


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype, mtp, vtp, overrides", [
    ("nemotron_h", "float32", 2, 2, None),
    ("nemotron_h_g1", "float32", 1, 4, None),  # vLLM replicates the one group on 4 ranks
    ("qwen3_next", "bfloat16", 2, 2, None),
    ("qwen3_next", "bfloat16", 4, 4, QWEN3_NEXT_K4),
], ids=["nemotron_h-tp2-tp2", "nemotron_h_g1-tp1-tp4", "qwen3_next-tp2-tp2", "qwen3_next_k4-tp4-tp4"])
def test_megatron_hybrid_refit_equals_vllms_own_load(ckpt_cache, family, dtype, mtp, vtp, overrides):
    """megatron-core's HybridModel (real modules, CPU) holds exactly the predicted parameters;
    its ranks refit vLLM's model class (loaded from another checkpoint first) and every
    parameter, buffer, processed-kernel probe and derived tensor (Mamba's A, conv views) equals
    vLLM's own load of the checkpoint, bit for bit."""
    from support.megatron import run_world

    from mcore_reshard.testing.hybrid import megatron_hybrid_job, refit_inproc, reference_states
    from mcore_reshard.testing.vllm_inproc import compare_states

    ckpt = ckpt_cache.get(family=family, dtype=dtype, seed=0, overrides=overrides)
    stale = ckpt_cache.get(family=family, dtype=dtype, seed=1, overrides=overrides)
    spec = load_model_spec(ckpt, dtype=dtype)
    par = MegatronParallel(tp=mtp)
    ranks = run_world(megatron_hybrid_job, par.world_size, (str(ckpt), dtype, dict(tp=mtp)))
    for r in ranks:
        assert r["shapes_equal"], (r["only_megatron"][:3], r["only_rules"][:3], r["shape_diff"][:3])
        assert r["described"]  # live.describe accepts the model: a bf16 A_log where the table widens it
    ref = reference_states(ckpt, dtype, vtp)
    out = refit_inproc(ckpt, stale, dtype, vtp, megatron_layout(spec, par), {r["rank"]: r["tensors"] for r in ranks})
    # what vLLM's own loaders wrote, recorded, is what the family's table predicts
    for r in range(vtp):
        assert sorted(out["params"][r], key=lambda p: p.name) == sorted(
            vllm_rank_params(spec, VllmParallel(tp=vtp), r), key=lambda p: p.name)
    assert out["moved"] == out["plan"].bytes_planned == out["plan"].bytes_min
    for r in range(vtp):
        assert "model.embed_tokens.weight" in compare_states(ref[r], out["before"][r])  # the stale load really differs
        assert compare_states(ref[r], out["after"][r]) == []
        if spec.hybrid.mamba is not None:
            assert out["modes"][r]["model.layers.0.mixer.A"] == "reload"  # re-derived, never raw A_log bytes
            assert "buffer:model.layers.0.mixer.conv_weights" in ref[r]  # the conv view compared too


@pytest.mark.slow  # vLLM's model classes built in this process (about 10 s)
@pytest.mark.parametrize("family, dtype", [("nemotron_h", "float32"), ("qwen3_next", "bfloat16")])
def test_vllm_pp_stages_record_as_the_table_predicts(ckpt_cache, family, dtype):
    """vLLM's own loaders, recorded on each stage of PP2, hold what the table predicts: the
    decoder layers ``get_pp_indices`` gives the stage, and the embedding and head wherever vLLM
    builds them (Nemotron-H: embedding, final norm and head on every stage; Qwen3-Next: the
    embedding and the head on every stage, the final norm on the last)."""
    from mcore_reshard.adapters.vllm.record import record_local_params
    from mcore_reshard.testing.vllm_inproc import build_vllm_model

    ckpt = ckpt_cache.get(family=family, dtype=dtype, seed=0)
    spec = load_model_spec(ckpt, dtype=dtype)
    got = []
    for r in range(2):
        m = build_vllm_model(ckpt, dtype, 1, 0, pp=2, pp_rank=r)
        with m.active():
            got.append(_p(record_local_params(m.model, spec.tensor_table(), r)))
        assert sorted(got[r].values(), key=lambda p: p.name) == sorted(
            vllm_rank_params(spec, VllmParallel(pp=2), r), key=lambda p: p.name)
    first, last = got
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(first) & set(last)
    norm = "model.norm_f.weight" if family == "nemotron_h" else "model.norm.weight"
    assert norm in last and (norm in first) == (family == "nemotron_h")
    assert not any(".layers.0." in n for n in last) and not any(f".layers.{spec.num_layers - 1}." in n for n in first)
