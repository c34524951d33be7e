"""The two endpoints as a framework uses them: megatron ranks started by the test build a
``TrainerEndpoint`` themselves, and a plain ``vllm.LLM`` (no project worker extension) takes
the refit through vLLM's weight-transfer API with ``backend="mcore_reshard"``.

The trainer ranks run on the session's warm megatron world (``support.megatron``); the second
test's trainer pool is the session's fp32 TP2xEP2 pool (``conftest.py``). Each test starts
its own plain engine: both assert on what it serves before any refit."""

from __future__ import annotations

import threading

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import prompt_logprobs, stop_engine
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.wire.protocol import RankReport
from mcore_reshard.refit.verify import token_mult_prob_error
from support.live import cluster
from support.megatron import run_world

from _endpoint_jobs import endpoint_refit_job

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3]


@pytest.fixture(scope="module")
def plain_engine(tmp_path_factory):
    """A plain vLLM engine, as a framework starts one: only ``weight_transfer_config`` (no
    worker extension). Both tests below refit it; each holds for any weights it arrives with."""
    import os

    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("plain") / "tiny-moe", moe=True, seed=5)
    llm = LLM(model=str(ckpt), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=4, seed=0, weight_transfer_config={"backend": "mcore_reshard"})
    try:
        yield ckpt, llm
    finally:
        stop_engine(llm)


def test_plain_vllm_engine_refit_from_trainer_endpoints(plain_engine):
    import torch.multiprocessing as mp

    ckpt, llm = plain_engine
    manager = None
    try:
        before = prompt_logprobs(llm, TOKENS)
        manager = mp.get_context("spawn").Manager()  # its queue reaches ranks that are already running
        q = manager.Queue()
        out: dict = {}

        def trainers() -> None:
            try:
                out["ranks"] = run_world(endpoint_refit_job, 2, (str(ckpt), "float32", MegatronParallel(tp=2, ep=2, etp=1),
                                                                 VllmParallel(tp=1), TOKENS, q), timeout_s=600)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                out["error"] = exc

        t = threading.Thread(target=trainers)
        t.start()
        msg = q.get(timeout=600)  # the trainers' controller message: init info + the refit request
        llm.init_weight_transfer_engine({"init_info": msg["init_info"]})
        llm.start_weight_update()
        llm.update_weights({"update_info": msg["update_info"]})
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        t.join(timeout=600)
        assert "error" not in out, out.get("error")
        ranks = out["ranks"]
        reports = [RankReport.from_wire(r) for r in ranks[0]["reports"]]
        dst = [r for r in reports if r.side == "dst"]
        # every rank voted and reported through the refit group; the engine's rank is among them
        assert len(reports) == 3 and len(dst) == 1
        assert dst[0].verified and dst[0].bytes_received == ranks[0]["bytes_min"]
        after = prompt_logprobs(llm, TOKENS)
        assert token_mult_prob_error(after, ranks[0]["logprobs"]) < 1.001  # the trained weights are served
        assert token_mult_prob_error(before, ranks[0]["logprobs"]) > 1.01  # and they differ from the checkpoint
    finally:
        if manager is not None:
            manager.shutdown()


def test_driver_refits_an_engine_started_with_only_the_backend(ckpt_cache, plain_engine):
    """``RefitDriver`` drives an engine started with only ``weight_transfer_config``: it plans
    the engine's side from the rules (the engine checks its slice against what it records at
    init), and the refit's own outcome confirms it (no worker extension to ask)."""
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.settings.policy import RefitConfig

    ckpt = ckpt_cache.get(moe=True, seed=7)  # the trainers' checkpoint: not the engine's weights
    spec = load_model_spec(ckpt, dtype="float32")
    _, llm = plain_engine
    with cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1),
                 RefitConfig(timeout_s=60.0), train={"lr": 0.05}, engines=[llm]) as c:
        assert not c.driver.engine_infos[0].reports
        c.step(TOKENS)
        assert c.logprob_error(TOKENS) > 1.01  # the engine serves other weights, the trainers moved on
        m = c.refit_once()
        assert m.verified and m.at_minimum
        assert c.logprob_error(TOKENS) < 1.001
