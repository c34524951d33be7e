"""Vision-language policies live: megatron-core's LLaVA (a CLIP tower, an MLP projector and a
Llama language model, TP2) refits into vLLM's LLaVA on the CPU engine (TP1 with vLLM's repacked
linears, TP2 with model-format linears), images and text alike.

- The engine holds what the family's table predicts (its own loader's parameters, recorded,
  equal the rules piece for piece), and megatron's trainers are checked against the rules name
  by name when they describe themselves.
- Given another checkpoint's weights first, the engine is refit to B: image+text prompt
  logprobs equal vLLM's own load of B bit for bit, and megatron's forward of B (its tower, its
  projector, the image spliced in at the placeholder) within the fp32 bound.
- Two optimizer steps with the tower trainable, a refit verified (checksums and
  ``verify=full``) at the minimum; the trained weights as an HF checkpoint load into a fresh
  engine that serves bit-identical image+text logprobs, and (model-format engine) whose every
  tower and projector parameter equals the refitted engine's, tensor for tensor.
- The encoder cache: the same image is sent before and after each refit; after a refit that
  changed the tower its logprobs are the new weights' (a stale encoder output would differ).
"""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import after_refit, describe, prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_rank_params
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.infra.vlm import colour_squares
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from support.live import trained_checkpoint

pytestmark = pytest.mark.slow

IMAGE_TOKEN = 999  # the tiny LLaVA's image_token_index
TOKENS = [11, IMAGE_TOKEN, 42, 7, 99, 123, 5, 77]  # one placeholder: vLLM's processor expands it per patch
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
FP32_BOUND = 1.001
TOWER = ("vision_tower.", "multi_modal_projector.")


def _image():
    return colour_squares(28, [("red", 2, 2, 10), ("blue", 15, 15, 8)])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    return make_tiny_checkpoint(root / "a", family="llava", seed=31), make_tiny_checkpoint(root / "b", family="llava", seed=32)


def _norm(view):
    return view.offset, view.shape, tuple(s if n > 1 else 0 for n, s in zip(view.shape, view.stride))


def _pieces(params):
    return ({(p.local_name, p.canonical, p.box, _norm(p.view)) for lp in params for p in lp.pieces},
            {lp.name: (tuple(lp.shape), lp.dtype) for lp in params})


@pytest.mark.parametrize("tp, direct", [(1, False), (2, True)], ids=["vllm-tp1-repacked", "vllm-tp2-direct"])
def test_llava_refit_trains_and_equals_vllms_own_load(ckpts, tp, direct, engine_cache, tmp_path):
    a, b = ckpts
    spec = load_model_spec(b, dtype="float32")
    image = _image()
    llm = engine_cache.get(b, tp=tp, fresh=True, direct=direct)
    want = prompt_logprobs(llm, TOKENS, image=image)  # vLLM's own loader on B (the image encoded under B)
    assert len(want) == len(TOKENS) - 1 + spec.vision.patches - 1
    for params, info in zip(describe(llm), llm.collective_rpc("mr_rank_info")):
        assert _pieces(params) == _pieces(vllm_rank_params(spec, VllmParallel(tp=tp), info["rank"]))
        assert any(p.name.startswith("vision_tower.") for p in params)
    statuses = llm.collective_rpc("mr_load_canonical", args=(str(a),))
    assert all(s["state"] == "serving" for s in statuses), statuses
    after_refit(llm)
    on_a = prompt_logprobs(llm, TOKENS, image=image)  # the same image, now encoded under A's tower
    assert on_a != want
    with local_cluster(spec, b, MegatronParallel(tp=2), VllmParallel(tp=tp), CFG, train={"lr": 0.01},
                       engines=[llm]) as c:
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        assert prompt_logprobs(llm, TOKENS, image=image) == want  # B's tower again: no encoder output of A's
        assert c.logprob_error(TOKENS, image) < FP32_BOUND  # megatron's LLaVA forward of B
        losses = [c.step(TOKENS, image=image) for _ in range(2)]
        assert losses[1] < losses[0]
        second = c.refit_once()
        assert second.verified and second.at_minimum and any("full verification" in n for n in second.notes)
        trained = prompt_logprobs(llm, TOKENS, image=image)
        assert trained != want
        assert c.logprob_error(TOKENS, image) < FP32_BOUND
        saved = trained_checkpoint(c, spec, b, tmp_path / "trained")
    refitted = llm.collective_rpc("mr_param_checksums")  # (the cache stops this engine for the next)
    fresh = engine_cache.get(saved, tp=tp, fresh=True, direct=direct)
    assert prompt_logprobs(fresh, TOKENS, image=image) == trained  # a fresh engine on the trained weights
    if direct:  # model-format linears: the tower and the projector, tensor for tensor
        for ours, theirs in zip(refitted, fresh.collective_rpc("mr_param_checksums")):
            tower = {n for n in theirs if n.startswith(TOWER)}
            assert tower and all(theirs[n] is not None for n in tower)
            assert {n: ours[n] for n in tower} == {n: theirs[n] for n in tower}


