"""A live block-FP8 vLLM engine (``quantization="fp8_per_block"``) refit with codes and scales.

The worker describes itself in FP8 (codes + fp32 ``weight_scale_inv`` scales, as the rules
lay the engine out), takes codes and scales into a shadow of each FP8 layer and runs the
kernel's packing alone (``adapters/vllm/fp8.py``). Checked against vLLM's own load of the same
checkpoint: every tensor the engine computes with (packed codes, scales, buffers) bit for bit,
and its prompt logprobs exactly. vLLM's CPU FP8 kernels need AMX tiles: without them no FP8
engine starts, and these tests are skipped (the plans and the senders' quantization are
checked everywhere, ``test_fp8.py``).
"""

from __future__ import annotations

import pytest

from mcore_reshard.layout.quant import FP8, BlockFp8
from mcore_reshard.settings.limits import cpu_has_amx

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cpu_has_amx(), reason="vLLM's CPU FP8 kernels need AMX tiles, which this CPU lacks")]

#: The engine arguments of a block-FP8 engine with the router kept in bf16 (vLLM's CPU kernel
#: refuses a quantized one).
FP8_ENGINE = BlockFp8().engine_config()
PROMPT = [1, 5, 9, 200, 17, 3, 4, 700, 12]
#: ``token_mult_prob_error`` of an FP8 engine against the bf16 policy it was refit from: what
#: the quantization alone costs (1.00-1.11 over a 40-refit soak of this model; docs/fp8.md).
FP8_POLICY_BOUND = 1.25


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    pytest.importorskip("vllm")


def test_codes_and_scales_go_live_as_vllm_quantizes_its_own_load(ckpt_cache, shared_engine):
    """A TP2 FP8 engine of the tiny MoE with 128-wide heads: loaded by vLLM from checkpoint B
    (the reference), refit to A streamed, an atomic refit to B aborted after its last layer was
    processed (A still served: codes, scales and the MoE kernel's own scales), then refit to B
    atomically: bit for bit what vLLM's load of B holds, and the same logprobs."""
    from mcore_reshard.adapters.vllm import VllmParallel
    from mcore_reshard.adapters.vllm.engine import after_refit, describe, prompt_logprobs
    from mcore_reshard.adapters.vllm.rules import vllm_layout
    from mcore_reshard.layout.spec import load_model_spec

    a = ckpt_cache.get(family="qwen3_moe_128", dtype="bfloat16", seed=0)
    b = ckpt_cache.get(family="qwen3_moe_128", dtype="bfloat16", seed=1)
    llm = shared_engine(b, tp=2, dtype="bfloat16", engine_args=FP8_ENGINE, fresh=True)
    want, want_lp = llm.collective_rpc("mr_served_checksums"), prompt_logprobs(llm, PROMPT)

    # The worker's own description is the rules' FP8 layout, piece for piece.
    params = describe(llm)
    rules = vllm_layout(load_model_spec(b, dtype="bfloat16"), VllmParallel(tp=2, quantization="fp8_per_block"))
    for rank, mine in enumerate(params):
        assert {(p.name, p.dtype, tuple(p.shape), p.pieces) for p in mine} == \
            {(p.name, p.dtype, tuple(p.shape), p.pieces) for p in rules.for_rank(rank)}
    codes = [p for p in params[0] if p.dtype == FP8]
    assert any(p.name.endswith("qkv_proj.weight") for p in codes) and any(p.name.endswith("w13_weight") for p in codes)
    assert {p.name + "_scale_inv" for p in codes} <= {p.name for p in params[0]}

    def load(path, **kw):
        statuses = llm.collective_rpc("mr_load_canonical", args=(str(path),), kwargs=kw)
        assert all(s["state"] == "serving" for s in statuses), statuses
        after_refit(llm)
        return statuses

    load(a)
    served_a, lp_a = llm.collective_rpc("mr_served_checksums"), prompt_logprobs(llm, PROMPT)
    assert served_a != want and lp_a != want_lp
    # Every write but the last (of the worker with fewest): layers processed in their shadows, none committed.
    writes = min(sum(len(p.pieces) for p in mine) for mine in params)
    load(b, atomic=True, stop_after=writes - 1)
    assert llm.collective_rpc("mr_served_checksums") == served_a and prompt_logprobs(llm, PROMPT) == lp_a
    load(b, atomic=True)
    assert llm.collective_rpc("mr_served_checksums") == want
    assert prompt_logprobs(llm, PROMPT) == want_lp


