"""Qwen3-VL-MoE's and Qwen2.5-VL's vLLM side, verified against vLLM's own model class in this process.

megatron-core builds no Qwen VL model, so the training side is Megatron-Bridge's layout from
the family's table (``layout/families/qwen3_vl.py``: the per-head ``linear_qkv`` reorder, the
mergers, the stacked experts; ``qwen2_5_vl.py``: HF's tower whole on every rank), its local
tensors filled from the checkpoint through the rules' pieces. The plan refits vLLM's
``Qwen3VLMoeForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` built here rank by rank
(``testing.vllm_inproc``: no engine, no kernel), loaded first from another checkpoint; every
parameter, buffer and processed-kernel probe then equals vLLM's own ``load_weights`` of the
checkpoint, bit for bit -- with the tower sharded over TP ("weights") and whole on every rank
("data"). The rules are the destination as they stand: vLLM's loader recorder cannot follow
its transposed expert copies, so a wrong rule shows as a state that differs.
"""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.infra.checkpoint import load_canonical
from mcore_reshard.layout import load_model_spec

pytestmark = pytest.mark.slow  # vLLM's model classes built in this process


CASES = [("qwen3_vl_moe", MegatronParallel(tp=2, ep=2, etp=1, layer_spec="te", experts="grouped"), 1, "weights"),
         ("qwen3_vl_moe", MegatronParallel(tp=2, ep=2, etp=1, layer_spec="te", experts="grouped"), 2, "weights"),
         ("qwen3_vl_moe", MegatronParallel(tp=2, ep=2, etp=1, layer_spec="te", experts="grouped"), 2, "data"),
         ("qwen2_5_vl", MegatronParallel(tp=2), 2, "weights"),
         ("qwen2_5_vl", MegatronParallel(tp=2), 2, "data")]


@pytest.mark.parametrize("family, training, vtp, mode", CASES, ids=[f"{c[0]}-vllm-tp{c[2]}-{c[3]}" for c in CASES])
def test_qwen_vl_refit_equals_vllms_own_load(ckpt_cache, family, training, vtp, mode):
    from mcore_reshard.testing.hybrid import reference_states, refit_inproc
    from mcore_reshard.testing.vllm_inproc import compare_states
    from mcore_reshard.transport.views import materialize_local

    ckpt = ckpt_cache.get(family=family, dtype="float32", seed=0)
    stale = ckpt_cache.get(family=family, dtype="float32", seed=1)
    spec = load_model_spec(ckpt, dtype="float32")
    src = megatron_layout(spec, training)
    canon = load_canonical(ckpt)
    tensors = {r: {p.name: materialize_local(p, canon) for p in src.params if p.rank == r}
               for r in range(src.world_size)}
    engine = {"mm_encoder_tp_mode": mode}
    ref = reference_states(ckpt, "float32", vtp, **engine)
    out = refit_inproc(ckpt, stale, "float32", vtp, src, tensors, record=False, engine=engine)
    assert out["moved"] == out["plan"].bytes_planned == out["plan"].bytes_min
    qkv = "visual.blocks.0.attn.qkv.weight"
    for r in range(vtp):
        before = compare_states(ref[r], out["before"][r])  # the stale load differs, the tower too
        assert "visual.patch_embed.proj.weight" in before and "probe:visual.blocks.0.attn.qkv" in before
        assert "probe:visual.merger." + ("linear_fc1" if family == "qwen3_vl_moe" else "mlp.0") in before
        assert compare_states(ref[r], out["after"][r]) == []
        held = {p.name: p for p in out["params"][r]}
        assert held[qkv].shape[0] == (3 * spec.vision.hidden if mode == "data" else 3 * spec.vision.hidden // vtp)
