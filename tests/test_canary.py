"""The canary vote (``refit.canary``): every engine runs fixed token sequences on the new weights
before they serve, and a refit whose engine computes something other than the policy fails
like any failed refit -- old weights served (atomic), or the engine gated (streaming, and an
overlapped refit's swap) -- even when every checksum passed.

One tiny dense fp32 model with tied embeddings (vLLM keeps a packed copy of the LM head on
CPU: derived state a refit must rebuild), megatron TP2 -> a vLLM TP2 engine in the default
(repacked-kernel) mode. Each injected fault runs in its own refit: a layout with two heads
swapped on both sides, post-load processing skipped for one layer, a tied head left stale.
A correct refit never fails it, in fp32 and in bf16 (``scripts/bench_canary.py --soak 100`` runs 100 of each).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import greedy, prompt_logprobs, sample, start_engine, stop_engine
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import ConfigError, RefitFailed
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.wire.canary import TOKEN_MULT_PROB_BOUND, canary_sequences, make_canary
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.testing.clients import Enqueued
from mcore_reshard.testing.wrong_layouts import swap_canonical_rows
from mcore_reshard.wire.faults import EngineFault, Faults
from mcore_reshard.wire.protocol import Canary, RefitRequest, token_mult_prob_error
from support.live import engine_healthy, enqueued_logprobs, trained_checkpoint

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3]
TIED = {"tie_word_embeddings": True}
EXACT = 1.0 + 1e-5


# ------------------------------------------------------------------- settings and messages


def test_canary_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match=r"refit.canary_bound=0.5 must be 0"):
        RefitConfig(canary_bound=0.5)
    with pytest.raises(ConfigError, match=r"refit.canary_tokens=1 must be an integer >= 2"):
        RefitConfig(canary_tokens=1)
    with pytest.raises(ConfigError, match=r"refit.canary=true needs refit.transport=reshard"):
        RefitConfig(canary=True, transport="hf_broadcast")
    with pytest.raises(ConfigError, match=r"reference logprobs do not match"):
        Canary(((1, 2, 3),), ((0.0,),), 1.001)


def test_the_canary_travels_in_the_request_and_is_fixed():
    seqs = canary_sequences(1000, 2, 8)
    assert seqs == canary_sequences(1000, 2, 8)  # the same sequences every refit, every job
    assert all(0 <= t < 1000 for s in seqs for t in s) and len(seqs) == 2 and len(seqs[0]) == 8
    c = Canary(seqs, tuple(tuple(-1.0 for _ in s[1:]) for s in seqs), 1.05, "bfloat16")
    r = RefitRequest("abc", canary=c)
    assert RefitRequest.from_wire(r.to_wire()) == r
    assert c.scored() == tuple(s[1:] for s in seqs)  # no targets: each sequence's own next tokens
    likely = replace(c, targets=tuple(tuple(7 for _ in s[1:]) for s in seqs))
    r = RefitRequest("abc", canary=likely)
    assert RefitRequest.from_wire(r.to_wire()) == r and r.canary.scored()[0] == (7,) * 7
    with pytest.raises(ConfigError, match=r"targets do not match the sequences"):
        replace(c, targets=((1, 2),))
    assert "canary" not in RefitRequest("abc").to_wire()  # off: the request is as before


def test_a_deferred_canary_travels_without_its_reference_and_is_completed_once():
    """The driver's canary is deferred: the request carries the sequences and the bound; the
    trainers' targets and reference complete it inside the refit (``meet_canary``)."""
    deferred = make_canary(1000, "float32", 2, 8, 0.0)
    assert deferred.deferred and not deferred.targets and deferred.bound == 1.001
    r = RefitRequest("abc", canary=deferred)
    assert RefitRequest.from_wire(r.to_wire()) == r
    top = [([7] * 7, [-0.5] * 7), ([9] * 7, [-0.25] * 7)]
    done = deferred.completed(top)
    assert not done.deferred and done.scored() == ((7,) * 7, (9,) * 7) and done.reference[1] == (-0.25,) * 7
    assert done == make_canary(1000, "float32", 2, 8, 0.0, lambda seqs: top)  # what computing it first gives
    with pytest.raises(ConfigError, match=r"reference logprobs do not match"):
        deferred.completed(top[:1])
    with pytest.raises(ConfigError, match=r"targets without a reference"):
        replace(deferred, targets=done.targets)