def test_a_bf16_policy_refits_the_fp8_engine_through_vllms_trainer_api(ckpt_cache, shared_engine, tmp_path):
    """Megatron TP2 x EP2 (bf16, distributed optimizer) into the TP2 FP8 engine through vLLM's
    trainer-side API only (``engine_quantization="fp8_per_block"``): the senders quantize the
    blocks they own, the first ``send_weights`` moves the FP8 minimum, the second (after a
    training step) a delta of what changed; every rank of both sides verifies each refit, the
    canary votes on the FP8 forward against the policy as sent (its FP8 round trip), and the
    engine then holds bit for bit what vLLM's own load of the trained weights holds."""
    from test_trainer_api import _drive, _moved

    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs, start_engine, stop_engine
    from mcore_reshard.refit.verify import token_mult_prob_error

    ckpt = ckpt_cache.get(family="qwen3_moe_128", dtype="bfloat16", seed=3)
    llm = shared_engine(ckpt, tp=2, dtype="bfloat16", engine_args=FP8_ENGINE)
    saved = tmp_path / "trained"
    info = {"engine_tp": 2, "engine_dtype": "bfloat16", "engine_quantization": "fp8_per_block", "timeout_s": 60.0,
            "delta": "auto", "bucket_bytes": 1 << 16, "canary": True}
    ranks, served = _drive(llm, 2, (str(ckpt), "bfloat16", MegatronParallel(tp=2, ep=2, etp=1), info,
                                    [PROMPT], 2, {"lr": 1e-3, "save": str(saved)}),
                           lambda step: (prompt_logprobs(llm, PROMPT), llm.collective_rpc("mr_served_checksums")))
    rank0 = ranks[0]
    (full_bytes, full, ok0, delta0), (delta_bytes, full1, ok1, delta1) = map(_moved, rank0["reports"])
    assert ok0 and ok1 and full == full1 == full_bytes == rank0["bytes_min"]
    assert not delta0 and delta1 and 0 < delta_bytes < rank0["bytes_min"]
    assert all(r[6] for rs in rank0["reports"] for r in rs if r[0] == "dst")  # every engine rank ran the canary
    assert served[1][0] != served[0][0]  # the step reached the engine
    assert token_mult_prob_error(served[1][0], rank0["trainer"][1]) < FP8_POLICY_BOUND
    fresh = start_engine(str(saved), tp=2, dtype="bfloat16", **FP8_ENGINE)
    try:
        assert fresh.collective_rpc("mr_served_checksums") == served[1][1]
        assert prompt_logprobs(fresh, PROMPT) == served[1][0]
    finally:
        stop_engine(fresh)


def test_the_refit_driver_plans_an_fp8_engine_from_its_own_description(ckpt_cache, shared_engine):
    """The driver (what ``mcore-reshard refit`` and the recipes run) on the same engine: it
    plans from what the workers describe (codes and scales), the report names each FP8 layer's
    path, and each refit -- full, then a delta after a step -- is verified at the minimum, the
    canary voting on the FP8 forward against the bf16 policy."""
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm import VllmParallel
    from mcore_reshard.adapters.vllm.fp8 import FP8_NOTE
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout.spec import load_model_spec
    from mcore_reshard.plan import plan_report
    from mcore_reshard.settings.schema import RefitConfig

    ckpt = ckpt_cache.get(family="qwen3_moe_128", dtype="bfloat16", seed=3)
    llm = shared_engine(ckpt, tp=2, dtype="bfloat16", engine_args=FP8_ENGINE)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    cfg = RefitConfig(timeout_s=60.0, canary=True)
    with local_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2, quantization="fp8_per_block"),
                       cfg, train={"lr": 1e-3}, engines=[llm]) as c:
        first = c.refit_once()
        plan = c.driver.plan
        assert plan.quantized and plan.quantized_at_receiver == () and plan.bytes_planned == plan.bytes_min
        notes = dict(plan.not_direct)
        assert all(notes[n] == FP8_NOTE for n in notes if n.endswith(("qkv_proj.weight", "w13_weight_scale_inv")))
        assert FP8_NOTE in plan_report(plan).table()
        assert first.verified and first.at_minimum and not first.delta
        # Against the bf16 policy FP8 costs up to 1.11 on these random weights; the canary, inside
        # the refit, held the engine to FP8's bound against the policy as sent (its FP8 round trip).
        assert c.logprob_error(PROMPT) < FP8_POLICY_BOUND
        c.step(PROMPT)
        second = c.refit_once()
        assert second.verified and second.at_minimum and second.delta and 0 < second.bytes_moved < first.bytes_moved
        assert c.logprob_error(PROMPT) < FP8_POLICY_BOUND
