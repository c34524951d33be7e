"""DeepSeek-V3 family on the megatron side: MLA, shared experts, router expert bias, dense
first layers. Pure rule facts first, then real megatron-core models on CPU (2-process gloo
jobs) cross-checked element by element against megatron's own ``sharded_state_dict()`` and,
with a tiny HF checkpoint loaded through the descriptors, against HF transformers' logits.
"""

from __future__ import annotations

import re

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout, megatron_rank_params
from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3, make_tiny_checkpoint
from mcore_reshard.settings.config import CONFIG_DIR
from mcore_reshard.layout import Box, LayoutError, load_model_spec, spec_from_hf_config
from support.megatron import run_world  # warm rank processes, one per world size (conftest.py)

import _megatron_jobs

TOKENS = [3, 17, 998, 42, 5, 600, 7, 123, 999, 0, 77, 250]
NO_Q_LORA = dict(TINY_DEEPSEEK_V3, q_lora_rank=None)


def _params(spec, par, rank):
    return {p.name: p for p in megatron_rank_params(spec, par, rank)}


# --------------------------------------------------------------------------- spec


def test_real_configs_give_the_published_sizes():
    sizes = {}
    for name in ("deepseek-v3", "kimi-k2", "moonlight-16b-a3b"):
        spec = load_model_spec(CONFIG_DIR / "models" / f"{name}.json")
        sizes[name] = spec.total_bytes() // spec.itemsize
        assert spec.arch == "deepseek_v3" and spec.mla is not None and spec.router_bias
    # main-model parameters (MTP layer not counted): 671B, 1.03T, 16B
    assert round(sizes["deepseek-v3"] / 1e9) == 671
    assert round(sizes["kimi-k2"] / 1e9) == 1026
    assert round(sizes["moonlight-16b-a3b"] / 1e9) == 16
    ds = load_model_spec(CONFIG_DIR / "models" / "deepseek-v3.json")
    assert ds.moe_layers == tuple(range(3, 61)) and ds.mtp_layers == 1 and ds.shared_intermediate == 2048
    assert "model.layers.61.self_attn.q_a_proj.weight" not in ds.tensors()  # MTP: not described
    moon = load_model_spec(CONFIG_DIR / "models" / "moonlight-16b-a3b.json")
    assert moon.mla.q_lora_rank is None and moon.shared_intermediate == 2 * 1408
    assert "model.layers.0.self_attn.q_proj.weight" in moon.tensors()
    assert "model.layers.0.self_attn.q_a_proj.weight" not in moon.tensors()


@pytest.mark.heavy  # writes HF checkpoints (imports transformers)
def test_tiny_spec_matches_the_hf_checkpoint(tmp_path):
    from mcore_reshard.infra.checkpoint import load_canonical

    for name, cfg in (("q_lora", TINY_DEEPSEEK_V3), ("plain_q", NO_Q_LORA)):
        ckpt = make_tiny_checkpoint(tmp_path / name, overrides=cfg, family="deepseek_v3")
        tensors = load_canonical(ckpt)
        spec = load_model_spec(ckpt, dtype="float32")
        assert {n: tuple(t.shape) for n, t in tensors.items()} == {n: s for n, (s, _) in spec.tensor_table().items()}
        assert spec.moe_layers == (1, 2, 3)
        assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # randomised


# --------------------------------------------------------------------------- rules


