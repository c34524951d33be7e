"""End to end on the real stack: megatron-core TP2xEP2 ranks -> vLLM TP2 engine, through the
two endpoints and the driver.

The session's TP2 engine and TP2xEP2 trainer pool of the fp32 tiny MoE (``conftest.py``;
each start costs 15-30 s): the engine serves what the previous test refit, the pool holds
weights earlier tests trained, so every check refits first and compares relative changes.
Order matters: the last test kills a training rank mid-refit and leaves the pool broken (the
cache then stops it) and refits the engine from a new pool of its own.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import greedy, prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import RefitFailed
from mcore_reshard.wire.faults import Faults, TrainerFault
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.jobs.refit import local_cluster
from support.live import assert_idle, refit_pids
from support.live import cluster as shared_cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
LONG = [(7 * i + 3) % 1000 for i in range(240)]  # spans several KV blocks, so prefix caching applies
EXACT = 1.0 + 1e-5  # token_mult_prob_error of two computations of the same fp32 model


@pytest.fixture(scope="module")
def cluster(ckpt_cache, engine_cache):
    ckpt = ckpt_cache.get(moe=True, seed=7)
    spec = load_model_spec(ckpt, dtype="float32")
    llm = engine_cache.get(ckpt, tp=2)
    with shared_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2),
                        RefitConfig(buffer_bytes=1 << 16, timeout_s=30.0), train={"lr": 0.05}, engines=[llm]) as c:
        yield c
    engine_cache.check(llm)


def test_plan_from_live_descriptors_equals_the_rules(cluster):
    """The live descriptors of both running libraries plan to the same bytes as the rules."""
    from mcore_reshard.adapters.megatron.rules import megatron_layout
    from mcore_reshard.adapters.vllm.rules import vllm_layout

    d = cluster.driver
    key = lambda p: (p.rank, p.name)  # noqa: E731
    assert sorted(d.src.params, key=key) == sorted(megatron_layout(cluster.spec, cluster.training).params, key=key)
    assert sorted(d.dst.params, key=key) == sorted(vllm_layout(cluster.spec, cluster.vllm).params, key=key)
    assert d.plan.bytes_planned == d.plan.bytes_min
    assert d.plan.num_buckets > 1  # the small buffer really buckets
    # CPU default mode repacks kernels: those parameters are listed, with a reason, not hidden
    assert d.plan.not_direct and all("layerwise reload" in why for _, why in d.plan.not_direct)


def test_refit_moves_exactly_the_minimum_and_verifies(cluster):
    m = cluster.refit_once()
    assert m.bytes_moved == m.bytes_min == cluster.driver.plan.bytes_min
    assert m.verified
    assert 0 < m.peak_extra_bytes <= cluster.refit.buffer_bytes  # the memory budget holds
    assert {"src_pack", "dst_wire", "dst_apply_open"} <= set(m.phases)  # every rank reported through the vote
    assert cluster.logprob_error(TOKENS) < EXACT


def test_step_changes_weights_and_refit_carries_them(cluster):
    llm = cluster.engines[0]
    cluster.refit_once()  # the plan is built and shipped by now, whatever ran before
    before = prompt_logprobs(llm, TOKENS)
    greedy(llm, [LONG], 4)  # leaves this prompt's KV blocks in the prefix cache
    loss = cluster.step(TOKENS)
    assert loss > 0
    assert cluster.logprob_error(TOKENS) > 1.01  # the engine still serves the old weights
    m = cluster.refit_once()
    assert m.plan_cached and m.plan_digest == cluster.driver.plan.digest()
    assert m.verified
    assert cluster.logprob_error(TOKENS) < EXACT
    assert prompt_logprobs(llm, TOKENS) != before
    # generation after the refit must not reuse KV blocks computed with the old weights
    after = greedy(llm, [LONG], 4)
    llm.reset_prefix_cache()
    assert after == greedy(llm, [LONG], 4)


def test_full_verification_compares_canonical_tensors(cluster):
    cluster.refit = cluster.driver.refit_config = replace(cluster.refit, verify=VerifyMode.FULL)
    try:
        m = cluster.refit_once()
    finally:
        cluster.refit = cluster.driver.refit_config = replace(cluster.refit, verify=VerifyMode.CHECKSUM)
    assert m.verified
    assert any("full verification" in n and "elements equal" in n for n in m.notes)


def test_streaming_mode_refit_also_verifies(cluster):
    """atomic=false: layers are committed as they complete (no staged copy)."""
    cluster.step(TOKENS)
    cluster.driver.refit_config = replace(cluster.refit, atomic=False)
    try:
        m = cluster.refit_once()
    finally:
        cluster.driver.refit_config = cluster.refit
    assert m.verified and cluster.logprob_error(TOKENS) < EXACT


def test_hf_broadcast_baseline_gives_the_same_model(cluster):
    cluster.step(TOKENS)
    m = cluster.refit_once("hf_broadcast")
    assert m.transport == "hf_broadcast"
    # every vLLM rank receives every full tensor, plus the gather on the training side
    model_bytes = cluster.spec.total_bytes()
    assert m.bytes_moved >= cluster.driver.dst.world_size * model_bytes > m.bytes_min
    assert cluster.logprob_error(TOKENS) < EXACT


def test_bit_flipped_in_flight_aborts_every_rank_fast_and_the_old_model_keeps_serving(cluster):
    from mcore_reshard.wire.faults import Fault

    llm = cluster.engines[0]
    cluster.refit_once()
    cluster.step(TOKENS)
    old = prompt_logprobs(llm, TOKENS)
    t0 = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        cluster.driver.refit(faults=Faults(TrainerFault(0, Fault("bitflip", bucket=1))))
    assert time.monotonic() - t0 < 10  # an abort signal, not the 30 s timeout
    msg = str(err.value)
    assert "checksum mismatch" in msg and "model." in msg and "vLLM destination rank" in msg  # who, and which parameter
    for st in cluster.driver.status():  # atomic: every worker voted abort
        assert st.state == "serving" and st.committed is False, st
    assert prompt_logprobs(llm, TOKENS) == old  # generate serves exactly the old model
    m = cluster.refit_once()  # the next refit rejoins and restores service with the new weights
    assert m.verified and cluster.logprob_error(TOKENS) < EXACT


def test_failed_streaming_refit_refuses_generation_until_a_refit_succeeds(cluster):
    """atomic=false commits layers as they complete, so a refit that fails at the end has
    already replaced part of the model: generate must refuse, not serve that mix."""
    from mcore_reshard.errors import RefitIncomplete
    from mcore_reshard.wire.faults import Fault

    llm = cluster.engines[0]
    cluster.refit_once()
    cluster.step(TOKENS)
    streaming = replace(cluster.refit, atomic=False)
    cluster.driver.refit_config = streaming
    try:
        with pytest.raises(RefitFailed, match="checksum mismatch"):
            cluster.driver.refit(faults=Faults(TrainerFault(0, Fault("bitflip", bucket=2))))
        assert any(st.state == "not_serving" for st in cluster.driver.status())
        with pytest.raises(RefitIncomplete, match="not serving"):
            prompt_logprobs(llm, TOKENS)
        with pytest.raises(RefitIncomplete):
            greedy(llm, [TOKENS], 4)
        m = cluster.driver.refit()  # a refit that succeeds restores service
    finally:
        cluster.driver.refit_config = cluster.refit
    assert m.verified and cluster.logprob_error(TOKENS) < EXACT


def test_trainer_dying_mid_refit_aborts_every_rank_and_the_engine_keeps_the_old_model(cluster):
    llm = cluster.engines[0]
    cluster.refit_once()
    cluster.step(TOKENS)  # new weights on the trainers, old ones in the engine
    old = prompt_logprobs(llm, TOKENS)
    t0 = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        cluster.driver.refit(faults=Faults(TrainerFault(1, die_after_reads=5)))
    assert time.monotonic() - t0 < 10  # the peer that saw the connection close aborted every rank
    assert "training rank 1 died" in str(err.value)
    # nothing the failed refit touched is left running: no receive it posted and dropped keeps
    # a worker's or a trainer's event loop awake (the refit group is torn down on every rank)
    assert_idle(refit_pids(cluster.engines, cluster.pool))
    # atomic (the default): every worker voted abort, none committed -> generation serves the
    # old model exactly, not a half-written one
    for st in cluster.driver.status():
        assert st.state == "serving" and st.committed is False, st
    assert prompt_logprobs(llm, TOKENS) == old
    assert greedy(llm, [TOKENS], 4) == greedy(llm, [TOKENS], 4)
    # a new trainer pool (a restarted job) refits the same engine and restores service
    with local_cluster(cluster.spec, cluster.checkpoint, cluster.training, cluster.vllm, cluster.refit,
                       engines=cluster.engines) as again:
        m = again.refit_once()
        assert m.verified and again.logprob_error(TOKENS) < EXACT
