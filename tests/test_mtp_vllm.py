"""Speculative decoding's MTP draft, live on this CPU: a tiny DeepSeek-V3 with one MTP layer,
served with ``speculative_config={"method": "mtp"}`` (vLLM's ``EagleProposer`` over
``DeepSeekMTP``).

- vLLM's own draft holds exactly the draft parameters the layout describes
  (``adapters/vllm/mtp_rules.py``), besides the target's embedding and output head, which it
  shares (so a refit moves them once).
- A megatron-core policy built with its MTP block trains, and one refit moves the target and the
  draft in one vote: the draft's acceptance, about 0 on the random checkpoint and after a
  target-only refit, is high after the joint one; greedy outputs are the target's either way;
  the draft equals, tensor for tensor, a fresh engine's that loads the trained checkpoint.
"""

from __future__ import annotations

import shutil

import pytest

from mcore_reshard.adapters.vllm.mtp_rules import vllm_draft_rank_params
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.layout import load_model_spec

pytestmark = pytest.mark.slow

SPEC = {"method": "mtp", "num_speculative_tokens": 1}
#: A period-8 token pattern the policy learns (target: the next token; MTP: the one after).
PATTERN = [(5 + 37 * i) % 900 + 20 for i in range(8)]


#: The drafting engine's arguments (``engine_cache``: test_trainer_api's MTP case shares it).
MTP_ENGINE = {"speculative_config": SPEC, "disable_log_stats": False}


@pytest.fixture(scope="module")
def engine(ckpt_cache, engine_cache):
    ckpt = ckpt_cache.get(family="deepseek_v3", dtype="float32", overrides={"num_nextn_predict_layers": 1})
    llm = engine_cache.get(ckpt, tp=1, dtype="float32", engine_args=MTP_ENGINE)
    yield ckpt, load_model_spec(ckpt, dtype="float32"), llm
    engine_cache.check(llm)