def test_mla_up_projections_split_by_heads_down_projections_by_spec():
    spec = load_model_spec(CONFIG_DIR / "models" / "deepseek-v3.json")
    a = "model.layers.0.self_attn."
    for spec_kind, down_rows in (("local", 1536 // 8), ("te", 1536)):
        par = MegatronParallel(tp=8, pp=1, ep=8, etp=1, layer_spec=spec_kind)
        p = _params(spec, par, 3)
        pre = "decoder.layers.0.self_attention."
        up = p[pre + "linear_q_up_proj.weight"]
        assert up.shape == (16 * 192, 1536) and up.pieces[0].box == Box((3 * 16 * 192, 0), (16 * 192, 1536))
        kv = p[pre + "linear_kv_up_proj.weight"]
        assert kv.pieces[0].canonical == a + "kv_b_proj.weight"
        assert kv.pieces[0].box == Box((3 * 16 * 256, 0), (16 * 256, 512))  # 16 heads of [k_nope 128; v 128]
        o = p[pre + "linear_proj.weight"]
        assert o.pieces[0].box == Box((0, 3 * 16 * 128), (7168, 16 * 128))
        down = p[pre + "linear_q_down_proj.weight"]
        assert down.shape == (down_rows, 7168)
        assert down.pieces[0].box.offsets[0] == (3 * down_rows if spec_kind == "local" else 0)
        norm = pre + ("linear_q_up_proj.layer_norm_weight" if spec_kind == "te" else "q_layernorm.weight")
        assert p[norm].pieces[0].canonical == a + "q_a_layernorm.weight"
        assert "decoder.layers.0.input_layernorm.weight" in p  # separate in both specs


def test_shared_experts_router_bias_and_dense_first_layers():
    spec = spec_from_hf_config(TINY_DEEPSEEK_V3, dtype="float32")
    par = MegatronParallel(tp=2, ep=2, etp=1)
    for rank in range(2):
        p = _params(spec, par, rank)
        fc1 = p["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
        assert [(x.canonical.rsplit(".", 3)[-3:-1], x.box.offsets[0], x.view.offset) for x in fc1.pieces] == [
            (["shared_experts", "gate_proj"], 16 * rank, 0), (["shared_experts", "up_proj"], 16 * rank, 16 * 64)]
        bias = p["decoder.layers.1.mlp.router.expert_bias"]
        assert bias.pieces[0].canonical == "model.layers.1.mlp.gate.e_score_correction_bias"
        assert "decoder.layers.0.mlp.linear_fc1.weight" in p and "decoder.layers.0.mlp.router.weight" not in p
        experts = {x.pieces[0].canonical.split(".")[5] for n, x in p.items() if ".experts.local_experts." in n}
        assert experts == {str(e) for e in range(4 * rank, 4 * rank + 4)}


def test_mla_rejections():
    spec = spec_from_hf_config(dict(TINY_DEEPSEEK_V3, q_lora_rank=30), dtype="float32")
    with pytest.raises(LayoutError, match="q_lora_rank=30.*tp=4"):
        megatron_layout(spec, MegatronParallel(tp=4))
    megatron_layout(spec, MegatronParallel(tp=4, layer_spec="te"))  # TE: replicated down-projections
    plain_q = spec_from_hf_config(NO_Q_LORA, dtype="float32")
    with pytest.raises(LayoutError, match="QKNormConfigResolver"):
        megatron_layout(plain_q, MegatronParallel(tp=2, layer_spec="te"))
    with pytest.raises(LayoutError, match="attention_bias"):
        spec_from_hf_config(dict(TINY_DEEPSEEK_V3, attention_bias=True))


# --------------------------------------------------------------------------- live


def _deepseek_global(spec, ids, key, layer, expert, vocab_padded):
    """HF ids behind a megatron checkpoint key, for the DeepSeek-only keys (MLA, shared
    experts, router bias); everything else as the Qwen3 oracle maps it."""
    hf = f"model.layers.{layer}."
    tail = re.sub(r"^\d+\.", "", key.rsplit("layers.", 1)[-1])
    simple = {
        "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
        "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
        "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    }
    if tail in simple:
        return ids[hf + simple[tail]]
    if tail == "mlp.shared_experts.linear_fc1.weight":
        s = hf + "mlp.shared_experts."
        return torch.cat([ids[s + "gate_proj.weight"], ids[s + "up_proj.weight"]])
    return _QWEN_GLOBAL(spec, ids, key, layer, expert, vocab_padded)


_QWEN_GLOBAL = _megatron_jobs._megatron_global


def deepseek_job(ctx, par, cfg, ckpt, tokens):
    """``_megatron_jobs.layout_job`` with the DeepSeek keys added to its oracle (this job only:
    the rank process runs other jobs after it)."""
    _megatron_jobs._megatron_global = _deepseek_global
    try:
        return _megatron_jobs.layout_job(ctx, par, cfg, ckpt, tokens)
    finally:
        _megatron_jobs._megatron_global = _QWEN_GLOBAL


def _run(par, cfg, ckpt=None):
    return run_world(deepseek_job, par.world_size, (par, cfg, str(ckpt) if ckpt else None, TOKENS), timeout_s=240)


def _check(results, par, cfg):
    """Descriptors == rules == sharded_state_dict placement; main replicas cover each element once."""
    spec = spec_from_hf_config(cfg, dtype="float32")
    ids = _megatron_jobs.canonical_ids(spec)
    total = sum(t.numel() for t in ids.values())
    main_count = torch.zeros(total, dtype=torch.int64)
    for res in results:
        assert res["descs"] == megatron_rank_params(spec, par, res["rank"])
        assert {d.name for d in res["descs"]} == set(res["live_names"]) == set(res["oracle"]), res["unmatched"]
        for name in res["live_names"]:
            pred, orac = res["predicted"][name], res["oracle"][name]
            assert torch.equal(pred, orac), f"rank {res['rank']} {name}: descriptor placement != sharded_state_dict"
            sel = orac[(orac >= 0) & res["main"][name]]
            main_count.index_add_(0, sel, torch.ones_like(sel))
    assert torch.equal(main_count, torch.ones_like(main_count)), "main replicas must cover each element once"
    if "logits" in results[0]:
        for res in results:
            torch.testing.assert_close(res["logits"], results[0]["hf_logits"], rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return dict(q_lora=make_tiny_checkpoint(root / "q_lora", family="deepseek_v3", seed=5),
                plain_q=make_tiny_checkpoint(root / "plain_q", overrides=NO_Q_LORA, family="deepseek_v3", seed=6))


@pytest.mark.slow
@pytest.mark.parametrize("par, variant", [
    (MegatronParallel(tp=2, ep=2, etp=1), "q_lora"),  # (TP2 alone is inside this one)
    (MegatronParallel(dp=2, ep=2), "plain_q"),
], ids=["tp2-ep2", "ep2-plain-q"])
def test_live_placement_and_hf_logits(ckpts, par, variant):
    cfg = TINY_DEEPSEEK_V3 if variant == "q_lora" else NO_Q_LORA
    _check(_run(par, cfg, ckpts[variant]), par, cfg)


@pytest.mark.slow
def test_live_pp2_placement():
    par = MegatronParallel(pp=2)
    res = _run(par, TINY_DEEPSEEK_V3)
    _check(res, par, TINY_DEEPSEEK_V3)
    dense = [any(n.endswith("mlp.linear_fc1.weight") for n in r["live_names"]) for r in res]
    assert dense == [True, False]  # the dense first layer is on stage 0
