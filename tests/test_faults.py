"""The commit holds under faults at every protocol step, tried as an adversary would: a process
killed or stalled at a chosen step, and every client path of the engine called afterwards.

Real stack: tiny MoE (bf16), megatron TP2xEP2 -> vLLM TP2, ``refit.timeout_s=10``. One engine
for the module (the session's, ``conftest.py``), and at first the session's TP2xEP2 trainer
pool of ``test_refit_bf16``; a fault that kills a training rank is followed by a restarted
trainer pool (``restart_trainers``: a new pool from the checkpoint), as a framework would
restart its job.

What every row checks: the refit raises ``RefitFailed`` naming what failed, within seconds
where a process died (the timeout is only for a stopped one); the engine then serves exactly
the old weights, or exactly the new ones, or nothing (gated) -- never a mix; and the next refit
restores service on the same engine. (An ``AsyncLLM`` client's requests while the engine is
gated: the split-commit test here, and ``test_overlap.py``.)
"""

from __future__ import annotations

import threading
import time

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import RefitFailed, RefitIncomplete
from mcore_reshard.wire.faults import EngineFault, Faults, TrainerFault
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import WorkerLayout
from support.live import cluster as shared_cluster
from support.live import enqueued_logprobs
from mcore_reshard.wire.faults import Fault

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
#: A death is visible at once; the driver's error follows within this (pool poll + engine reply).
DEATH_S = 6.0


@pytest.fixture(scope="module")
def cluster(ckpt_cache, engine_cache):
    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    llm = engine_cache.get(ckpt, tp=2, dtype="bfloat16")
    with shared_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2),
                        RefitConfig(buffer_bytes=1 << 16, timeout_s=10.0), train={"lr": 0.05}, engines=[llm]) as c:
        yield c
    engine_cache.check(llm)


def _served(llm) -> list[float] | str:
    """What ``generate`` serves now: the prompt's logprobs, or "refused" with the reason."""
    try:
        return prompt_logprobs(llm, TOKENS)
    except RefitIncomplete:
        return "refused"


def _armed(cluster):
    """Engine and trainers in step, then one optimizer step: the trainers hold new weights,
    the engine the old ones. Returns the engine's logprobs (old weights) and the trainers'
    (new weights)."""
    llm = cluster.engines[0]
    cluster.refit_once()
    old = prompt_logprobs(llm, TOKENS)
    cluster.step(TOKENS)
    return old, cluster.pool.logprobs([TOKENS]).wait()[0][0]


def _fault(cluster, **refit_kwargs) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(RefitFailed) as err:
        cluster.driver.refit(**refit_kwargs)
    return str(err.value), time.monotonic() - t0


def _restored(cluster) -> None:
    m = cluster.refit_once()
    assert m.verified and m.at_minimum
    assert cluster.logprob_error(TOKENS) < 1.02  # bf16 bound
    assert all(s.state == "serving" and s.reason == "" for s in cluster.driver.status())  # no earlier failure's text


def test_trainer_dying_between_its_last_byte_and_its_vote_is_known_at_once(cluster):
    old, _ = _armed(cluster)
    msg, seconds = _fault(cluster, faults=Faults(TrainerFault(1, Fault("exit", at="before_vote"))))
    assert seconds < DEATH_S, (seconds, msg)  # not the 10 s timeout
    assert "training rank 1 died" in msg
    assert _served(cluster.engines[0]) == old  # atomic: every worker kept the old weights
    # the surviving training ranks leave in seconds, on their own (megatron's default gloo group
    # would wait out its timeout at interpreter exit for the dead peer)
    procs = cluster.pool.procs
    t0 = time.monotonic()
    cluster.pool.close()
    assert time.monotonic() - t0 < 5.0
    assert all(p.exitcode == 0 for r, p in enumerate(procs) if r != 1), [p.exitcode for p in procs]
    cluster.restart_trainers()
    _restored(cluster)