# ------------------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def tied(ckpt_cache):
    ckpt = ckpt_cache.get(overrides=TIED, seed=5)
    return ckpt, load_model_spec(ckpt, dtype="float32")


@pytest.fixture(scope="module")
def cluster(tied, engine_cache):
    ckpt, spec = tied
    llm = engine_cache.get(ckpt, tp=2)
    with local_cluster(spec, ckpt, MegatronParallel(tp=2), VllmParallel(tp=2),
                       RefitConfig(timeout_s=30.0, canary=True), train={"lr": 0.05}, engines=[llm]) as c:
        yield c
    engine_cache.evict(llm)  # the last test leaves its LM head untied (a fault it injected)


def _served(c) -> list[float]:
    return prompt_logprobs(c.engines[0], TOKENS)


@pytest.mark.slow
def test_correct_refits_pass_the_canary_across_training(cluster):
    """Ten training steps, each followed by a refit with the canary on: every refit commits and
    verifies, the canary runs on every rank (its phase in the reports), and the engine then
    computes what the trainers do -- including the LM head that vLLM packs from the tied
    embedding, which a refit must rebuild (it did not before the canary found it)."""
    for _ in range(10):
        cluster.step(TOKENS)
        m = cluster.refit_once()
        assert m.verified and m.bytes_moved == m.bytes_min
        assert m.phases["dst_canary"] > 0 and m.phases["src_canary"] > 0
        assert m.phases["src_canary_reference"] > 0  # deferred: the trainers computed it inside the refit
        assert cluster.logprob_error(TOKENS) < EXACT
    # What the canary scores: after each prefix, the token the trained policy finds most likely
    # -- the token the engine itself decodes greedily there on the refitted weights.
    canary = cluster.driver.canary(now=True)
    prefixes = [list(s[:i + 1]) for s in canary.tokens for i in range(len(s) - 1)]
    assert [t[0] for t in greedy(cluster.engines[0], prefixes, 1)] == [t for s in canary.targets for t in s]
    assert all(lp <= 0.0 for r in canary.reference for lp in r)


@pytest.mark.slow
def test_a_tied_models_refit_equals_a_fresh_engine(cluster, tied, tmp_path):
    """Derived state: vLLM's LM head tied to the embedding keeps its own packed copy on CPU. After
    refits across training the refitted engine serves bit for bit what a fresh engine loading
    the trained checkpoint serves (before the fix the head stayed at the first load's weights)."""
    ckpt, spec = tied
    cluster.step(TOKENS)
    assert cluster.refit_once().verified
    refitted = _served(cluster)
    saved = trained_checkpoint(cluster, spec, ckpt, tmp_path / "trained")
    fresh = start_engine(str(saved), tp=2)  # vLLM's own load (not the cache: same key as the refitted one)
    try:
        assert prompt_logprobs(fresh, TOKENS) == refitted
    finally:
        stop_engine(fresh)


@pytest.mark.slow
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "streaming"])
def test_no_request_reuses_kv_cached_under_older_weights(cluster, atomic):
    """A prompt whose prefix was cached before the refit generates, after it, what it generates
    from an empty cache on the new weights (the same tokens and logprobs)."""
    llm, d = cluster.engines[0], cluster.driver
    block = llm.llm_engine.vllm_config.cache_config.block_size
    prompt = [(7 * i + 3) % 1000 for i in range(block + 8)]
    sample(llm, [prompt], 1, 4, 0.0, 0)  # its first block is now in the prefix cache
    cluster.step(TOKENS)
    assert d.refit(replace(d.request(), atomic=atomic)).verified
    after = sample(llm, [prompt], 1, 4, 0.0, 0)
    llm.reset_prefix_cache()
    assert after == sample(llm, [prompt], 1, 4, 0.0, 0)


