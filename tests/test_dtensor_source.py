"""A DTensor policy as a refit source (``adapters/dtensor``): NeMo RL's DTensor backend builds
its policy as an HF model, tensor-parallel through ``parallelize_module`` and FSDP2-sharded
(``fully_shard``) over data parallelism. Its ranks refit a vLLM engine through vLLM's trainer
API (``TrainerShards(DTensorEndpoint(model, spec))``), each rank sending the boxes its local
shards hold -- read from their placements, never gathered -- and the engine ends bit for bit
where a fresh engine loading the trained weights starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from mcore_reshard.layout import load_model_spec

pytestmark = pytest.mark.slow  # spawned ranks and an engine

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64]


def _logprobs(llm) -> list[float]:
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs

    return prompt_logprobs(llm, TOKENS)


def test_an_fsdp2_and_tp_policy_refits_live_and_equals_a_fresh_engine(ckpt_cache, shared_engine, tmp_path: Path):
    """Four gloo ranks on a (dp=2, tp=2) mesh: FSDP2's ``Shard(0)`` over dp, TP's ``Shard`` on
    the projections, FSDP2's ``_StridedShard`` where both cut one dimension. Three refits of a
    TP1 engine, two AdamW steps between them: every refit verified by every rank of both sides
    and at the per-rank minimum; each piece is the box torch's own placement arithmetic gives;
    the engine serves, after the last, exactly what a fresh engine loading the trained weights
    serves (fp32), and differs from what it served before training."""
    from _dtensor_jobs import dtensor_trainer_api_job
    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
    from mcore_reshard.testing.worlds import run_world
    from mcore_reshard.testing.trainer_api import drive_trainer_api

    ckpt = ckpt_cache.get(family="qwen2", dtype="float32")
    llm = shared_engine(ckpt, tp=1)
    saved = tmp_path / "trained"
    info = {"engine_tp": 1, "timeout_s": 60.0, "bucket_bytes": 1 << 16}
    args = (str(ckpt), 2, 2, info, TOKENS, 3, str(saved))
    ranks, served = drive_trainer_api(
        llm, lambda queues: run_world(dtensor_trainer_api_job, 4, args + queues, timeout_s=600), lambda step: _logprobs(llm))

    spec = load_model_spec(ckpt, dtype="float32")
    rank3 = ranks[3]
    assert "_StridedShard(dim=0" in rank3["placements"]["model.layers.0.self_attn.q_proj.weight"]
    # rank 3 is (dp 1, tp 1): q_proj's rows [128, 256) are TP's second half, of which FSDP2's
    # second half is [192, 256)
    q = next(p for p in rank3["pieces"] if p[0] == "model.layers.0.self_attn.q_proj.weight")
    rows = spec.tensor_table()["model.layers.0.self_attn.q_proj.weight"][0][0]
    assert q[1][0] == 3 * rows // 4 and q[2][0] == rows // 4
    # every element of every canonical tensor is held by some rank, no rank holds more than its shard
    held = sum(math.prod(p[2]) for r in ranks for p in r["pieces"])
    total = sum(math.prod(shape) for shape, _ in spec.tensor_table().values())
    assert total <= held < 2 * total  # (norms are replicated over tp: held twice, sent once)
    received = []
    for reports in ranks[0]["reports"]:
        assert all(r[2] for r in reports) and len(reports) == 4 + 1  # 4 trainers + the engine's worker
        received.append(sum(r[3] for r in reports if r[0] == "dst"))
    # the first refit moves the minimum; the later ones (deltas) what the AdamW step changed, within it
    assert len(received) == 3 and received[0] == ranks[0]["bytes_min"] >= max(received[1:]) > 0
    assert served[1] != served[0] and served[2] != served[1]  # each step reached the engine
    fresh = start_engine(str(saved), tp=1)
    try:
        assert _logprobs(fresh) == served[2]  # bit for bit, fp32
    finally:
        stop_engine(fresh)


def test_replicas_that_drift_apart_refuse_the_refit_and_the_engine_keeps_its_weights(ckpt_cache, shared_engine,
                                                                                       tmp_path: Path):
    """Qwen3's per-head ``q_norm``/``k_norm`` under a TP plan that shards the attention heads
    stay plain parameters, replicated over the TP ranks, while each rank's gradient comes from
    its own heads: after one optimizer step the TP ranks hold different norms, and the policy is
    no longer one model. The first refit (before training) commits; the next is refused on
    every rank before a byte moves, in one line naming the parameters and the ranks, and the
    engine serves what it served before."""
    from _dtensor_jobs import dtensor_trainer_api_job
    from mcore_reshard.testing.worlds import run_world
    from mcore_reshard.testing.trainer_api import drive_trainer_api

    ckpt = ckpt_cache.get(family="qwen3", dtype="float32")
    llm = shared_engine(ckpt, tp=1)
    info = {"engine_tp": 1, "timeout_s": 60.0, "bucket_bytes": 1 << 16}
    args = (str(ckpt), 1, 2, info, TOKENS, 2, str(tmp_path / "trained"))
    ranks, served = drive_trainer_api(
        llm, lambda queues: run_world(dtensor_trainer_api_job, 2, args + queues, timeout_s=600), lambda step: _logprobs(llm))
    assert "failed" not in ranks[0] or 0 not in ranks[0]["failed"]
    for r in ranks:
        line = r["failed"][1]
        assert "replicated parameter(s) differ between the trainer ranks holding them" in line, line
        assert "self_attn.k_norm.weight" in line and "on ranks 0 and 1" in line and "\n" not in line
    assert served[1] == served[0]  # the refused refit changed nothing the engine serves



def test_layouts_that_cannot_be_described_are_refused_in_one_line(ckpt_cache):
    """Before anything is planned: a name that is not HF's, a global shape other than the
    canonical one, a Partial placement (a pending reduction) -- each one line naming the
    parameter and what is wrong. And a rank read while FSDP2 holds its root unsharded (after a
    forward-only pass) is refused in one line instead of sending the wrong rows."""
    from _dtensor_jobs import refusal_lines
    from mcore_reshard.testing.worlds import run_world

    ckpt = ckpt_cache.get(family="qwen2", dtype="float32")
    lines = run_world(refusal_lines, 2, (str(ckpt),), timeout_s=120)[0]
    assert all("\n" not in line for line in lines), lines
    assert "parameter model.layers.0.mlp.not_hf.weight: 'model.layers.0.mlp.not_hf.weight' is not a tensor" in lines[0]
    assert "parameter model.layers.0.mlp.down_proj.weight: global shape" in lines[1] and "but" in lines[1]
    assert "Partial" in lines[2] and "reduce it before a refit" in lines[2]
    assert lines[3].startswith("parameter model.embed_tokens.weight: its local tensor is") and \
        lines[3].endswith("(unsharded since it was described? call reshard() first)"), lines[3]
    assert lines[4] == ""  # resharded: every shard is its box again


def _pieces(layout) -> set:
    return {(q.rank, q.local_name, q.canonical, q.box, q.view.offset, q.view.shape)
            for p in layout.params for q in p.pieces}


def test_a_dtensor_policy_trains_and_refits_through_the_projects_driver(ckpt_cache, engine_cache, tmp_path: Path):
    """The GRPO loop's path (``RefitDriver`` over a pool of ``pool.DTensorTrainerRank``: NeMo RL's
    DTensor policy, FSDP2 x TP on a (dp=2, tp=2) gloo mesh, with the jobs' training calls): the
    live pieces are the rules' (``adapters.dtensor.rules``, what a dry run plans with); the first
    refit serves exactly vLLM's own load of the checkpoint; after an AdamW step and a
    forward-only pass (which leaves FSDP2's root unsharded) the next is verified element for
    element at the minimum, within fp32's bound of the policy's own logprobs, and a fresh
    engine on the trained weights serves bit for bit the same."""
    from mcore_reshard.adapters.dtensor import DTensorParallel
    from mcore_reshard.adapters.dtensor.rules import dtensor_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.wire.protocol import VerifyMode
    from support.live import trained_checkpoint

    ckpt = ckpt_cache.get(family="qwen2", dtype="float32")
    spec = load_model_spec(ckpt, dtype="float32")
    llm = engine_cache.get(ckpt, tp=1, fresh=True)
    want = _logprobs(llm)
    training = DTensorParallel(dp=2, tp=2)
    cfg = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
    with local_cluster(spec, ckpt, training, VllmParallel(tp=1), cfg, train={"lr": 0.01}, engines=[llm]) as c:
        assert _pieces(c.driver.src) == _pieces(dtensor_layout(spec, training))
        first = c.refit_once()
        assert first.verified and first.at_minimum and any("full verification" in n for n in first.notes)
        assert _logprobs(llm) == want
        assert c.logprob_error(TOKENS) < 1.001
        c.step(TOKENS)
        # a forward-only pass between the step and the refit (a logprob computation, the canary's
        # reference) leaves FSDP2's root parameters unsharded: the refit reshards them first
        assert c.logprob_error(TOKENS) > 1.001
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        trained = _logprobs(llm)
        assert trained != want and c.logprob_error(TOKENS) < 1.001
        saved = trained_checkpoint(c, spec, ckpt, tmp_path / "trained")
    fresh = engine_cache.get(saved, tp=1, fresh=True)
    assert _logprobs(fresh) == trained
