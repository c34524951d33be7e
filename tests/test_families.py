"""A model family is one table (``layout/family.py``, ``layout/families/``): what the tables say,
checked against transformers, and what they make both libraries' rules do. No process starts.

- Every table's canonical tensors (names, and the checkpoint's shapes) equal those of
  transformers' own model class built on the meta device and reverted to checkpoint names, for
  every family's tiny config and every full-size config under ``configs/models/``.
- gpt-oss and GLM-4.5 pieces pinned on both sides (the interleaved gate/up, the sinks, the
  rank-0-only expert bias, the fp32 router), and their plans at the minimum, executed
  in-process bit for bit over TP 1/2/4, EP, ETP, PP (uneven) on both sides.
- Bad input: an unknown family, a layout megatron-core cannot hold, a RoPE the CPU build does not
  build -- one line each, before anything starts.
- (``heavy``) the full-size recipes' dry runs for gpt-oss-120b and GLM-4.5: at the minimum
  bytes, the per-node floor met, a modelled time (their ``mcore-reshard plan`` commands in
  ``docs/families.md`` are planned by ``test_plan_readme_commands``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout, vllm_rank_params
from mcore_reshard.infra.checkpoint import TINY_FAMILIES, tiny_config
from mcore_reshard.layout import Box, LayoutError, spec_from_hf_config
from mcore_reshard.layout.families import FAMILIES
from mcore_reshard.settings import TINY_MODELS
from test_bad_input import check_one_line
from test_plan_properties import simulate

REPO = Path(__file__).resolve().parents[1]
FULL = sorted((REPO / "configs" / "models").glob("*.json"))


def _spec(family, dtype="float32", **overrides):
    return spec_from_hf_config(dict(tiny_config(family), **overrides), dtype=dtype)


# --------------------------------------------------------------------------- the tables vs transformers


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES) + [p.stem for p in FULL])
def test_table_equals_transformers_meta_model(name):
    """Names and checkpoint shapes of every canonical tensor, from the table alone, equal what
    transformers builds on the meta device and would save (its load-time conversions reverted)."""
    from mcore_reshard.infra.hf_meta import checkpoint_tensors

    path = REPO / "configs" / "models" / f"{name}.json"
    cfg = json.loads(path.read_text()) if path.is_file() else tiny_config(name)
    spec = spec_from_hf_config(cfg)
    shapes = spec.checkpoint_shapes()
    table = {n: shapes.get(n, shape) for n, (shape, _) in spec.tensor_table().items()}
    ckpt = checkpoint_tensors(cfg)
    if spec.vision is not None:  # the hub's names, less the tower layers LLaVA never uses (test_vlm_layouts)
        from mcore_reshard.infra.vlm import hub_names, unused_tower

        ckpt = hub_names(ckpt)
        ckpt = {n: s for n, s in ckpt.items() if n not in unused_tower(ckpt, spec.vision.layers)}
    if spec.arch == "qwen3_vl_moe":
        # The hub stacks the experts as (E, H, 2FE) / (E, FE, H) -- what vLLM's loader takes
        # (``is_fused_checkpoint_transposed``) -- and transformers 5 transposes them on load
        # (its conversion mapping: ``Transpose(1, 2)``), which ``revert_weight_conversion``
        # does not undo: the hub's shapes are the table's.
        ckpt = {n: ((s[0], s[2], s[1]) if ".mlp.experts." in n else s) for n, s in ckpt.items()}
    assert table == ckpt


def test_every_family_has_a_tiny_model_and_a_reader():
    assert TINY_MODELS["tiny-gpt-oss"] == "gpt_oss" and TINY_MODELS["tiny-glm4-moe"] == "glm4_moe"
    for name, fam in FAMILIES.items():
        assert spec_from_hf_config(fam.tiny).arch == name
        assert fam.tiny["architectures"][0] in fam.architectures


# --------------------------------------------------------------------------- gpt-oss


def _params(params):
    return {p.name: p for p in params}


def test_gpt_oss_interleaved_gate_up_both_sides():
    """The checkpoint's ``gate_up_proj`` (E, H, 2F) interleaves gate and up; the plan addresses
    it as (E, H, F, 2). megatron's expert holds ``[gate_r; up_r]`` de-interleaved and transposed,
    vLLM's ``w13`` a TP chunk of F with gate and up still interleaved -- each one box."""
    spec = _spec("gpt_oss")
    E, H, F = 8, 64, 64
    assert spec.tensor_table()["model.layers.0.mlp.experts.gate_up_proj"] == ((E, H, F, 2), "float32")
    assert spec.checkpoint_shapes()["model.layers.0.mlp.experts.gate_up_proj"] == (E, H, 2 * F)
    m = _params(megatron_rank_params(spec, MegatronParallel(tp=2, ep=2, etp=1), 1))
    fc1 = m["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # expert 4 + 1
    (piece,) = fc1.pieces
    assert fc1.shape == (2 * F, H) and piece.box == Box((5, 0, 0, 0), (1, H, F, 2))
    assert piece.view.stride[1:] == (1, H, F * H)  # h across columns, f down the rows, gate then up
    bias = m["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.bias"]
    assert bias.shape == (2 * F,) and bias.pieces[0].view.stride[1:] == (1, F)
    fc2 = m["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert fc2.shape == (H, F) and fc2.pieces[0].box == Box((5, 0, 0), (1, F, H))
    v = _params(vllm_rank_params(spec, VllmParallel(tp=2), 1))
    w13 = v["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    (piece,) = w13.pieces  # all 8 experts, rank 1's half of F, gate and up interleaved
    assert w13.shape == (E, F, H) and piece.box == Box((0, 0, F // 2, 0), (E, H, F // 2, 2))
    assert piece.view.stride == (F * H, 1, 2 * H, H)
    assert not v["model.layers.0.mlp.experts.routed_experts.w2_bias"].pieces  # zeros off MoE-TP rank 0
    assert _params(vllm_rank_params(spec, VllmParallel(tp=2), 0))[
        "model.layers.0.mlp.experts.routed_experts.w2_bias"].pieces[0].box == Box((0, 0), (E, H))
    sinks = v["model.layers.0.attn.sinks"]
    assert sinks.shape == (2,) and sinks.pieces[0].box == Box((2,), (2,))
    msinks = m["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert msinks.pieces[0].box == Box((2,), (2,))
    assert "model.embedding.weight" in _params(vllm_rank_params(spec, VllmParallel(), 0))


def test_glm_router_in_fp32_and_dense_first_layer():
    spec = _spec("glm4_moe", dtype="bfloat16")
    table = spec.tensor_table()
    assert table["model.layers.1.mlp.gate.weight"][1] == table["model.layers.1.mlp.gate.e_score_correction_bias"][1] \
        == "float32"
    assert "model.layers.0.mlp.gate_proj.weight" in table and "model.layers.0.mlp.gate.weight" not in table
    assert spec.mtp_layers == 0 and spec.moe_layers == (1, 2, 3) and spec.qk_norm and spec.qkv_bias
    m = _params(megatron_rank_params(spec, MegatronParallel(tp=2, etp=2), 0))
    assert m["decoder.layers.1.mlp.router.weight"].dtype == "float32"  # described wide, widened when sent
    shared = m["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert [p.canonical.rsplit(".", 2)[-2] for p in shared.pieces] == ["gate_proj", "up_proj"]
    v = _params(vllm_rank_params(spec, VllmParallel(tp=2), 1))
    assert v["model.layers.1.mlp.gate.weight"].dtype == "float32"
    assert vllm_layout(spec, VllmParallel(tp=2)).tensors["model.layers.1.mlp.gate.weight"][1] == "float32"


def test_a_fused_tensor_of_parts_both_sides(monkeypatch):
    """The form's fused tensors, as a hybrid family's Mamba ``in_proj`` is one: one HF tensor
    ``[z | x | B | C | dt]``, rows naming one local tensor with ``part=``. megatron chunks every
    part over TP (``[z_r | x_r | B_r | C_r | dt_r]``); vLLM too, and replicates the groups of B
    and C over ``tp // groups`` ranks when there are fewer groups than ranks (``units``). A toy
    family on Qwen3's tiny sizes; planned and executed bit for bit."""
    import dataclasses

    from mcore_reshard.layout.families import common
    from mcore_reshard.layout.family import Block, Col, Family, Row, standard_dims

    parts = (("z", 0, 64, None), ("x", 64, 64, None), ("B", 128, 16, 2), ("C", 144, 16, 2), ("dt", 160, 4, None))
    rows = tuple(Row("mixer.in_proj.weight", (164, "H"), part=(off, n), megatron=Col("mixer.in_proj.weight"),
                     vllm=Col("mixer.in_proj.weight", units=units)) for _, off, n, units in parts)
    toy = Family(name="toy_fused", title="toy", architectures=("ToyForCausalLM",), model_types=("toy_fused",),
                 read=lambda cfg: {}, blocks={"mixer": Block(rows)}, layers=lambda spec, i: ("mixer",),
                 pre=common.embedding(), post=common.final(), dims=standard_dims)
    monkeypatch.setitem(FAMILIES, "toy_fused", toy)
    spec = dataclasses.replace(_spec("qwen3"), arch="toy_fused")
    assert [n for n in spec.tensor_table() if "layers.0." in n] == ["model.layers.0.mixer.in_proj.weight"]
    m = _params(megatron_rank_params(spec, MegatronParallel(tp=2), 1))["decoder.layers.0.mixer.in_proj.weight"]
    assert m.shape == (82, 64)
    assert [(p.box.offsets[0], p.box.sizes[0], p.view.offset // 64) for p in m.pieces] == [
        (32, 32, 0), (96, 32, 32), (136, 8, 64), (152, 8, 72), (162, 2, 80)]
    v = _params(vllm_rank_params(spec, VllmParallel(tp=4), 3))["model.layers.0.mixer.in_proj.weight"]
    assert [(p.box.offsets[0], p.box.sizes[0]) for p in v.pieces] == [(48, 16), (112, 16), (136, 8), (152, 8), (163, 1)]
    simulate(spec, MegatronParallel(tp=2), VllmParallel(tp=4))


# --------------------------------------------------------------------------- plans, both sides


LAYOUTS = [
    (MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1)),
    (MegatronParallel(tp=1, ep=4, dp=4, layer_spec="te", experts="grouped"), VllmParallel(tp=4)),
    (MegatronParallel(tp=4, pp=2, ep=2, etp=1), VllmParallel(tp=2, pp=2)),
    (MegatronParallel(tp=2, pp=2, first_stage_layers=1), VllmParallel(tp=2, dp=2, enable_ep=True)),
    (MegatronParallel(tp=2, etp=2), VllmParallel(tp=4, replicas=2)),
]


@pytest.mark.parametrize("family", ["gpt_oss", "glm4_moe"])
@pytest.mark.parametrize("mpar, vpar", LAYOUTS, ids=[f"{m.tp}.{m.pp}.{m.ep}.{m.etp_size}-{v.tp}.{v.pp}.{v.dp}"
                                                       for m, v in LAYOUTS])
def test_new_families_plan_at_the_minimum_bit_for_bit(family, mpar, vpar):
    """Random canonical tensors through megatron's pieces, the plan run in-process, every vLLM
    local equal to the one built from its own pieces; bytes == the minimum. (gpt-oss with
    expert-TP 2 is megatron's refusal, checked below.)"""
    spec = _spec(family)
    if family == "gpt_oss" and mpar.etp_size > 1:
        with pytest.raises(LayoutError, match="gate_up_proj_bias.*expert_tensor_parallel_size=1"):
            simulate(spec, mpar, vpar)
        return
    simulate(spec, mpar, vpar)


# --------------------------------------------------------------------------- bad input


def test_an_unknown_family_is_one_line(tmp_path, capsys):
    cfg = dict(tiny_config("qwen3"), architectures=["MambaLMHeadModel"], model_type="mamba")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LayoutError, match=r"unsupported model family \['MambaLMHeadModel'\].*docs/families.md"):
        spec_from_hf_config(cfg)
    check_one_line(capsys, ["plan", f"model={tmp_path}"], "unsupported model family ['MambaLMHeadModel']")


def test_layouts_megatron_cannot_hold_are_one_line(tmp_path, capsys, monkeypatch):
    # expert biases need expert-TP 1 in megatron-core 0.19.2
    check_one_line(capsys, ["plan", "model=gpt-oss-120b", "training.ep=4", "training.etp=2"],
                   "mlp.experts.gate_up_proj_bias (routed-expert bias)")
    check_one_line(capsys, ["refit", "model=tiny-gpt-oss", "training.ep=1", "training.etp=2"],
                   "expert_tensor_parallel_size=1")
    # LoRA adapters are described for the GQA families without biases on their experts: refused
    # before the full-size plan is made
    from mcore_reshard.settings import config

    def planned(*args, **kwargs):
        raise AssertionError("the full-size plan was made before the refusal")

    monkeypatch.setattr(config, "plan_for_placement", planned)
    check_one_line(capsys, ["plan", "model=gpt-oss-120b", "training.tp=2", "training.pp=4", "training.ep=8",
                            "training.dp=8", "training.experts=sequential", "vllm.tp=4", "vllm.replicas=4",
                            "peft.enabled=true"], "peft: LoRA on gpt-oss (gpt_oss) is not described yet")
    # a RoPE the CPU build does not build: refused before any rank starts
    from mcore_reshard.infra.checkpoint import make_tiny_checkpoint

    cfg = tiny_config("gpt_oss")
    ckpt = make_tiny_checkpoint(tmp_path / "yarn", overrides=dict(cfg, rope_parameters=dict(
        cfg["rope_parameters"], factor=32.0)), family="gpt_oss")
    capsys.readouterr()  # the checkpoint writer's progress bar
    check_one_line(capsys, ["refit", f"model={ckpt}", "training.ep=1"], "rope factor 32.0 (YaRN)")


# --------------------------------------------------------------------------- full size (heavy)


def _plan_json(capsys, argv):
    from mcore_reshard.cli import main

    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", ["grpo-gpt-oss-120b-8n8g-megatron-reshard.yaml",
                                    pytest.param("grpo-glm-4.5-32n8g-megatron-reshard.yaml",
                                                 marks=pytest.mark.plans("glm-4.5-32n8g"))])
def test_full_size_recipe_dry_runs(recipe, capsys):
    out = _plan_json(capsys, ["grpo", str(REPO / "recipes" / recipe), "--dry-run", "--json"])
    assert out["bytes_planned"] == out["bytes_min"] < out["bytes_hf_broadcast"]
    assert out["bytes_inter_node"] == out["bytes_inter_node_min"]
    assert out["modelled_refit_seconds"] > 0
