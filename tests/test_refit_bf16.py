"""The production training stack, refit: bf16 through megatron's Float16Module, DDP and the
distributed optimizer (fp32 main weights, overlapped parameter all-gather), each refit after
an optimizer step and verified by checksums, ``verify=full`` and token_mult_prob_error.

The MoE engine and the TP2xEP2 trainer pool (shared with ``test_faults``) are the session's
(``conftest.py``): every test refits before it asserts on the engine's weights. Pools used
once are started here and closed."""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
from mcore_reshard.adapters.vllm.plugin import BACKEND
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.adapters.vllm.worker import REFIT_EXTENSION
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.errors import RefitError
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from mcore_reshard.jobs.refit import TOKEN_MULT_PROB_BOUND, local_cluster
from support.live import cluster

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
BF16 = TOKEN_MULT_PROB_BOUND["bfloat16"]  # NeMo RL's healthy bound: bf16 kernels differ between the two sides
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)


def _engine(ckpt):
    return start_engine(str(ckpt), tp=1, dtype="bfloat16", worker_extension_cls=REFIT_EXTENSION,
                        weight_transfer_config={"backend": BACKEND})


def _model(tmp_path_factory, name, **kw):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp(name) / name, dtype="bfloat16", seed=13, **kw)
    llm = _engine(ckpt)
    return load_model_spec(ckpt, dtype="bfloat16"), ckpt, llm


@pytest.fixture
def moe(ckpt_cache, shared_engine):
    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16", seed=13)
    return load_model_spec(ckpt, dtype="bfloat16"), ckpt, shared_engine(ckpt, tp=1, dtype="bfloat16")


#: The session's pool for this layout (test_faults refits from it too); others start their own.
SHARED = MegatronParallel(tp=2, ep=2, etp=1)


def _train_and_refit(spec, ckpt, llm, training, **kw):
    start = cluster if training == SHARED else local_cluster
    with start(spec, ckpt, training, VllmParallel(tp=1), CFG, train={"lr": 0.05}, engines=[llm], **kw) as c:
        c.refit_once()
        c.step(TOKENS)
        stale = c.logprob_error(TOKENS)
        m = c.refit_once()
        return c, m, stale, c.logprob_error(TOKENS)


@pytest.mark.parametrize("training", [MegatronParallel(tp=2, ep=2, etp=1), MegatronParallel(pp=2)],
                         ids=["tp2-ep2", "pp2"])
def test_bf16_moe_refit_after_a_distributed_optimizer_step(moe, training):
    """Each refit after an optimizer step is a delta (refit.delta=auto) that ``verify=full``
    proves equal, element for element, to the trainer's weights -- what a full refit gives;
    then a step at lr 0 changes nothing, and its refit moves only headers, still verified."""
    spec, ckpt, llm = moe
    start = cluster if training == SHARED else local_cluster
    with start(spec, ckpt, training, VllmParallel(tp=1), CFG, train={"lr": 0.05}, engines=[llm]) as c:
        c.refit_once()
        c.step(TOKENS)
        stale = c.logprob_error(TOKENS)
        m = c.refit_once()
        err = c.logprob_error(TOKENS)
        c.step(TOKENS, lr=1e-6)
        small = c.refit_once()
        c.step(TOKENS, lr=0.0)
        none = c.refit_once()
        plan = c.driver.plan
    assert m.verified and any("full verification" in n for n in m.notes)
    assert m.delta and m.at_minimum and m.bytes_full == m.bytes_min == plan.bytes_min  # bf16: 2 bytes per element
    assert plan.itemsize == 2
    assert stale > err and err <= BF16
    # lr 1e-6 (N(0, 0.05) weights): a sparse delta under a tenth of the bytes, equal element for element
    assert small.delta and small.verified and any("full verification" in n for n in small.notes)
    assert 0 < small.delta_fraction < 0.05 and small.delta_boxes["sparse"] > 0
    assert small.bytes_moved < small.bytes_full / 10
    # lr 0: every box unchanged; the wire carried the headers (8 bytes a box) and nothing else
    assert none.delta and none.verified and any("full verification" in n for n in none.notes)
    assert none.delta_fraction == 0.0 and none.delta_boxes["sparse"] == none.delta_boxes["dense"] == 0
    assert none.bytes_moved == none.bytes_headers == 8 * none.delta_boxes["unchanged"] > 0
    # ... and the engine copied and reprocessed nothing: no shadow opened, no layer repacked
    # (each phase adds its seconds only when it runs)
    assert none.phases["dst_apply_open"] == none.phases["dst_apply_process"] == 0.0, none.phases
    assert small.phases["dst_apply_process"] > 0.0  # the layers the small step changed were


def test_bf16_dense_tp2_refit(tmp_path_factory):
    spec, ckpt, llm = _model(tmp_path_factory, "dense")
    try:
        _, m, stale, err = _train_and_refit(spec, ckpt, llm, MegatronParallel(tp=2))
    finally:
        stop_engine(llm)
    assert m.verified and stale > err and err <= BF16


def test_refit_without_the_param_sync_is_caught(moe):
    """With the distributed optimizer over DP=2 and overlap_param_gather, each DP rank holds
    current values only for its own shard after optimizer.step(): a refit that reads the
    weights without forcing the gather sends stale boxes. verify=full (gathered after the
    sync) catches it; with the sync (the default, previous tests) it passes."""
    spec, ckpt, llm = moe
    with local_cluster(spec, ckpt, MegatronParallel(dp=2), VllmParallel(tp=1), CFG, train={"lr": 0.05},
                       engines=[llm], sync_before_refit=False) as c:
        c.refit_once()
        c.step(TOKENS)  # no forward after it: each DP rank's model holds the other shard stale
        with pytest.raises(RefitError, match="full verification"):
            c.refit_once()


def test_fp32_trainer_into_a_bf16_engine_casts_while_packing(moe, tmp_path):
    """fp32 source weights into a bf16 engine: the plan records every cast, the wire carries
    bf16 (bytes = the bf16 minimum), checksums compare the cast values; without
    refit.allow_cast it is a one-line error naming a tensor and both dtypes."""
    from dataclasses import replace

    from mcore_reshard.plan import PlanError

    _, ckpt, llm = moe
    spec32 = load_model_spec(ckpt, dtype="float32")
    with pytest.raises(PlanError, match=r"model\..* float32 .* bfloat16"):
        # (its trainer pool goes back to the cache and takes the next refit)
        with cluster(spec32, ckpt, MegatronParallel(tp=2), VllmParallel(tp=1), CFG, train={"lr": 0.05},
                     engines=[llm]):
            pass
    cast = replace(CFG, allow_cast=True)
    with cluster(spec32, ckpt, MegatronParallel(tp=2), VllmParallel(tp=1), cast, train={"lr": 0.05},
                 engines=[llm]) as c:
        plan = c.driver.plan
        assert plan.itemsize == 2 and plan.casts and all(f == "float32" and t == "bfloat16" for _, f, t in plan.casts)
        c.step(TOKENS)
        m = c.refit_once()
        assert m.verified and m.bytes_moved == plan.bytes_min
        assert c.logprob_error(TOKENS) <= BF16
