"""vLLM's own MTP draft against the draft layout (``adapters/vllm/mtp_rules.py``): a tiny
DeepSeek-V3 with one MTP layer, served on this CPU with ``speculative_config={"method": "mtp"}``
(vLLM's ``EagleProposer`` over ``DeepSeekMTP``), holds exactly the draft parameters the layout
describes -- names, and shapes where the CPU kernels keep model format -- besides the target's
embedding and output head, which it shares (so a refit moves them once)."""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.vllm.mtp_rules import vllm_draft_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.layout import load_model_spec

pytestmark = pytest.mark.heavy


def test_vllm_mtp_draft_holds_what_the_draft_layout_says(ckpt_cache):
    from vllm import SamplingParams

    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine

    ckpt = ckpt_cache.get(family="deepseek_v3", dtype="float32", overrides={"num_nextn_predict_layers": 1})
    spec = load_model_spec(ckpt, dtype="float32")
    assert spec.mtp_layers == 1
    want = {p.name: p.shape for p in vllm_draft_rank_params(spec, VllmParallel(tp=1), 0)}
    llm = start_engine(str(ckpt), tp=1, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    try:
        out = llm.generate([{"prompt_token_ids": [11, 42, 7, 99, 123, 5]}],
                           SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4  # it drafts and verifies
        (got,) = llm.collective_rpc("mr_draft_layout")
        assert got["shares_embed"] and got["shares_head"]
        L = spec.num_layers
        shared = {"model.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight", "lm_head.weight"}
        # MLA's absorbed W_UK_T / W_UV are derived from kv_b_proj after loading (refit: re-absorbed)
        derived = {n for n in got["params"] if n.endswith(("W_UV", "W_UK_T"))}
        assert set(got["params"]) - shared - derived == set(want)
        for name, shape in want.items():
            held = tuple(got["params"][name])
            assert held == tuple(shape) or held == (0,), (name, held, shape)  # (0,): repacked by the CPU kernel
        for name in (f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight",
                     f"model.layers.{L}.mtp_block.mlp.experts.routed_experts.w13_weight"):
            assert tuple(got["params"][name]) == tuple(want[name]), name  # model format: compared exactly
    finally:
        stop_engine(llm)