def test_a_trainer_that_raises_mid_transfer_with_every_hint_deleted_is_known_in_seconds(cluster):
    """Training rank 1's refit fails mid-transfer (it posts its abort, votes no) while an outside
    writer deletes every abort hint as it appears. The ranks still waiting for its bytes once
    read the aborts only while the hint existed and learned at their timeout; the driver, which
    stopped at the first trainer's failure, then gave the engine its grace and named it
    unresponsive. Now every rank finds the abort within about a second, the driver waits for
    every trainer, and the engine -- which answered -- keeps its old weights, resumed."""
    from datetime import timedelta

    import torch.distributed as dist

    from mcore_reshard.testing.attacks import Deleter

    llm = cluster.engines[0]
    old, _ = _armed(cluster)
    d = cluster.driver
    d.ensure_connected()
    store = dist.TCPStore(d.join_info.host, d.join_info.port, is_master=False, timeout=timedelta(seconds=10))
    with Deleter(store, ("hint",)):
        msg, seconds = _fault(cluster, faults=Faults(TrainerFault(1, raise_after_reads=5)))
    assert seconds < DEATH_S, (seconds, msg)  # not the 10 s timeout
    assert "training rank 1" in msg and "injected failure" in msg, msg
    assert "unresponsive" not in msg and not d.dead and not d.gated, msg
    assert _served(llm) == old
    assert enqueued_logprobs(llm, TOKENS) == old
    _restored(cluster)


def test_vllm_worker_stalled_before_its_vote_aborts_and_the_engine_keeps_the_old_weights(cluster):
    """A worker that does not vote in time is a silent peer: the timeout decides abort, the
    worker then reads that decision and rolls back; the engine serves the old weights."""
    from dataclasses import replace

    old, _ = _armed(cluster)
    request = replace(cluster.driver.request(), timeout_s=3.0)  # the worker stalls past it, within the grace
    msg, seconds = _fault(cluster, request=request,
                          faults=Faults(engine=EngineFault(1, Fault("sleep", at="before_vote", seconds=5))))
    assert "no vote within 3.0s" in msg and "destination rank 1" in msg, msg
    assert _served(cluster.engines[0]) == old
    st = cluster.driver.status()
    assert all(s.state == "serving" and s.committed is False for s in st), st
    _restored(cluster)


def test_streaming_refit_that_fails_gates_the_engine_for_every_client(cluster):
    """atomic=false commits layers as they complete: a refit that fails at the end leaves a
    mix in the workers, so the engine is paused, not just one Python call wrapped."""
    from dataclasses import replace

    llm = cluster.engines[0]
    _armed(cluster)
    cluster.driver.refit_config = replace(cluster.refit, atomic=False)
    try:
        msg, _ = _fault(cluster, faults=Faults(TrainerFault(0, Fault("bitflip", bucket=2))))
        assert "checksum mismatch" in msg and "engine 0 is gated" in msg, msg
        assert any(s.state == "not_serving" for s in cluster.driver.status())
        assert llm.llm_engine.is_sleeping() and _served(llm) == "refused"
        m = cluster.driver.refit()  # a refit that succeeds resumes the engine
    finally:
        cluster.driver.refit_config = cluster.refit
    assert m.verified and not llm.llm_engine.is_sleeping()
    assert cluster.logprob_error(TOKENS) < 1.02