def test_vllm_mtp_draft_holds_what_the_draft_layout_says(engine):
    from vllm import SamplingParams

    ckpt, spec, llm = engine
    assert spec.mtp_layers == 1
    want = {p.name: p.shape for p in vllm_draft_rank_params(spec, VllmParallel(tp=1), 0)}
    if True:
        out = llm.generate([{"prompt_token_ids": [11, 42, 7, 99, 123, 5]}],
                           SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4  # it drafts and verifies
        (got,) = llm.collective_rpc("mr_draft_layout")
        assert got["shares_embed"] and got["shares_head"]
        L = spec.num_layers
        shared = {"model.embed_tokens.weight", f"model.layers.{L}.shared_head.head.weight", "lm_head.weight"}
        # MLA's absorbed W_UK_T / W_UV are derived from kv_b_proj after loading (refit: re-absorbed)
        derived = {n for n in got["params"] if n.endswith(("W_UV", "W_UK_T"))}
        assert set(got["params"]) - shared - derived == set(want)
        for name, shape in want.items():
            held = tuple(got["params"][name])
            assert held == tuple(shape) or held == (0,), (name, held, shape)  # (0,): repacked by the CPU kernel
        for name in (f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight",
                     f"model.layers.{L}.mtp_block.mlp.experts.routed_experts.w13_weight"):
            assert tuple(got["params"][name]) == tuple(want[name]), name  # model format: compared exactly


def _counters(llm) -> tuple[float, float]:
    """vLLM's spec-decode counters: (accepted, drafted) tokens so far."""
    got = {m.name: m.value for m in llm.get_metrics()
           if m.name in ("vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_draft_tokens")}
    return got["vllm:spec_decode_num_accepted_tokens"], got["vllm:spec_decode_num_draft_tokens"]


def _acceptance(llm) -> tuple[float, list[list[int]]]:
    """Draft acceptance over greedy continuations of the pattern (as vLLM reports it), and them."""
    from vllm import SamplingParams

    a0, d0 = _counters(llm)
    prompts = [{"prompt_token_ids": (PATTERN * 3)[s:s + 8]} for s in range(4)]
    out = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    a1, d1 = _counters(llm)
    assert d1 > d0
    return (a1 - a0) / (d1 - d0), [list(o.outputs[0].token_ids) for o in out]


def test_target_and_draft_refit_in_one_vote_and_keep_the_drafts_acceptance(engine, tmp_path):
    from dataclasses import replace

    import torch
    from safetensors.torch import save_file

    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs, start_engine, stop_engine
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.layout.mtp import draft_tensors
    from mcore_reshard.refit.driver import RefitDriver
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.transport.views import gather_canonical
    from mcore_reshard.wire.faults import EngineFault, Fault, Faults
    from mcore_reshard.wire.protocol import VerifyMode

    ckpt, spec, llm = engine
    with local_cluster(spec, ckpt, MegatronParallel(tp=1), VllmParallel(tp=1), RefitConfig(timeout_s=60.0),
                       train={"lr": 0.01}, engines=[llm], speculative_config=SPEC) as c:
        d = c.driver
        drafts = {p.name.removeprefix("draft."): p for p in d.dst.params if p.name.startswith("draft.")}
        rules = {p.name: p for p in vllm_draft_rank_params(spec, VllmParallel(tp=1), 0)}
        assert drafts and set(drafts) <= set(rules)  # recorded with vLLM's own loader: what the rules say
        assert all(drafts[n].pieces[0].box == rules[n].pieces[0].box for n in drafts)
        assert set(draft_tensors(spec)) - {t.canonical for t in d.plan.transfers} == set()  # one plan: both
        before, _ = _acceptance(llm)  # the random checkpoint's draft
        for _ in range(40):  # the policy (and its MTP block) learns the pattern
            c.pool.train_step([(PATTERN * 4)[s:s + 24] for s in (0, 3)]).wait()

        # the target only, for contrast: the trained target with the checkpoint's draft
        mtp = set(draft_tensors(spec))
        src = replace(d.src, params=tuple(p for p in d.src.params if not {q.canonical for q in p.pieces} & mtp),
                      tensors=spec.tensor_table())
        dst = replace(d.dst, params=tuple(p for p in d.dst.params if not p.name.startswith("draft.")),
                      tensors=spec.tensor_table())
        only = RefitDriver(c.pool, [llm], c.refit, spec, src=src, dst=dst)
        try:
            only.__enter__()
            assert only.refit().verified
        finally:
            only.close()
        stale, stale_out = _acceptance(llm)

        d.disconnect()  # the job's driver: target and draft in one refit, one vote
        m = d.refit(replace(d.request(), verify=VerifyMode.FULL))
        assert m.verified and m.at_minimum
        joint, joint_out = _acceptance(llm)
        # how well 40 steps teach the pattern depends on the CPU's fp32 kernels (above 0.8 on AMD
        # EPYC, 0.77 on an AMX Xeon); the draft's own canary checks its numbers to fp32's bound
        assert before < 0.5 and stale < 0.5 and joint > 0.7 and joint - stale > 0.5, (before, stale, joint)
        assert joint_out == stale_out  # a draft changes how fast, never what: greedy is the target's
        assert joint_out[0] == (PATTERN * 4)[8:24]  # ...which is the learnt pattern
        # ...and each greedy token is the trainer's argmax (the target without a draft)
        seq = (PATTERN * 3)[0:8] + joint_out[0]
        lp = c.pool.logprobs([seq]).wait()[0][0]
        assert all(v > -0.5 for v in lp[7:]), lp  # p > 0.6: each is the trainer's argmax, drafting off

        # a refit that fails for the draft keeps both old: a bit flipped where a draft box landed
        served = llm.collective_rpc("mr_draft_checksums")[0]
        served_lp = prompt_logprobs(llm, (PATTERN * 3)[:16])
        c.pool.train_step([(PATTERN * 4)[s:s + 24] for s in (1, 5)]).wait()
        with pytest.raises(RefitFailed, match="checksum"):
            d.refit(replace(d.request(), delta="off"),  # whole boxes: the flip lands in one
                    faults=Faults(engine=EngineFault(0, Fault(tensor="draft.model.layers.4.eh_proj.weight"))))
        assert llm.collective_rpc("mr_draft_checksums")[0] == served  # the draft...
        assert prompt_logprobs(llm, (PATTERN * 3)[:16]) == served_lp  # ...and the target, both old
        assert _greedy(llm, enqueue=True) == joint_out  # on the engine's queue too (another client)
        pending = d.begin_refit()  # overlapped: the old pair serves while the new one arrives
        assert _greedy(llm) == joint_out
        assert pending.finish().verified
        assert llm.collective_rpc("mr_draft_checksums")[0] != served  # the draft moved with the target
        joint_out = _greedy(llm)

        # a fresh engine that loads the trained checkpoint holds the same draft, tensor for tensor
        canon = gather_canonical(d.src.params, d.src.tensors, c.pool.local_tensors().wait())
        L = spec.num_layers
        canon[f"model.layers.{L}.embed_tokens.weight"] = canon["model.embed_tokens.weight"]
        canon[f"model.layers.{L}.shared_head.head.weight"] = canon["lm_head.weight"]
        out = tmp_path / "trained"
        out.mkdir()
        shutil.copy(ckpt / "config.json", out / "config.json")
        save_file({n: t.contiguous().clone() for n, t in canon.items()}, str(out / "model.safetensors"))
        served = llm.collective_rpc("mr_draft_checksums")[0]
        fresh = start_engine(str(out), tp=1, dtype="float32", speculative_config=SPEC)
        try:
            assert fresh.collective_rpc("mr_draft_checksums")[0] == served
            assert _greedy(fresh) == joint_out
        finally:
            stop_engine(fresh)


def _greedy(llm, enqueue: bool = False) -> list[list[int]]:
    """Greedy continuations of the pattern, through ``generate`` or ``enqueue`` + ``wait_for_completion``."""
    import threading

    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": (PATTERN * 3)[s:s + 8]} for s in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    if not enqueue:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.enqueue(prompts, params, use_tqdm=False)
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(out=llm.wait_for_completion(use_tqdm=False)), daemon=True)
    waiter.start()
    waiter.join(60)
    assert "out" in got, "enqueued requests did not complete"
    return [list(o.outputs[0].token_ids) for o in got["out"]]  # in request order, as vLLM sorts them


