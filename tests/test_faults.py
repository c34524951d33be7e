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
gated: ``test_overlap.py``, which shares that engine with the overlapped refits.)
"""

from __future__ import annotations

import threading
import time

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import RefitFailed, RefitIncomplete
from mcore_reshard.faults import EngineFault, Faults, TrainerFault
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.protocol import WorkerLayout
from support.live import cluster as shared_cluster
from mcore_reshard.transport.executor import Fault

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


def test_trainer_dying_between_its_last_byte_and_its_vote_is_known_at_once(cluster):
    old, _ = _armed(cluster)
    msg, seconds = _fault(cluster, faults=Faults(TrainerFault(1, Fault("exit", at="before_vote"))))
    assert seconds < DEATH_S, (seconds, msg)  # not the 10 s timeout
    assert "training rank 1 died" in msg
    assert _served(cluster.engines[0]) == old  # atomic: every worker kept the old weights
    cluster.restart_trainers()
    _restored(cluster)


def test_vllm_worker_stalled_before_its_vote_aborts_and_the_engine_keeps_the_old_weights(cluster):
    """A worker that does not vote in time is a silent peer: the timeout decides abort, the
    worker then reads that decision and rolls back; the engine serves the old weights."""
    old, _ = _armed(cluster)
    msg, seconds = _fault(cluster, faults=Faults(engine=EngineFault(1, Fault("sleep", at="before_vote", seconds=12))))
    assert "no vote" in msg and "destination rank 1" in msg, msg
    assert _served(cluster.engines[0]) == old
    st = cluster.driver.status()
    assert all(s.state == "serving" and s.committed is False for s in st), st
    _restored(cluster)


def test_store_host_dying_between_two_workers_reading_the_decision_gates_the_engine(cluster):
    """The split commit: trainer rank 0 (the store's host) dies after the commit decision was
    written; worker 0 read it and committed, worker 1 could not read it and kept the old
    weights. The engine must not serve that mix through any client path: it is gated (its
    scheduler paused) until a refit succeeds, and a request enqueued meanwhile runs after
    the restoring refit, on the new weights only."""
    llm = cluster.engines[0]
    cluster.step(TOKENS)  # the engine's weights below are not the checkpoint's, which the restarted trainers load
    old, _ = _armed(cluster)
    msg, seconds = _fault(cluster, faults=Faults(TrainerFault(0, Fault("exit", at="after_decision", seconds=0.5)),
                                                EngineFault(1, Fault("sleep", at="after_vote", seconds=2.0))))
    assert "training rank 0 died" in msg and "engine 0 is gated" in msg, msg
    st = cluster.driver.status()
    assert {s.state for s in st} == {"serving", "unsure"}, st  # worker 0 committed, worker 1 does not know
    assert len({s.version for s in st}) == 2, st  # they hold different weights...
    assert llm.llm_engine.is_sleeping()  # ...so the engine is paused: no model step for any client
    assert _served(llm) == "refused"
    # enqueue + wait_for_completion: the request waits in vLLM's queue and runs only after the
    # refit that restores the engine
    from vllm import SamplingParams

    llm.enqueue([{"prompt_token_ids": TOKENS}], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                use_tqdm=False)
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(out=llm.wait_for_completion(use_tqdm=False)), daemon=True)
    waiter.start()
    waiter.join(2.0)
    assert waiter.is_alive() and "out" not in got  # nothing ran while gated
    cluster.restart_trainers()
    m = cluster.refit_once()  # the restoring refit resumes the engine: the queued request runs now,
    waiter.join(30)  # before this thread calls the engine again (LLM is not for two threads at once)
    assert not waiter.is_alive() and m.verified and m.at_minimum
    out = got["out"][0]
    served = [float(lp[t].logprob) for t, lp in zip(TOKENS[1:], out.prompt_logprobs[1:])]
    assert served == prompt_logprobs(llm, TOKENS)  # the queued request saw the restored weights only
    assert served != old
    assert cluster.logprob_error(TOKENS) < 1.02


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
    describe = cluster.engines[0].collective_rpc("mr_describe")
    assert len(describe) == 2 and all(WorkerLayout.from_wire(w).params for w in describe)  # not a stale reply
    _restored(cluster)


def test_trainer_dying_after_its_vote(cluster):
    """Every vote was ok: the decision may already be commit. Either way the engine is whole:
    all workers hold the new weights, or all still the old ones."""
    from mcore_reshard.verify import token_mult_prob_error

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