def test_a_delta_onto_an_altered_baseline_is_named_and_the_engine_keeps_its_weights(cluster):
    """One element of a worker's weights changes behind the refit's back: the next delta
    rebuilds that box from it, the checksum of the whole box names the parameter, every
    worker keeps what it served, and the refit after the failure is full and repairs it."""
    llm = cluster.engines[0]
    _armed(cluster)
    cluster.refit_once()  # engine and trainers hold the same committed refit
    # no step: every box of the next refit is unchanged, each rebuilt from what the worker holds
    # a live weight (a norm), and the model-format copy of a layer vLLM repacks (the experts)
    for name, live in (("model.norm.weight", True), ("model.layers.0.mlp.experts.routed_experts.w2_weight", False)):
        held = [s.version for s in cluster.driver.status()]
        before = _served(llm)
        msg, seconds = _fault(cluster, faults=Faults(engine=EngineFault(1, alter_baseline=name)))
        assert "checksum mismatch" in msg and name in msg and "destination rank 1" in msg, msg
        assert seconds < DEATH_S
        st = cluster.driver.status()
        assert [s.version for s in st] == held and all(s.state == "serving" for s in st), st  # old weights kept
        if not live:
            assert _served(llm) == before  # nothing it serves changed
        m = cluster.refit_once()  # a refit after a failure is full: it repairs the altered weight
        assert not m.delta and "committed baseline" in m.delta_reason and m.verified and m.at_minimum
        assert cluster.logprob_error(TOKENS) < 1.02
    cluster.step(TOKENS)
    assert cluster.refit_once().delta  # and the one after a full one is a delta again
    assert cluster.logprob_error(TOKENS) < 1.02


def test_after_a_failed_refit_the_next_one_on_the_same_engine_works_and_rpcs_are_clean(cluster):
    """A refused refit (a digest no rank holds) raises from update_weights on the last worker
    only, so no reply is left queued in vLLM: the very next RPCs answer correctly."""
    from dataclasses import replace

    _armed(cluster)
    d = cluster.driver
    msg, seconds = _fault(cluster, request=replace(d.request(), plan_digest="0" * 16))
    assert "0" * 16 in msg and seconds < DEATH_S
    # every refusing worker is named, not only the last one (which raises for its engine)
    assert "vLLM destination rank 0" in msg and "vLLM destination rank 1" in msg, msg
    describe = cluster.engines[0].collective_rpc("mr_describe")
    assert len(describe) == 2 and all(WorkerLayout.from_wire(w).params for w in describe)  # not a stale reply
    _restored(cluster)


def test_trainer_dying_after_its_vote(cluster):
    """Every vote was ok: the decision may already be commit. Either way the engine is whole:
    all workers hold the new weights, or all still the old ones."""
    from mcore_reshard.refit.verify import token_mult_prob_error

    llm = cluster.engines[0]
    old, new = _armed(cluster)
    msg, seconds = _fault(cluster, faults=Faults(TrainerFault(1, Fault("exit", at="after_vote"))))
    assert "training rank 1 died" in msg and seconds < DEATH_S, (seconds, msg)
    st = cluster.driver.status()
    assert len({s.version for s in st}) == 1 and all(s.state == "serving" for s in st), st
    assert not llm.llm_engine.is_sleeping()
    served = _served(llm)
    assert served == old or token_mult_prob_error(served, new) < 1.02  # one model, whichever
    cluster.restart_trainers()
    _restored(cluster)


def _new_driver(cluster, engines):
    """A new driver (as a restarted framework makes one) on the cluster's pool and ``engines``:
    it numbers its refits from 1 again."""
    from mcore_reshard.refit.driver import RefitDriver

    cluster.driver.close()
    cluster.driver = RefitDriver(cluster.pool, engines, cluster.refit, cluster.spec,
                                 transport=cluster.transports[cluster.refit.transport])
    cluster.driver.__enter__()
    return cluster.driver


