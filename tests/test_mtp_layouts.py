"""DeepSeek-V3's MTP draft as layouts: megatron-core's MTP block and vLLM's ``DeepSeekMTP``
describe the same canonical tensors (``model.layers.{L}.*``), planned with the target as one
refit at the per-rank minimum and run in-process bit for bit; the shared embedding and output
head move once (as the target's). Torch on tiny tensors only."""

from __future__ import annotations

import pytest
import torch

from mcore_reshard.adapters.megatron.mtp_rules import megatron_mtp_rank_params
from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.mtp_rules import vllm_draft_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3
from mcore_reshard.layout import LayoutError
from mcore_reshard.layout.mtp import draft_tensors, with_draft
from mcore_reshard.layout.spec import spec_from_hf_config
from mcore_reshard.plan import build_plan
from mcore_reshard.testing.local_plan import run_plan_locally
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local


def _spec(dtype: str):
    return spec_from_hf_config(dict(TINY_DEEPSEEK_V3, num_nextn_predict_layers=1), dtype=dtype)


def _sides(spec, mpar: MegatronParallel, vpar: VllmParallel):
    src = with_draft(megatron_layout(spec, mpar), [p for r in range(mpar.world_size)
                                                   for p in megatron_mtp_rank_params(spec, mpar, r)], spec)
    dst = with_draft(vllm_layout(spec, vpar), [p for r in range(vpar.world_size)
                                               for p in vllm_draft_rank_params(spec, vpar, r)], spec)
    return src, dst


@pytest.mark.parametrize("dtype,mpar,vpar", [
    ("float32", MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2)),
    ("bfloat16", MegatronParallel(tp=1, pp=2, ep=2, etp=1, dp=2), VllmParallel(tp=2)),
    ("bfloat16", MegatronParallel(tp=2, ep=1, etp=1), VllmParallel(tp=1, replicas=2)),
])
def test_target_and_draft_move_as_one_refit_bit_for_bit(dtype, mpar, vpar):
    spec = _spec(dtype)
    src, dst = _sides(spec, mpar, vpar)
    plan = build_plan(src, dst, bucket_bytes=1 << 14)
    g = torch.Generator().manual_seed(5)
    canon = {n: torch.randn(s, generator=g).to(TORCH_DTYPES[d]) for n, (s, d) in src.tensors.items()}
    s = {r: {p.name: materialize_local(p, canon) for p in src.for_rank(r)} for r in range(src.world_size)}
    d = {r: {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in dst.for_rank(r)}
         for r in range(dst.world_size)}
    assert run_plan_locally(plan, s, d) == plan.bytes_min == plan.bytes_planned
    for p in dst.params:
        assert torch.equal(d[p.rank][p.name], materialize_local(p, canon)), (p.rank, p.name)
    draft = draft_tensors(spec)
    L = spec.num_layers
    assert f"model.layers.{L}.eh_proj.weight" in draft and f"model.layers.{L}.mlp.experts.0.gate_proj.weight" in draft
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in draft)  # the target's, sent once
    sent = {t.canonical for t in plan.transfers}
    assert set(draft) <= sent and "model.embed_tokens.weight" in sent and "lm_head.weight" in sent
    # every vLLM worker holds the whole draft (replicated norms and eh_proj, its shards of mtp_block)
    for r in range(dst.world_size):
        names = {p.name for p in dst.for_rank(r)}
        assert {f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.mtp_block.mlp.experts.routed_experts.w13_weight",
                f"model.layers.{L}.mtp_block.self_attn.kv_b_proj.weight"} <= names


def test_draft_layouts_refuse_what_they_do_not_describe():
    with pytest.raises(LayoutError, match="has no MTP layers"):
        megatron_mtp_rank_params(spec_from_hf_config(TINY_DEEPSEEK_V3), MegatronParallel(), 0)
    with pytest.raises(LayoutError, match=r"vllm.pp=2: an MTP draft beside a pipelined target"):
        vllm_draft_rank_params(_spec("bfloat16"), VllmParallel(pp=2), 0)


def test_plan_reports_the_drafts_bytes_on_a_line_of_their_own():
    from mcore_reshard.settings.config import plan_recipe
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.settings.schema import RecipeLayout, SpeculativeConfig

    spec = _spec("bfloat16")
    recipe = RecipeLayout(spec, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2), RefitConfig(),
                          speculative=SpeculativeConfig("mtp", 1))
    planned = plan_recipe(recipe)
    j = planned.to_json()["draft"]
    assert j["method"] == "mtp" and j["tensors"] == len(draft_tensors(spec))
    assert 0 < j["bytes_min"] < planned.report.bytes_min and planned.report.bytes_planned == planned.report.bytes_min
    assert "mtp draft (speculative_config.method=mtp, 1 token(s))" in planned.table()
    plain = plan_recipe(RecipeLayout(spec, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2), RefitConfig()))
    assert "draft" not in plain.to_json() and plain.report.bytes_min + j["bytes_min"] == planned.report.bytes_min
    with pytest.raises(Exception, match=r"vllm.speculative_config.method='eagle'"):
        SpeculativeConfig("eagle")