@pytest.mark.slow
def test_two_heads_swapped_on_both_sides_pass_the_checksums_and_fail_the_canary(cluster):
    """A layout that names KV head 0's rows of ``v_proj`` where head 1's are (and the other way
    round): the plan is exact and every checksum matches, so without the canary the refit
    commits a model no one trained; with it, the refit fails and the old weights serve."""
    d = cluster.driver
    good = d.src
    hd = cluster.spec.head_dim
    d.src = swap_canonical_rows(good, "model.layers.0.self_attn.v_proj.weight", 0, hd, hd)
    d.make_plan()
    assert d.plan.bytes_planned == d.plan.bytes_min
    try:
        cluster.step(TOKENS)
        old = _served(cluster)
        with pytest.raises(RefitFailed, match=r"CanaryFailed: engine of destination ranks 0\.\.1: canary \d of 2 "
                                              r"\(16 tokens\): token_mult_prob_error [0-9.]+ > bound 1\.001"):
            cluster.refit_once()
        assert _served(cluster) == old and engine_healthy(cluster.engines[0]) == ""
        # The same refit without the canary: it verifies, and the engine is wrong.
        m = d.refit(replace(d.request(), canary=None))
        assert m.verified
        assert cluster.logprob_error(TOKENS) > 1.01
    finally:
        d.src = good
        d.make_plan()
    cluster.refit_once()
    assert cluster.logprob_error(TOKENS) < EXACT


@pytest.mark.slow
def test_skipped_post_load_processing_fails_the_canary(cluster):
    """One layer's kernel not rebuilt after loading (its model-format bytes right, the packed
    weights it computes with old): checksums pass, the canary does not; old weights serve on
    every client path."""
    name = next(p.name for p in cluster.driver.dst.params if p.name.endswith("layers.1.self_attn.o_proj.weight"))
    cluster.step(TOKENS)
    old = _served(cluster)
    with pytest.raises(RefitFailed, match=r"CanaryFailed: .*token_mult_prob_error"):
        cluster.driver.refit(faults=Faults(engine=EngineFault(rank=(0, 1), skip_processing=name)))
    assert _served(cluster) == old
    assert enqueued_logprobs(cluster.engines[0], TOKENS) == old  # enqueue too
    assert len(greedy(cluster.engines[0], [TOKENS], 3)[0]) == 3
    cluster.refit_once()
    assert cluster.logprob_error(TOKENS) < EXACT


@pytest.mark.slow
def test_a_streaming_refit_that_fails_the_canary_gates_the_engine(cluster):
    """Streaming (``atomic=false``) writes live weights as they arrive: a canary failure cannot
    roll back, so the engine refuses model steps until a refit succeeds."""
    d = cluster.driver
    name = next(p.name for p in d.dst.params if p.name.endswith("layers.0.mlp.down_proj.weight"))
    cluster.step(TOKENS)
    with pytest.raises(RefitFailed, match=r"CanaryFailed"):
        d.refit(replace(d.request(), atomic=False),
                faults=Faults(engine=EngineFault(rank=(0, 1), skip_processing=name)))
    assert "not_serving" in str(d.gated) and engine_healthy(cluster.engines[0]) == "paused (gated)"

    llm = cluster.engines[0]
    with pytest.raises(Exception):
        prompt_logprobs(llm, TOKENS)  # generate is refused
    # enqueue: the request waits, no model step runs on the torn weights...
    queued = Enqueued(llm, TOKENS)
    assert queued.waiting(2.0)
    cluster.refit_once()  # ...until a whole refit heals it; then it runs on the new weights
    new = queued.logprobs(60.0)
    assert not d.gated and cluster.logprob_error(TOKENS) < EXACT
    assert new == _served(cluster)