def test_a_split_engine_stays_gated_across_new_drivers_that_reuse_versions(cluster, ckpt_cache):
    """The probe's sequence, on an ``LLM`` and an ``AsyncLLM`` engine (TP2 each) at once:
    driver A's refit 1 commits; driver B's refit 1 is split by the store host's death (worker 0
    of each engine committed, worker 1 could not learn the decision); driver C's refit 1 fails
    cleanly. Every driver numbers its refits from 1 and the caller labels each "refit-1", yet
    no engine serves the mix: each stays gated -- ``generate``, ``enqueue`` and ``AsyncLLM``
    clients get no model step -- until a refit of driver C commits on all of its workers."""
    import concurrent.futures
    from dataclasses import replace

    from vllm import SamplingParams

    from mcore_reshard.adapters.vllm.engine import start_async_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.refit.verify import token_mult_prob_error
    from support.live import engine_extension
    from test_overlap import _async_prompt_logprobs

    llm = cluster.engines[0]
    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    aeng = start_async_engine(str(ckpt), tp=2, dtype="bfloat16", worker_extension_cls=engine_extension(),
                              weight_transfer_config={"backend": BACKEND})
    both = [llm, aeng]

    def labelled(d, **kw):
        return replace(d.request(), version="refit-1", **kw)

    try:
        cluster.step(TOKENS)  # W1 is not the checkpoint's weights, which the restarted trainers load
        a = _new_driver(cluster, both)
        a.refit(labelled(a))  # driver A, refit 1: W1 on every worker of both engines
        old = prompt_logprobs(llm, TOKENS)
        cluster.step(TOKENS)
        b = _new_driver(cluster, both)
        with pytest.raises(RefitFailed) as err:  # driver B, refit 1: split by the store host's death
            b.refit(labelled(b), faults=Faults(TrainerFault(0, Fault("exit", at="after_decision", seconds=0.5)),
                                               EngineFault((1, 3), Fault("sleep", at="after_vote", seconds=2.0))))
        assert "engine 0 is gated" in str(err.value) and "engine 1 is gated" in str(err.value), err.value
        assert "training rank 0 died" in str(err.value), err.value
        st = b.status()  # worker 0 of each engine committed, worker 1 does not know: different weights
        assert [s.state for s in st] == ["serving", "unsure", "serving", "unsure"], st
        assert llm.llm_engine.is_sleeping() and _served(llm) == "refused"  # paused: no model step for anyone
        cluster.restart_trainers()
        c = _new_driver(cluster, both)
        with pytest.raises(RefitFailed) as err:  # driver C, refit 1: refused cleanly before a byte moves
            c.refit(labelled(c, plan_digest="0" * 16))
        msg = str(err.value)
        assert "engine 0 is gated" in msg and "engine 1 is gated" in msg, msg
        st = c.status()
        assert [s.version for s in st] == ["refit-1"] * 4  # the labels alike...
        assert len({s.refit for s in st[:2]}) == 2 and len({s.refit for s in st[2:]}) == 2, st  # ...the refits not
        assert [s.state for s in st] == ["serving", "unsure", "serving", "unsure"], st
        # every client path: nothing runs
        assert llm.llm_engine.is_sleeping() and _served(llm) == "refused" and _served(aeng) == "refused"
        llm.enqueue([{"prompt_token_ids": TOKENS}], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                    use_tqdm=False)
        got: dict = {}
        waiter = threading.Thread(target=lambda: got.update(out=llm.wait_for_completion(use_tqdm=False)), daemon=True)
        waiter.start()
        pending = aeng.submit(_async_prompt_logprobs(aeng.engine, TOKENS))
        waiter.join(2.0)
        assert waiter.is_alive() and "out" not in got
        with pytest.raises(concurrent.futures.TimeoutError):
            pending.result(timeout=1.0)
        m = c.refit(labelled(c))  # the restoring refit: committed on every worker of both engines
        waiter.join(30)
        assert m.verified and m.at_minimum and not waiter.is_alive()
        async_served = pending.result(timeout=60)  # the waiting async request ran too (before status asks)
        st = c.status()
        assert all(s.state == "serving" for s in st) and len({s.refit for s in st}) == 1, st
        train = cluster.pool.logprobs([TOKENS]).wait()[0][0]
        queued = [float(lp[t].logprob) for t, lp in zip(TOKENS[1:], got["out"][0].prompt_logprobs[1:])]
        for served in (queued, async_served, prompt_logprobs(llm, TOKENS), prompt_logprobs(aeng, TOKENS)):
            assert token_mult_prob_error(served, train) < 1.02  # driver C's weights only
        assert queued == prompt_logprobs(llm, TOKENS) and queued != old  # the queued request saw those only
    finally:
        _new_driver(cluster, [llm])
        stop_engine(aeng)


