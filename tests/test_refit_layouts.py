"""The trainer layouts people train with, refit live: pipeline parallel (even, uneven, virtual),
PP x EP, several engines, and every dense family the specs support. Each refit is verified by
checksums, ``verify=full`` and token_mult_prob_error after a training step through megatron's
own pipeline schedule.

The MoE engines (TP1, TP2) and the TP2xEP2 trainer pool are the session's (``conftest.py``):
every test refits before it asserts on an engine's weights. The dense families, the engine that
a test kills and the trainer layouts used once are started here."""

from __future__ import annotations

import time

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import prompt_logprobs, start_engine, stop_engine
from mcore_reshard.adapters.vllm.plugin import BACKEND
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.errors import RefitFailed
from mcore_reshard.wire.faults import EngineFault, Faults
from mcore_reshard.layout import load_model_spec
from mcore_reshard.plan.placed import Location, RankPlacement, placement_report
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.jobs.refit import local_cluster
from support.live import cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
BOUND = 1.001  # token_mult_prob_error of one fp32 model computed by megatron and by vLLM
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)


def _engine(ckpt):
    return start_engine(str(ckpt), tp=1, dtype="float32", worker_extension_cls=REFIT_EXTENSION,
                        weight_transfer_config={"backend": BACKEND})


def _refit_train_refit(spec, ckpt, training, engines, vllm=VllmParallel(tp=1), start=local_cluster):
    with start(spec, ckpt, training, vllm, CFG, train={"lr": 0.05}, engines=engines) as c:
        first = c.refit_once()
        assert first.verified and first.at_minimum
        assert c.logprob_error(TOKENS) < BOUND
        c.step(TOKENS)
        assert c.logprob_error(TOKENS) > 1.01  # the step changed the weights; the engine has the old ones
        second = c.refit_once()
        assert second.verified and any("full verification" in n for n in second.notes)
        assert c.logprob_error(TOKENS) < BOUND
        return c.driver.plan


@pytest.fixture
def moe(ckpt_cache, shared_engine):
    ckpt = ckpt_cache.get(moe=True, seed=7)
    return load_model_spec(ckpt, dtype="float32"), ckpt, shared_engine(ckpt, tp=1)


@pytest.mark.parametrize("training", [
    MegatronParallel(pp=2),
    MegatronParallel(pp=2, vpp=2),
    MegatronParallel(pp=2, first_stage_layers=1, last_stage_layers=3),
    MegatronParallel(pp=2, dp=2, ep=2, etp=1),
], ids=["pp2", "pp2-vpp2", "pp2-uneven", "pp2-ep2"])
def test_pipeline_parallel_trainers_refit_one_engine(moe, training):
    spec, ckpt, llm = moe
    plan = _refit_train_refit(spec, ckpt, training, [llm])
    assert plan.num_src == training.world_size


def test_what_an_engine_replicates_crosses_into_its_node_once(moe, shared_engine):
    """Trainers on node 0, one engine of TP2 on node 1: the pieces both of its workers hold
    (norms, router, q/k norms) cross the fabric once, into one worker, which forwards them to
    the other (a piece-level relay group); verified by checksums on both workers,
    ``verify=full`` and token_mult_prob_error."""
    from mcore_reshard.plan import get_plan

    spec, ckpt, _ = moe
    llm = shared_engine(ckpt, tp=2)
    place = RankPlacement((Location(0, 0), Location(0, 1)), (Location(1, 0), Location(1, 1)), gpus_per_node=2)
    with cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2), CFG,
                 train={"lr": 0.05}, engines=[llm], placement=place) as c:
        plan, src, dst = c.driver.plan, c.driver.src, c.driver.dst
        assert plan.relay_groups == ((0, 1),)
        want = placement_report(plan, src, dst, place)
        unrelayed = placement_report(get_plan(src, dst, bucket_bytes=plan.bucket_bytes, placement=place),
                                     src, dst, place)
        assert want.bytes_inter_node == want.bytes_inter_node_min < unrelayed.bytes_inter_node
        c.step(TOKENS)
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        reports = c.driver.last_reports
        assert sum(r.bytes_sent for r in reports if r.side == "src") == want.bytes_inter_node
        assert sum(r.bytes_sent for r in reports if r.side == "dst") == want.bytes_intra_node > 0
        assert c.logprob_error(TOKENS) < BOUND


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_dense_family_refits_live(tmp_path, family):
    ckpt = make_tiny_checkpoint(tmp_path / family, family=family, seed=11)
    spec = load_model_spec(ckpt, dtype="float32")
    llm = _engine(ckpt)
    try:
        _refit_train_refit(spec, ckpt, MegatronParallel(tp=2), [llm])
    finally:
        stop_engine(llm)


def test_two_engines_take_one_refit_in_one_vote(moe):
    """The destination rank space spans two independent engines (destination offsets 0 and 1);
    the plan feeds both from the trainers at once and every worker of both votes."""
    spec, ckpt, llm = moe
    second = _engine(ckpt)  # killed below: its own
    try:
        # Fan-out relays: trainers on node 0, both engines on node 1. Each box crosses into node 1
        # once (to one of the two identical workers, which forwards it to the other); bytes per
        # class as planned; every worker of both engines verified.
        place = RankPlacement((Location(0, 0), Location(0, 1)), (Location(1, 0), Location(1, 1)), gpus_per_node=2)
        with cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1, replicas=2), CFG,
                     train={"lr": 0.05}, engines=[llm, second], placement=place) as c:
            plan = c.driver.plan
            assert plan.relay_groups == ((0, 1),)
            want = placement_report(plan, c.driver.src, c.driver.dst, place)
            assert want.bytes_inter_node == want.bytes_inter_node_min == plan.bytes_min // 2
            c.step(TOKENS)
            m = c.refit_once()
            assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
            reports = c.driver.last_reports
            assert sum(r.bytes_sent for r in reports if r.side == "src") == want.bytes_inter_node
            assert sum(r.bytes_sent for r in reports if r.side == "dst") == want.bytes_intra_node
            assert c.logprob_error(TOKENS) < BOUND

        with cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1, replicas=2), CFG,
                     train={"lr": 0.05}, engines=[llm, second]) as c:
            plan = c.driver.plan
            assert plan.num_dst == 2 and plan.recv_bytes()[0] == plan.recv_bytes()[1] == plan.bytes_min // 2
            assert {t.src for t in plan.transfers if t.dst == 0} == {t.src for t in plan.transfers if t.dst == 1} == {0, 1}
            c.step(TOKENS)
            m = c.refit_once()
            assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
            assert c.logprob_error(TOKENS) < BOUND  # the worst of the two engines

            # A vLLM worker dies mid-refit (engine 2's only worker, destination rank 1): every
            # rank stops within seconds, the error names it, engine 1 keeps exactly its old
            # weights (atomic), and the dead engine refuses generation.
            c.step(TOKENS)
            old = prompt_logprobs(llm, TOKENS)
            t0 = time.monotonic()
            with pytest.raises(RefitFailed, match="destination rank 1"):
                c.driver.refit(faults=Faults(engine=EngineFault(1, exit_after_writes=3)))
            assert time.monotonic() - t0 < 20
            assert prompt_logprobs(llm, TOKENS) == old
            with pytest.raises(Exception):
                prompt_logprobs(second, TOKENS)
    finally:
        stop_engine(second)
    # a new refit group without the dead engine restores service with the trained weights
    with cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1), CFG, train={"lr": 0.05},
                 engines=[llm]) as c:
        m = c.refit_once()
        assert m.verified and c.logprob_error(TOKENS) < BOUND