@pytest.mark.slow
def test_an_overlapped_refit_checks_the_shadows_before_the_swap(cluster):
    """Overlapped: the workers vote while the engine serves; the canary runs at the swap (the
    engine paused), on the shadows, on every worker. A failure swaps nothing in: every worker
    keeps the old weights, so the engine is whole and serves them (an engine whose canary
    passed would serve the new ones: each engine whole, never a mix)."""
    name = next(p.name for p in cluster.driver.dst.params if p.name.endswith("layers.1.mlp.gate_up_proj.weight"))
    cluster.step(TOKENS)
    old = _served(cluster)
    with pytest.raises(RefitFailed, match=r"canary"):
        cluster.refit_while(lambda: greedy(cluster.engines[0], [TOKENS], 2),
                            faults=Faults(engine=EngineFault(rank=(0, 1), skip_processing=name)))
    assert not cluster.driver.gated and _served(cluster) == old
    m, _ = cluster.refit_while(lambda: None)
    assert m.verified and not cluster.driver.gated
    assert cluster.logprob_error(TOKENS) < EXACT


@pytest.mark.slow
def test_a_tied_head_updated_on_one_side_only_fails_the_canary(cluster):
    """The engine's LM head cut loose from the embedding it is tied to (a copy, as a careless
    post-processing step would leave it): the refit writes the embedding, every checksum
    passes, and the head computes with the old weights -- the canary fails the refit and the
    old weights serve. (Last: the engine keeps the untied head; the module evicts it.)"""
    cluster.step(TOKENS)
    old = _served(cluster)
    with pytest.raises(RefitFailed, match=r"CanaryFailed"):
        cluster.driver.refit(faults=Faults(engine=EngineFault(rank=(0, 1), untie_head=True)))
    assert _served(cluster) == old


@pytest.mark.slow
def test_a_failed_canary_keeps_the_old_weights_for_the_async_engine(tied):
    """The same failure through vLLM's ``AsyncLLM`` (the engine behind ``vllm serve``): the
    refit fails on the canary, the old weights serve its requests, the next refit heals."""
    ckpt, spec = tied
    with local_cluster(spec, ckpt, MegatronParallel(tp=1), VllmParallel(tp=1), RefitConfig(timeout_s=30.0, canary=True),
                       train={"lr": 0.05}, async_engine=True) as c:
        aeng = c.engines[0]
        assert c.refit_once().verified
        name = next(p.name for p in c.driver.dst.params if p.name.endswith("layers.1.self_attn.o_proj.weight"))
        c.step(TOKENS)
        old = prompt_logprobs(aeng, TOKENS)
        with pytest.raises(RefitFailed, match=r"CanaryFailed"):
            c.driver.refit(faults=Faults(engine=EngineFault(rank=0, skip_processing=name)))
        assert prompt_logprobs(aeng, TOKENS) == old
        assert c.refit_once().verified and c.logprob_error(TOKENS) < EXACT


@pytest.mark.slow
def test_bf16_refits_pass_the_canary_at_the_bf16_bound(ckpt_cache, engine_cache):
    """bf16 kernels differ between megatron and vLLM: the bound follows the precision (1.05),
    and correct refits across training pass it."""
    ckpt = ckpt_cache.get(overrides=TIED, seed=5, dtype="bfloat16")
    spec = load_model_spec(ckpt, dtype="bfloat16")
    llm = engine_cache.get(ckpt, tp=1, dtype="bfloat16")
    with local_cluster(spec, ckpt, MegatronParallel(tp=1), VllmParallel(tp=1),
                       RefitConfig(timeout_s=30.0, canary=True), train={"lr": 0.05}, engines=[llm]) as c:
        req = c.driver.request()
        assert req.canary.bound == TOKEN_MULT_PROB_BOUND["bfloat16"] and req.canary.dtype == "bfloat16"
        for _ in range(3):
            c.step(TOKENS)
            assert c.refit_once().verified
        err = token_mult_prob_error(prompt_logprobs(llm, TOKENS), c.pool.logprobs([TOKENS]).wait()[0][0])
        assert err < TOKEN_MULT_PROB_BOUND["bfloat16"]
