"""Qwen3-VL-MoE's vLLM side, verified against vLLM's own model class in this process.

megatron-core builds no Qwen3-VL model, so the training side is Megatron-Bridge's layout from
the family's table (``layout/families/qwen3_vl.py``: the per-head ``linear_qkv`` reorder, the
mergers, the stacked experts), its local tensors filled from the checkpoint through the rules'
pieces. The plan refits vLLM's ``Qwen3VLMoeForConditionalGeneration`` built here rank by rank
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


@pytest.mark.parametrize("vtp, mode", [(1, "weights"), (2, "weights"), (2, "data")])
def test_qwen3_vl_moe_refit_equals_vllms_own_load(ckpt_cache, vtp, mode):
    from mcore_reshard.testing.hybrid import reference_states, refit_inproc
    from mcore_reshard.testing.vllm_inproc import compare_states
    from mcore_reshard.transport.views import materialize_local

    ckpt = ckpt_cache.get(family="qwen3_vl_moe", dtype="float32", seed=0)
    stale = ckpt_cache.get(family="qwen3_vl_moe", dtype="float32", seed=1)
    spec = load_model_spec(ckpt, dtype="float32")
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1, layer_spec="te", experts="grouped"))
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
        assert compare_states(ref[r], out["after"][r]) == []
        held = {p.name: p for p in out["params"][r]}
        assert held[qkv].shape[0] == (3 * spec.vision.hidden if mode == "data" else 3 * spec.vision.hidden // vtp)
