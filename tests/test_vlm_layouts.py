"""Vision-language layouts on metadata alone (``layout/families/llava.py``): no process starts.

- The table's canonical tensors are the hub checkpoints' (``vision_tower.vision_model.*``),
  checked against transformers' own LLaVA on the meta device -- tiny and llava-1.5-7b -- and
  the tower layers LLaVA does not use (after ``vision_feature_layer``, ``post_layernorm``) are
  exactly what the table leaves out.
- Both sides' pieces pinned where the tower differs from the language model: megatron's CLIP
  ``class_token`` ``(1, 1, H)`` as HF's ``class_embedding``, the per-head interleaved
  ``linear_qkv`` (``[q_h; k_h; v_h]``, no GQA) against vLLM's ``qkv_proj`` ``[q_r; k_r; v_r]``.
- Plans at the minimum, run in-process bit for bit, over TP 1/2 trainers (local and TE specs,
  DP) and TP 1/2/4 engines (replicas).
- A frozen tower: the later refits' plan leaves exactly its tensors out; the encoder cache is
  dropped only when a refit moves what the encoder computes with.
- Bad input, one line each: a tower TP cannot shard, PP of a LLaVA model, a tower this table
  does not describe, freezing a text model's tower, images for a text model, and a policy with
  a tower planned against engines without one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout, megatron_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout, vllm_rank_params
from mcore_reshard.errors import ConfigError
from mcore_reshard.layout import Box, LayoutError, spec_from_hf_config
from mcore_reshard.layout.families.llava import TINY_LLAVA
from mcore_reshard.plan.refit_plans import moves_encoder, plan_refit, without_tensors
from test_bad_input import check_one_line
from test_plan_properties import simulate

REPO = Path(__file__).resolve().parents[1]
LLAVA_7B = json.loads((REPO / "configs" / "models" / "llava-1.5-7b.json").read_text())


def _spec(cfg=TINY_LLAVA, **vision):
    cfg = dict(cfg, vision_config=dict(cfg["vision_config"], **vision)) if vision else cfg
    return spec_from_hf_config(cfg, dtype="float32")


@pytest.mark.heavy  # transformers' model classes
@pytest.mark.parametrize("cfg", [TINY_LLAVA, LLAVA_7B], ids=["tiny", "llava-1.5-7b"])
def test_table_is_the_hub_checkpoint_less_the_layers_llava_never_uses(cfg):
    from mcore_reshard.infra.hf_meta import checkpoint_tensors
    from mcore_reshard.infra.vlm import hub_names, unused_tower

    spec = spec_from_hf_config(cfg)
    table = {n: shape for n, (shape, _) in spec.tensor_table().items()}
    ckpt = hub_names(checkpoint_tensors(cfg))
    used = spec.vision.layers
    assert used == spec.vision.checkpoint_layers - 1  # vision_feature_layer -2
    unused = unused_tower(ckpt, used)
    last = f"vision_tower.vision_model.encoder.layers.{used}."
    assert {n for n in unused if not n.startswith(last)} == {"vision_tower.vision_model.post_layernorm.weight",
                                                             "vision_tower.vision_model.post_layernorm.bias"}
    assert table == {n: s for n, s in ckpt.items() if n not in unused}


def _by_name(params):
    return {p.name: p for p in params}


def test_the_tower_pieces_on_both_sides():
    spec = _spec()
    m = _by_name(megatron_rank_params(spec, MegatronParallel(tp=2), 1))
    (cls,) = m["vision_model.class_token"].pieces
    assert m["vision_model.class_token"].shape == (1, 1, 64)
    assert cls.canonical.endswith("embeddings.class_embedding") and cls.box == Box((0,), (64,))
    # 4 heads of 16: megatron's rank 1 holds heads 2 and 3, each [q_h; k_h; v_h]
    qkv = m["vision_model.decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (96, 64)
    assert [(q.canonical.rsplit(".", 2)[1], q.box.offsets[0], q.view.offset // 64) for q in qkv.pieces] == [
        ("q_proj", 32, 0), ("k_proj", 32, 16), ("v_proj", 32, 32), ("q_proj", 48, 48), ("k_proj", 48, 64),
        ("v_proj", 48, 80)]
    # vLLM's rank 1: [q_r; k_r; v_r], whole heads 2-3 of each
    v = _by_name(vllm_rank_params(spec, VllmParallel(tp=2), 1))
    vq = v["vision_tower.vision_model.encoder.layers.0.self_attn.qkv_proj.weight"]
    assert [(q.canonical.rsplit(".", 2)[1], q.box.offsets[0], q.box.sizes[0]) for q in vq.pieces] == [
        ("q_proj", 32, 32), ("k_proj", 32, 32), ("v_proj", 32, 32)]
    assert v["multi_modal_projector.linear_2.weight"].shape == (64, 32)  # row-parallel
    assert "vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight" in v  # the 2 layers LLaVA uses
    assert "vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight" not in v
    assert not any("post_layernorm" in n for n in v)


LAYOUTS = [
    (MegatronParallel(tp=1), VllmParallel(tp=1)),
    (MegatronParallel(tp=2), VllmParallel(tp=1)),
    (MegatronParallel(tp=2), VllmParallel(tp=2)),
    (MegatronParallel(tp=1, dp=2), VllmParallel(tp=4)),
    (MegatronParallel(tp=2, dp=2, layer_spec="te"), VllmParallel(tp=2, replicas=2)),
]


@pytest.mark.parametrize("mpar, vpar", LAYOUTS, ids=[f"{m.tp}x{m.dp}{m.layer_spec}-{v.tp}x{v.replicas}"
                                                    for m, v in LAYOUTS])
def test_llava_plans_at_the_minimum_bit_for_bit(mpar, vpar):
    src, dst, plan = simulate(_spec(), mpar, vpar)
    assert any(t.canonical.startswith("vision_tower.") for t in plan.transfers)
    assert any(t.canonical.startswith("multi_modal_projector.") for t in plan.transfers)


@pytest.mark.parametrize("projector", [False, True])
def test_a_frozen_tower_is_left_out_of_every_later_plan(projector):
    spec = _spec()
    frozen = spec.frozen_tensors(vision_model=True, vision_projection=projector)
    assert all(n.startswith("vision_tower.") or (projector and n.startswith("multi_modal_projector.")) for n in frozen)
    src, dst = megatron_layout(spec, MegatronParallel(tp=2)), vllm_layout(spec, VllmParallel(tp=2))
    plans = plan_refit(src, dst, spec, spec, bucket_bytes=1 << 16, frozen=frozen)
    later = plans.frozen_plan
    assert later is not None and plans.after_commit(plans.plan) is later and plans.after_commit(later) is later
    frozen_bytes = sum(t.nbytes for t in plans.plan.transfers if t.canonical in frozen)
    assert later.bytes_min == plans.plan.bytes_min - frozen_bytes > 0
    assert not any(t.canonical in frozen for t in later.transfers)
    assert moves_encoder(plans.plan, spec) and moves_encoder(later, spec) is not projector
    assert {q.canonical for q in plans.sides(later)[1].pieces()} & frozen == set()


def test_a_policy_with_a_tower_against_engines_without_one_is_refused():
    spec = _spec()
    src, dst = megatron_layout(spec, MegatronParallel(tp=2)), vllm_layout(spec, VllmParallel(tp=1))
    text_only = without_tensors(dst, spec.tower_tensors())
    with pytest.raises(ConfigError, match=r"LLaVA policy: the engines hold no vision tower .*text-only engine"):
        plan_refit(src, text_only, spec, spec, bucket_bytes=1 << 16)


@pytest.mark.parametrize("cfg, match", [
    (dict(TINY_LLAVA, vision_config=dict(TINY_LLAVA["vision_config"], model_type="siglip_vision_model")),
     "vision_config.model_type='siglip_vision_model'"),
    (dict(TINY_LLAVA, vision_feature_layer=[-2, -1]), "vision_feature_layer=[-2, -1]"),
    (dict(TINY_LLAVA, vision_feature_select_strategy="full"), "vision_feature_select_strategy='full'"),
    (dict(TINY_LLAVA, text_config=dict(TINY_LLAVA["text_config"], model_type="mistral")),
     "text_config.model_type='mistral'"),
])
def test_towers_the_table_does_not_describe_are_one_line(cfg, match):
    with pytest.raises(LayoutError, match=match.replace("[", r"\[").replace("]", r"\]")):
        spec_from_hf_config(cfg)


def test_bad_vlm_settings_are_one_line(capsys, tmp_path):
    # a tower vLLM cannot shard: 4 heads over 8 ranks
    check_one_line(capsys, ["refit", "model=tiny-llava", "vllm.tp=8", "training.ep=1"],
                   "LLaVA self_attn.qkv_proj (vision_config.num_attention_heads=4): vLLM shards")
    # megatron-core's LLaVAModel under pipeline parallelism is not described
    check_one_line(capsys, ["plan", "model=llava-1.5-7b", "training.pp=2", "training.ep=1"],
                   "LLaVA with pipeline_model_parallel_size=2")
    recipe = str(REPO / "recipes" / "grpo-tiny-moe-cpu.yaml")
    check_one_line(capsys, ["grpo", recipe, "--dry-run", "policy.megatron_cfg.freeze_vision_model=true"],
                   "policy.megatron_cfg.freeze_vision_model=true: Qwen3-MoE")
    llava = str(REPO / "recipes" / "grpo-tiny-llava-cpu.yaml")
    check_one_line(capsys, ["grpo", llava, "--dry-run", "policy.model_name=tiny-dense",
                            "policy.megatron_cfg.freeze_vision_model=false"],
                   "env.colour_squares: its prompts carry images")


def test_a_tower_held_whole_is_not_asked_to_divide_by_tp():
    """vLLM's ``mm_encoder_tp_mode="data"`` and Megatron-Bridge's Qwen2.5-VL hold the tower whole:
    a TP that does not divide its heads is refused only where the tower is sharded."""
    from mcore_reshard.layout.families.qwen2_5_vl import TINY_QWEN2_5_VL
    from mcore_reshard.layout.families.qwen3_vl import TINY_QWEN3_VL_MOE

    qwen3 = _spec(TINY_QWEN3_VL_MOE, num_heads=2)  # 2 vision heads, 4 ranks
    with pytest.raises(LayoutError, match=r"Qwen3-VL-MoE attn.qkv \(vision_config.num_heads=2\): vLLM shards the "
                                          r"vision tower over tp=4, which does not divide it; mm_encoder_tp_mode=data"):
        vllm_layout(qwen3, VllmParallel(tp=4))
    with pytest.raises(LayoutError, match=r"attn.qkv \(vision_config.num_heads=2\): megatron-core shards"):
        megatron_layout(qwen3, MegatronParallel(tp=4, ep=1))
    simulate(qwen3, MegatronParallel(tp=2), VllmParallel(tp=4, mm_encoder_tp_mode="data"))
    qwen25 = _spec(TINY_QWEN2_5_VL, num_heads=2)
    simulate(qwen25, MegatronParallel(tp=4), VllmParallel(tp=4, mm_encoder_tp_mode="data"))  # whole on both sides
