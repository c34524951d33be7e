"""Refit while generating (``refit.overlap``): each vLLM worker receives into shadow weights
on a thread of its own while the engine keeps running model steps on the live weights; after
every rank voted the driver pauses the engine only to swap (``finish_weight_update``).

A trainer stalls before its vote, so the refit is still in flight while this thread
generates (a tiny model's bytes would otherwise arrive before the first token): what the
engine serves meanwhile must equal, token for token and logprob for logprob, what it served
before the refit started; after the swap, the trainers' weights (``verify=full`` on every
rank). A refit that fails in the background (a flipped bit, a killed trainer) leaves the
engine on exactly the old weights through ``generate`` and ``enqueue``, and the next refit
restores. Same engine and trainer pool as ``test_faults`` (bf16 tiny MoE, TP2xEP2 -> TP2).

Then vLLM's ``AsyncLLM`` (TP1, one engine and pool for the module): a request that spans the
swap carries two ``weight_versions`` spans, each matching its weights; and a client's request
made while the engine is gated runs only after the restoring refit.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import greedy, prompt_logprobs, worker_status
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import ConfigError, RefitFailed
from mcore_reshard.wire.faults import Faults, TrainerFault
from mcore_reshard.layout import load_model_spec
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.faults import Fault
from support.live import cluster as shared_cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
PROMPTS = [TOKENS[:6], TOKENS[6:12]]
BF16_BOUND = 1.02  # token_mult_prob_error, vLLM vs megatron's forward
#: The trainer's stall before its vote: the refit is in flight this long while we generate.
STALL = Fault("sleep", at="before_vote", seconds=4.0)


@pytest.fixture(scope="module")
def cluster(ckpt_cache, engine_cache):
    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    llm = engine_cache.get(ckpt, tp=2, dtype="bfloat16")
    refit = RefitConfig(buffer_bytes=1 << 16, timeout_s=10.0, verify=VerifyMode.FULL, overlap=True)
    with shared_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2), refit,
                        train={"lr": 0.05}, engines=[llm]) as c:
        yield c
    engine_cache.check(llm)


@pytest.fixture(scope="module")
def async_cluster(cluster):
    """vLLM's ``AsyncLLM`` (the engine behind ``vllm serve``, TP1) on the same checkpoint, as
    the local job starts it (``job.async_engine``), with a trainer pool and driver of its own:
    clients submit requests while the driver's calls run."""
    from mcore_reshard.jobs.refit import local_cluster

    refit = replace(cluster.refit, overlap=False)
    with local_cluster(cluster.spec, cluster.checkpoint, cluster.training, VllmParallel(tp=1), refit,
                       train={"lr": 0.05}, async_engine=True) as c:
        yield c


def _served(llm) -> tuple[list[float], list[list[int]]]:
    """What the engine serves now: the prompt's logprobs and greedy completions."""
    return prompt_logprobs(llm, TOKENS), greedy(llm, PROMPTS, 8)


def _armed(cluster) -> tuple[list[float], list[list[int]]]:
    """Engine and trainers in step, then one optimizer step: the trainers hold new weights,
    the engine the old ones. Returns what the engine serves (old weights)."""
    m, _ = cluster.refit_while(lambda: None)
    assert m.verified and m.overlapped
    old = _served(cluster.engines[0])
    cluster.step(TOKENS)
    return old


def test_the_engine_serves_the_old_weights_while_receiving_then_swaps_in_the_new(cluster):
    llm = cluster.engines[0]
    old = _armed(cluster)

    def during():
        # The refit is in flight (a trainer stalls before its vote): every worker has
        # received into its shadows, nobody has committed, the engine keeps decoding.
        statuses = worker_status(llm)
        return _served(llm), statuses

    m, (meanwhile, statuses) = cluster.refit_while(during, faults=Faults(TrainerFault(0, STALL)))
    assert meanwhile == old  # token for token, logprob for logprob: the live weights untouched
    assert all(s.state == "serving" for s in statuses), statuses
    assert m.verified and m.overlapped and m.at_minimum
    assert any("full verification" in n for n in m.notes), m.notes  # every rank equals the trainers'
    assert m.pause_seconds > 0.0 and m.peak_extra_bytes > 0  # shadows are counted
    after = _served(llm)
    assert after[0] != old[0]
    assert cluster.logprob_error(TOKENS) < BF16_BOUND
    versions = {s.version for s in worker_status(llm)}
    assert len(versions) == 1 and versions != {statuses[0].version}  # both workers swapped, one version
    print(f"overlapped refit: {m.seconds:.3f}s moving, engine paused {m.pause_seconds * 1e3:.1f} ms for the swap")