def test_a_stopped_worker_is_refused_at_once_everywhere_then_readmitted_when_it_answers(cluster):
    """A worker that stops answering (stalled past the refit's timeout and the engine's grace)
    makes its engine unresponsive: every later call on it -- the helpers' ``generate``, the
    driver's status and refit, a new driver's describe, closing a driver -- is refused or
    skipped at once instead of queueing behind the stuck call and getting its reply. Once the
    worker answers again the same driver readmits the engine, gated until its next refit
    commits."""
    from dataclasses import replace

    from mcore_reshard.refit.driver import RefitDriver
    from mcore_reshard.errors import EngineUnresponsive

    llm = cluster.engines[0]
    _armed(cluster)
    d = cluster.driver
    d.refit_config, d.engine_grace_s = replace(cluster.refit, timeout_s=3.0), 2.0
    stall_s = 10.0
    try:
        t_stall = time.monotonic()
        msg, _ = _fault(cluster, faults=Faults(engine=EngineFault(1, Fault("sleep", at="before_vote", seconds=stall_s))))
        assert "engine 0 is unresponsive" in msg and "no answer to update_weights" in msg, msg

        def at_once(call, error, match):
            t0 = time.monotonic()
            with pytest.raises(error, match=match):
                call()
            assert time.monotonic() - t0 < 1.0, call

        at_once(lambda: prompt_logprobs(llm, TOKENS), EngineUnresponsive, "has not answered update_weights")
        at_once(d.status, RefitFailed, "unresponsive")
        at_once(d.refit, RefitFailed, "unresponsive")  # not queued behind the stuck call
        fresh = RefitDriver(cluster.pool, [llm], cluster.refit, cluster.spec)
        at_once(fresh.__enter__, EngineUnresponsive, "mr_describe")  # a new driver's describe
        t0 = time.monotonic()
        fresh.close()  # skips the engine that does not answer
        assert time.monotonic() - t0 < 5.0
        assert time.monotonic() - t_stall < stall_s, "the checks ran past the stall: nothing was proven"
        while time.monotonic() - t_stall < stall_s + 1.0:  # the worker answers again
            time.sleep(0.25)
        m = d.refit()  # the same driver: readmitted, gated, restored by this refit
        assert m.verified and m.at_minimum and not d.dead and not d.gated
    finally:
        d.refit_config, d.engine_grace_s = cluster.refit, 10.0
    assert cluster.logprob_error(TOKENS) < 1.02