def test_the_canary_checks_the_draft_and_refuses_a_stale_one(engine):
    """With ``refit.canary`` on, a drafting engine's canary checks its MTP draft too: the
    drafter's log-probs two tokens ahead, on the target's hidden states of the canary's
    sequences, against megatron's MTP head (``draft_top_logprobs``), inside the same vote.
    Correct refits across training pass it. A draft whose post-load processing is skipped for
    one layer (its bytes right, its kernel stale) leaves every target logprob as it is --
    speculative decoding is lossless -- yet fails the refit, and the old target and draft stay
    served."""
    from dataclasses import replace

    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs
    from mcore_reshard.errors import RefitFailed
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.settings.policy import RefitConfig
    from mcore_reshard.wire.faults import EngineFault, Faults

    ckpt, spec, llm = engine
    cfg = RefitConfig(timeout_s=60.0, canary=True)
    with local_cluster(spec, ckpt, MegatronParallel(tp=1), VllmParallel(tp=1), cfg, train={"lr": 0.01},
                       engines=[llm], speculative_config=SPEC) as c:
        d = c.driver
        assert d.request().canary.draft
        for s in (0, 2):
            c.pool.train_step([(PATTERN * 4)[s:s + 24]]).wait()
            m = d.refit()
            assert m.verified and m.phases["dst_canary"] > 0
        served = llm.collective_rpc("mr_draft_checksums")[0]
        served_lp = prompt_logprobs(llm, (PATTERN * 3)[:16])
        served_out = _greedy(llm)
        stale = next(p.name for p in d.dst.params if p.name.startswith("draft.") and p.name.endswith("o_proj.weight"))
        c.pool.train_step([(PATTERN * 4)[1:25]]).wait()
        with pytest.raises(RefitFailed, match=r"draft canary \d of 2 .*token_mult_prob_error [0-9.]+ > bound 1\.001"):
            d.refit(replace(d.request(), delta="off"), faults=Faults(engine=EngineFault(0, skip_processing=stale)))
        assert llm.collective_rpc("mr_draft_checksums")[0] == served
        assert prompt_logprobs(llm, (PATTERN * 3)[:16]) == served_lp
        assert _greedy(llm, enqueue=True) == served_out  # the engine's queue (another client) serves the old pair
        m = d.refit()  # the same weights, processed: passes
        assert m.verified and llm.collective_rpc("mr_draft_checksums")[0] != served