@pytest.mark.parametrize("fault", [Fault("bitflip", bucket=1), Fault("exit", at="before_vote", seconds=2.0)],
                         ids=["bitflip", "killed-trainer"])
def test_a_refit_failing_in_the_background_leaves_the_old_weights_and_the_next_restores(cluster, fault):
    llm = cluster.engines[0]
    old = _armed(cluster)
    rank = 0 if fault.kind == "bitflip" else 1
    with pytest.raises(RefitFailed) as err:
        cluster.refit_while(lambda: _served(llm), faults=Faults(TrainerFault(rank, fault)))
    msg = str(err.value)
    assert ("checksum" in msg) if fault.kind == "bitflip" else ("training rank 1 died" in msg), msg
    assert _served(llm) == old  # generate: exactly the old weights, on every worker
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy_params(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == old[1]
    rid = "after-failed-overlap"
    llm.llm_engine.add_request(rid, {"prompt_token_ids": PROMPTS[0]}, _greedy_params())  # enqueue path
    done = []
    while llm.llm_engine.has_unfinished_requests():
        done += [o for o in llm.llm_engine.step() if o.finished]
    assert [list(o.outputs[0].token_ids) for o in done if o.request_id == rid] == [old[1][0]]
    if fault.kind == "exit":
        cluster.restart_trainers()
    m, _ = cluster.refit_while(lambda: None)
    assert m.verified and m.at_minimum
    assert cluster.logprob_error(TOKENS) < BF16_BOUND


def test_a_shadow_cap_below_a_workers_share_is_refused_before_a_byte_moves(cluster):
    d = cluster.driver
    cfg = d.refit_config
    d.refit_config = replace(cfg, max_shadow_bytes=1024)
    try:
        with pytest.raises(ConfigError) as err:
            d.begin_refit()
    finally:
        d.refit_config = cfg
    msg = str(err.value)
    assert "refit.max_shadow_bytes=1024" in msg and "destination rank" in msg and "\n" not in msg, msg
    m, _ = cluster.refit_while(lambda: None)  # nothing was started: the next refit runs as usual
    assert m.verified and m.at_minimum


def test_a_request_spanning_the_swap_has_version_spans_each_matching_its_weights(async_cluster):
    """vLLM's ``AsyncLLM``: a greedy request runs while the refit moves the weights and across
    the swap. Its ``weight_versions`` spans name the old version, then the new one; the tokens
    of the first span are the old weights' greedy tokens, and those of the second are what the
    new weights produce teacher-forced on the prompt and the first span
    (``recompute_kv_cache_after_weight_updates``: the running request's KV is recomputed with
    the new weights, so nothing after the swap attends to old-weight KV)."""
    import threading

    c = async_cluster
    engine = c.engines[0]
    prompt, n = TOKENS[:8], 96
    c.driver.refit_config = replace(c.refit, overlap=True, recompute_kv_cache_after_weight_updates=True)
    try:
        c.refit_while(lambda: None)
        v_old = engine.get_weight_version()
        old_tokens = engine.submit(_async_greedy(engine.engine, prompt, n)).result(timeout=120).outputs[0].token_ids
        c.step(TOKENS)
        started = threading.Event()
        spanning = engine.submit(_async_greedy(engine.engine, prompt, n, started, after=16))
        assert started.wait(60)
        # Freeze the request mid-way (as the driver's own pause does), so that the refit and
        # the swap land inside it whatever the machine's speed.
        engine.sleep(level=0, mode="keep")
        m, _ = c.refit_while(lambda: None)
        out = spanning.result(timeout=120).outputs[0]
        v_new = engine.get_weight_version()
        assert m.verified and any("full verification" in x for x in m.notes), m.notes
        spans = out.weight_versions
        assert [sp.version for sp in spans] == [v_old, v_new], spans
        k = spans[1].start
        # what the new weights produce after the first span (teacher-forced)
        forced = engine.submit(_async_greedy(engine.engine, prompt + list(out.token_ids[:k]), n - k)).result(
            timeout=120).outputs[0].token_ids
    finally:
        c.driver.refit_config = c.refit
    assert spans[0].start == 0 and spans[0].end == k and spans[1].end == len(out.token_ids) == n, spans
    assert 16 <= k < n
    assert list(out.token_ids[:k]) == list(old_tokens[:k])  # the old weights' greedy tokens
    assert list(out.token_ids[k:]) == list(forced)  # the new weights' tokens after the swap
    assert list(out.token_ids) != list(old_tokens)  # and they differ from the old weights'


async def _async_greedy(engine, prompt: list[int], n: int, started=None, after: int = 0):
    """A greedy request through ``AsyncLLM.generate`` (cumulative outputs); ``started`` is set
    once ``after`` tokens are out. Returns the final ``RequestOutput``."""
    import uuid

    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, sp, request_id=uuid.uuid4().hex):
        if started is not None and len(out.outputs[0].token_ids) >= after:
            started.set()
        final = out
    return final