@pytest.mark.parametrize("projector", [False, True], ids=["tower-frozen", "tower-and-projector-frozen"])
def test_a_frozen_tower_is_sent_once_and_checked(ckpts, projector, engine_cache, tmp_path):
    """``freeze_vision_model`` (and ``freeze_vision_projection``): the first refit moves the
    tower, every later one plans without it; the engines' encoder cache is dropped only when
    a refit changes what the encoder computes with (the projector). An engine whose tower was
    reloaded behind the driver's back is refused in one line before anything moves."""
    from mcore_reshard.errors import RefitFailed

    a, b = ckpts
    spec = load_model_spec(b, dtype="float32")
    frozen = spec.frozen_tensors(vision_model=True, vision_projection=projector)
    image = _image()
    llm = engine_cache.get(a, tp=1, fresh=True)  # A's weights: the first refit must bring B's tower
    prompt_logprobs(llm, TOKENS, image=image)  # A's encoder output cached
    train = {"lr": 0.01, "freeze_vision_model": True, "freeze_vision_projection": projector}
    with local_cluster(spec, b, MegatronParallel(tp=2), VllmParallel(tp=1), CFG, train=train, engines=[llm]) as c:
        plans = c.driver.plans
        assert frozen and plans.frozen_plan is not None and c.driver.plan is plans.plan
        first = c.refit_once()
        assert first.verified and first.at_minimum and first.bytes_moved == plans.plan.bytes_min
        assert c.logprob_error(TOKENS, image) < FP32_BOUND
        c.step(TOKENS, image=image)
        assert c.driver.plan is plans.frozen_plan  # from now on: no tower
        assert not any(t.canonical in frozen for t in plans.frozen_plan.transfers)
        assert c.driver.request().encoders is not projector  # a trainable projector: the encoder's output changes
        second = c.refit_once()
        assert second.verified and second.at_minimum and second.bytes_moved == plans.frozen_plan.bytes_min
        assert second.bytes_moved < first.bytes_moved
        trained = prompt_logprobs(llm, TOKENS, image=image)
        assert c.logprob_error(TOKENS, image) < FP32_BOUND
        saved = trained_checkpoint(c, spec, b, tmp_path / "trained")

        # The engine reloaded behind the driver's back (A's tower): refused before anything moves.
        statuses = llm.collective_rpc("mr_load_canonical", args=(str(a),))
        assert all(s["state"] == "serving" for s in statuses), statuses
        after_refit(llm)
        before = prompt_logprobs(llm, TOKENS, image=image)
        with pytest.raises(RefitFailed, match=r"frozen vision tower: engine 0 may not hold the tower the trainers hold"):
            c.refit_once()
        assert prompt_logprobs(llm, TOKENS, image=image) == before
        c.driver.resend_frozen()
        third = c.refit_once()
        assert third.verified and third.bytes_moved == plans.plan.bytes_min
        assert prompt_logprobs(llm, TOKENS, image=image) == trained
    fresh = engine_cache.get(saved, tp=1, fresh=True)
    assert prompt_logprobs(fresh, TOKENS, image=image) == trained


def test_an_image_encoded_before_a_refit_is_encoded_again_after(ckpts, engine_cache, monkeypatch):
    """The encoder cache is keyed by weight version: the same image sent before and after a
    refit that changed the tower gets the new tower's logprobs, equal to a fresh engine's on the
    new weights. With the drop patched out, the engine would serve the old tower's encoding of
    it (shown: what the drop prevents)."""
    import mcore_reshard.adapters.vllm.destination as destination

    a, b = ckpts
    spec = load_model_spec(a, dtype="float32")
    image = _image()
    want = prompt_logprobs(engine_cache.get(a, tp=1, fresh=True), TOKENS, image=image)  # vLLM's own load of A
    llm = engine_cache.get(b, tp=1, fresh=True)
    assert prompt_logprobs(llm, TOKENS, image=image) != want  # B's encoding of the image, cached
    with local_cluster(spec, a, MegatronParallel(tp=2), VllmParallel(tp=1), CFG, engines=[llm]) as c:
        with monkeypatch.context() as m:
            m.setattr(destination, "reset_encoder_cache", lambda engine: None)
            assert c.driver.request().encoders
            c.refit_once()
            assert prompt_logprobs(llm, TOKENS, image=image) != want  # A's text model, B's encoding: stale
        c.refit_once()  # the same weights again, the encoder cache dropped this time
        assert prompt_logprobs(llm, TOKENS, image=image) == want


def test_the_async_engine_drops_the_encoder_cache_too(ckpts, tmp_path):
    """vLLM's AsyncLLM (the engine behind ``vllm serve``) refit from megatron's LLaVA: after a
    step that changed the tower, the image sent before the refit is encoded again under the
    new tower -- its logprobs within the fp32 bound of megatron's forward of the new weights,
    where the old tower's cached encoding would be off by the step."""
    a, b = ckpts
    spec = load_model_spec(b, dtype="float32")
    image = _image()
    with local_cluster(spec, b, MegatronParallel(tp=2), VllmParallel(tp=1), CFG, train={"lr": 0.05},
                       async_engine=True) as c:
        (llm,) = c.engines
        c.refit_once()
        before = prompt_logprobs(llm, TOKENS, image=image)  # the image encoded, cached
        assert c.logprob_error(TOKENS, image) < FP32_BOUND
        c.step(TOKENS, image=image)
        assert c.driver.request().encoders
        m = c.refit_once()
        assert m.verified and m.at_minimum
        assert prompt_logprobs(llm, TOKENS, image=image) != before
        assert c.logprob_error(TOKENS, image) < FP32_BOUND