def test_a_persistent_store_writer_and_a_late_reader_never_leave_two_engines_serving_different_weights(
        cluster, ckpt_cache, engine_cache):
    """The probe's split, on two engines of TP1 (an ``LLM`` and an ``AsyncLLM``: a split shows
    as two engines serving different weights). An outside writer on the refit store deletes
    every vote, the decision and every signed copy of it as soon as each is written, and
    engine 1's worker reads the decision 3 s late. Once, the ranks that read the coordinator's
    commit in time committed while the late ones timed out and wrote an abort over the
    emptied key, and the driver said "aborted on every rank". Now only the coordinator
    decides (commit once it caught every "ok", else abort at its deadline) and a rank that voted
    ok never decides abort on its own: no two engines serve different weights -- each serves
    the one decision's weights or is gated (``unsure``), on every client path -- the driver
    says "aborted" only where no rank committed, and every rank is done by the deadline plus
    the grace. The next refit (the writer gone) restores both engines."""
    import concurrent.futures
    from dataclasses import replace
    from datetime import timedelta

    import torch.distributed as dist
    from vllm import SamplingParams

    from mcore_reshard.adapters.vllm.engine import start_async_engine, stop_engine
    from mcore_reshard.adapters.vllm.plugin import BACKEND
    from mcore_reshard.refit.verify import token_mult_prob_error
    from mcore_reshard.testing.attacks import Deleter
    from support.live import engine_extension
    from test_overlap import _async_prompt_logprobs

    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    llm = engine_cache.get(ckpt, tp=1, dtype="bfloat16")
    aeng = start_async_engine(str(ckpt), tp=1, dtype="bfloat16", worker_extension_cls=engine_extension(),
                              weight_transfer_config={"backend": BACKEND})
    timeout_s, late_s = 6.0, 3.0
    try:
        d = _new_driver(cluster, [llm, aeng])
        d.refit()  # both engines and the trainers in step
        old = prompt_logprobs(llm, TOKENS)
        cluster.step(TOKENS)
        new = cluster.pool.logprobs([TOKENS]).wait()[0][0]
        d.refit_config = replace(cluster.refit, timeout_s=timeout_s)
        store = dist.TCPStore(d.join_info.host, d.join_info.port, is_master=False, timeout=timedelta(seconds=10))
        t0 = time.monotonic()
        with Deleter(store, ("vote", "decision", "decided")) as deleter:
            with pytest.raises(RefitFailed) as err:
                d.refit(faults=Faults(engine=EngineFault(1, Fault("sleep", at="after_vote", seconds=late_s))))
        seconds = time.monotonic() - t0
        msg = str(err.value)
        assert deleter.deleted > 0
        assert seconds < timeout_s + late_s + 2.0 + DEATH_S, (seconds, msg)
        st = d.status()
        assert all(s.state in ("serving", "unsure") for s in st), st
        committed = {s.refit for s in st if s.state == "serving" and s.committed}
        assert len(committed) <= 1, st  # whoever committed, committed the one decision
        served = {}
        for e, eng in enumerate((llm, aeng)):
            if e in d.gated:  # every client path: nothing runs
                assert _served(eng) == "refused"
                served[e] = "gated"
            else:
                got = prompt_logprobs(eng, TOKENS)
                served[e] = "old" if got == old else "new" if token_mult_prob_error(got, new) < 1.02 else "MIXED"
        print(f"persistent writer + late reader: {seconds:.1f}s, engines {served}: {msg[:600]}")
        assert "MIXED" not in served.values() and not {"old", "new"} <= set(served.values()), served
        if "aborted on every rank" in msg:  # the coordinator decided abort: then no rank committed
            assert not committed and "new" not in served.values(), (st, served)
        if served[0] == "gated":  # queued on the offline engine: no model step until a refit commits
            llm.enqueue([{"prompt_token_ids": TOKENS}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                       prompt_logprobs=0), use_tqdm=False)
            got: dict = {}
            waiter = threading.Thread(target=lambda: got.update(out=llm.wait_for_completion(use_tqdm=False)),
                                      daemon=True)
            waiter.start()
            waiter.join(2.0)
            assert waiter.is_alive() and "out" not in got
        else:
            assert enqueued_logprobs(llm, TOKENS) == prompt_logprobs(llm, TOKENS)
        pending = aeng.submit(_async_prompt_logprobs(aeng.engine, TOKENS))
        if served[1] == "gated":
            with pytest.raises(concurrent.futures.TimeoutError):
                pending.result(timeout=1.0)  # queued: no model step until a refit commits
        else:
            assert pending.result(timeout=60) == prompt_logprobs(aeng, TOKENS)
            pending = None
        d.refit_config = cluster.refit
        m = d.refit()  # the writer gone: both engines whole again, on the trainers' weights
        assert m.verified and m.at_minimum and not d.gated
        if pending is not None:  # it ran after the restoring refit, on its weights only
            assert token_mult_prob_error(pending.result(timeout=60), new) < 1.02
        if served[0] == "gated":
            waiter.join(30)
            assert not waiter.is_alive()
        for eng in (llm, aeng):
            assert token_mult_prob_error(prompt_logprobs(eng, TOKENS), new) < 1.02
        assert all(s.state == "serving" and s.reason == "" for s in d.status())  # no earlier failure's text
    finally:
        _new_driver(cluster, [cluster.engines[0]])
        stop_engine(aeng)
