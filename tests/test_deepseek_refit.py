"""A tiny random DeepSeek-V3 (MLA with q_lora, a dense first layer, shared expert, router
bias) trained in megatron-core and refit live into one vLLM CPU engine (CPU_MLA), fp32.

The engine starts on checkpoint A; the trainers load checkpoint B. After the refit the engine
must give exactly the logprobs of a fresh engine that loaded B with vLLM's own loader, for
every trainer layout (one engine reused, as tests/test_refit_layouts.py does), and its
token_mult_prob_error against megatron's forward must be within the fp32 bound 1.001 (the
engine runs CPU_MLA with vLLM's PyTorch rotary embedding: ``start_engine``).
"""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import after_refit, prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.jobs.refit import local_cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
FP32_BOUND = 1.001  # token_mult_prob_error, vLLM vs megatron's forward


@pytest.fixture(scope="module")
def setup(tmp_path_factory, engine_cache):
    """One shared engine (the session's cache; ``test_deepseek_vllm`` takes it next), started
    fresh on B: its logprobs are vLLM's own loader's on B. Then it is given A's weights through
    the applier, and every test refits B's training into it."""
    root = tmp_path_factory.mktemp("deepseek_refit")
    a = make_tiny_checkpoint(root / "a", family="deepseek_v3", seed=3)
    b = make_tiny_checkpoint(root / "b", family="deepseek_v3", seed=4)
    llm = engine_cache.get(b, tp=1, fresh=True)
    want = prompt_logprobs(llm, TOKENS)  # vLLM's own loader on B
    # A diagnostics load that leaves the weights whole must not hide the weight-transfer
    # engine's status: every refit below is checked against the version it commits.
    statuses = llm.collective_rpc("mr_load_canonical", args=(str(a),))
    assert all(s["state"] == "serving" for s in statuses), statuses
    after_refit(llm)
    try:
        yield load_model_spec(b, dtype="float32"), b, llm, want
    finally:
        engine_cache.check(llm)


@pytest.mark.parametrize("training", [MegatronParallel(tp=2, ep=2, etp=1), MegatronParallel(pp=2)],
                         ids=["tp2-ep2", "pp2"])
def test_refit_equals_a_fresh_vllm_load(setup, training):
    spec, ckpt, llm, want = setup
    assert prompt_logprobs(llm, TOKENS) != want  # A at first, then the previous layout's trained weights
    with local_cluster(spec, ckpt, training, VllmParallel(tp=1), CFG, train={"lr": 0.05}, engines=[llm]) as c:
        m = c.refit_once()
        assert m.verified and m.at_minimum
        assert any("full verification" in n for n in m.notes)
        assert prompt_logprobs(llm, TOKENS) == want  # kv_b_proj reloaded and W_UK/W_UV rebuilt
        assert c.logprob_error(TOKENS) < FP32_BOUND
        c.step(TOKENS)  # moves every weight, the router's expert_bias included
        second = c.refit_once()
        assert second.verified and any("full verification" in n for n in second.notes)
        assert prompt_logprobs(llm, TOKENS) != want
        assert c.logprob_error(TOKENS) < FP32_BOUND


def test_plain_q_expert_parallel_into_a_tp2_engine(tmp_path, shared_engine):
    """q_lora off (a plain ``q_proj``, Moonlight's form), megatron EP2 into a vLLM engine of TP2
    (``q_b``-less MLA split by heads, shared experts split, the router replicated): verified by
    checksums and ``verify=full``, at the minimum bytes, within the fp32 bound."""
    from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3

    ckpt = make_tiny_checkpoint(tmp_path / "plain_q", overrides=dict(TINY_DEEPSEEK_V3, q_lora_rank=None),
                                family="deepseek_v3", seed=5)
    spec = load_model_spec(ckpt, dtype="float32")
    assert spec.mla is not None and spec.mla.q_lora_rank is None
    llm = shared_engine(ckpt, tp=2)  # shared with test_deepseek_vllm's plain_q TP2 case
    with local_cluster(spec, ckpt, MegatronParallel(ep=2, etp=1, dp=2), VllmParallel(tp=2), CFG,
                       engines=[llm]) as c:
        m = c.refit_once()
        assert m.verified and m.at_minimum
        assert any("full verification" in n for n in m.notes)
        assert c.logprob_error(TOKENS) < FP32_BOUND


def test_the_canary_runs_on_an_mla_engine_streamed_and_atomic(setup):
    """The canary's forward on an MLA engine (CPU_MLA's own metadata builder), across training
    refits, each within fp32's bound: two streamed (``refit.atomic=false``: the canary reads the
    live weights), then two atomic (it reads the staged trial view, MLA's absorbed weights rebuilt
    there from the staged ``kv_b_proj``), then one with those absorbed weights left stale. The atomic ones failed every
    correct refit (4.2 against 1.001 here) until the trial view kept the live Parameter objects:
    vLLM's DeepSeek router holds the gate's ``e_score_correction_bias`` itself, and read the old
    bias while the gate's entry pointed at the shadow's."""
    from dataclasses import replace as _replace

    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.wire.faults import EngineFault, Faults

    spec, ckpt, llm, _want = setup
    cfg = _replace(CFG, verify=VerifyMode.CHECKSUM, canary=True, atomic=False)
    with local_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1), cfg,
                       train={"lr": 0.05}, engines=[llm]) as c:
        for atomic in (False, False, True, True):
            c.driver.refit_config = _replace(cfg, atomic=atomic)
            c.step(TOKENS)  # moves every weight, the router's expert_bias included
            m = c.refit_once()
            assert m.verified and m.phases["dst_canary"] > 0
            assert c.logprob_error(TOKENS) < FP32_BOUND
        # Decode-only state: MLA's absorbed W_UK/W_UV, which only the decode path reads, left
        # stale. The bytes and every prefill are right; the canary's decode step catches it,
        # and the old weights stay served.
        served = prompt_logprobs(llm, TOKENS)
        c.step(TOKENS)
        with pytest.raises(RefitFailed, match=r"canary \d of 2 .*token_mult_prob_error [0-9.]+ > bound 1\.001"):
            c.driver.refit(faults=Faults(engine=EngineFault(rank=0, skip_absorption=True)))
        assert prompt_logprobs(llm, TOKENS) == served
        m = c.refit_once()  # the same weights, absorbed: passes
        assert m.verified and c.logprob_error(TOKENS) < FP32_BOUND