def _fault(cluster, **refit_kwargs) -> str:
    with pytest.raises(RefitFailed) as err:
        cluster.driver.refit(**refit_kwargs)
    return str(err.value)


def _greedy_params():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


async def _async_prompt_logprobs(engine, tokens: list[int]) -> list[float]:
    """A client of vLLM's ``AsyncLLM`` (the engine behind ``vllm serve``): no helper between."""
    import uuid

    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    final = None
    async for out in engine.generate({"prompt_token_ids": tokens}, sp, request_id=uuid.uuid4().hex):
        final = out
    return [float(lp[t].logprob) for t, lp in zip(tokens[1:], final.prompt_logprobs[1:])]


def test_async_engine_clients_get_nothing_while_gated_and_the_restored_weights_after(async_cluster):
    """The gate is vLLM's scheduler, not a Python wrapper: an ``AsyncLLM`` client's request
    made while the engine is gated (a streaming refit failed after layers went live) runs only
    after the refit that restores it."""
    import concurrent.futures

    from mcore_reshard.refit.verify import token_mult_prob_error

    c = async_cluster
    engine = c.engines[0]
    try:
        c.refit_once()
        c.step(TOKENS)
        c.driver.refit_config = replace(c.refit, atomic=False)
        last = max(t.bucket for t in c.driver.plan.for_rank("src", 0).transfers)  # most layers committed by then
        msg = _fault(c, faults=Faults(TrainerFault(0, Fault("bitflip", bucket=last))))
        assert "engine 0 is gated" in msg, msg
        pending = engine.submit(_async_prompt_logprobs(engine.engine, TOKENS))
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(timeout=3.0)  # queued: no model step runs while gated
        c.driver.refit_config = c.refit
        m = c.driver.refit()
        assert m.verified
        served = pending.result(timeout=60)
        train = c.pool.logprobs([TOKENS]).wait()[0][0]
        assert token_mult_prob_error(served, train) < 1.02  # the restored (trained) weights only
        assert served == engine.submit(_async_prompt_logprobs(engine.engine, TOKENS)).result(timeout=60)
        assert served == prompt_logprobs(engine, TOKENS)  # the helpers' path (AsyncEngine.generate)
        assert c.logprob_error(TOKENS) < 1.02
    finally:
        c.driver.refit_config = c.refit


def test_without_kv_recompute_no_new_request_reuses_a_prefix_cached_under_old_weights(async_cluster):
    """``recompute_kv_cache_after_weight_updates=false``: a request running across the swap
    holds KV blocks, so vLLM cannot reset its prefix cache (the refit's notes say so). A new
    request of a cached prompt after the swap still reuses nothing cached under the old
    weights: each request carries the version it arrived at as its ``cache_salt``. A client
    that keeps one fixed salt across the refit shows what that prevents: it reuses the old
    weights' blocks."""
    import threading

    from vllm import SamplingParams

    c = async_cluster
    engine = c.engines[0]
    block = engine.engine.vllm_config.cache_config.block_size
    prompt = {"prompt_token_ids": [(7 * i + 3) % 1000 for i in range(block + 8)]}
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    c.driver.refit_config = replace(c.refit, recompute_kv_cache_after_weight_updates=False)
    try:
        c.refit_once()
        old = engine.weight_version
        engine.generate([prompt], sp)
        assert engine.generate([prompt], sp)[0].num_cached_tokens >= block  # cached under this version
        raw = engine.generate([{**prompt, "cache_salt": "fixed-salt-client"}], sp)[0]  # a client with its own salt
        c.step(TOKENS)
        started = threading.Event()
        running = engine.submit(_async_greedy(engine.engine, TOKENS[:8], 200, started, after=4))
        assert started.wait(60)
        m = c.driver.refit()
        assert m.verified and engine.weight_version != old
        assert any("prefix cache not reset" in n for n in m.notes), m.notes
        after = engine.generate([prompt], sp)[0]
        stale = engine.generate([{**prompt, "cache_salt": "fixed-salt-client"}], sp)[0]  # the same salt as before
        fresh = engine.generate([{**prompt, "cache_salt": "never-seen"}], sp)[0]
        running.result(timeout=120)
    finally:
        c.driver.refit_config = c.refit
    assert after.num_cached_tokens == 0 and fresh.num_cached_tokens == 0
    assert list(after.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)  # the new weights' answer
    assert stale.num_cached_tokens >= block  # the same salt across the refit: the old weights' KV is reused
    assert raw.num_cached_tokens == 0
