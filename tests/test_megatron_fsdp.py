"""Megatron-FSDP (``use_megatron_fsdp``; NeMo RL's ``use_custom_fsdp``) as a refit source, live
on gloo: megatron-core's own FSDP wrapper (``FullyShardedDataParallel`` around ``MegatronFSDP``,
``optim_grads_params``) with its optimizer, on CPU through ``runtime.apply_fsdp_cpu_patches``.

Each rank holds whole rows of each parameter's TP-local tensor (its slice of a flat bucket);
megatron's rules cut to those rows describe it (``layout.rows``), checked name by name and
shape by shape against the live slices. The refit draws each element from the one rank that
holds it: every refit verified (checksums and ``verify=full``) at the per-rank minimum, the
first one serving exactly vLLM's own load of the checkpoint, and after optimizer steps
exactly what a fresh engine loading the trained weights serves (fp32).
"""

from __future__ import annotations

import math

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.engine import prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from support.live import trained_checkpoint

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
FP32_BOUND = 1.001  # token_mult_prob_error, vLLM vs megatron's forward

#: (model, trainers): a dense model under TP2 x DP2 (both cuts of a projection), the MoE under
#: EP2 x DP2 (dense parameters sharded over DP, experts over the expert-DP group). Megatron-FSDP
#: does not compose with pipeline parallelism (``test_fsdp_layouts``).
CASES = [(False, MegatronParallel(tp=2, dp=2, fsdp=True)), (True, MegatronParallel(tp=1, ep=2, etp=1, dp=2, fsdp=True))]


def _pieces(layout) -> set:
    """Every rank's pieces, views normalised (a size-1 dimension's stride is arbitrary)."""
    return {(q.rank, q.local_name, q.canonical, q.box, q.view.offset,
             tuple(s if n > 1 else 0 for n, s in zip(q.view.shape, q.view.stride)))
            for p in layout.params for q in p.pieces}


def _held(src) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in src.params:
        for q in p.pieces:
            out[q.canonical] = out.get(q.canonical, 0) + q.numel
    return out


@pytest.mark.parametrize("moe, training", CASES, ids=["dense-tp2-dp2", "moe-ep2-dp2"])
def test_a_megatron_fsdp_policy_refits_from_each_ranks_rows(ckpt_cache, engine_cache, moe, training, tmp_path):
    ckpt = ckpt_cache.get(moe=moe, dtype="float32", seed=31)
    spec = load_model_spec(ckpt, dtype="float32")
    llm = engine_cache.get(ckpt, tp=1, fresh=True)
    want = prompt_logprobs(llm, TOKENS)  # vLLM's own load of the checkpoint
    with local_cluster(spec, ckpt, training, VllmParallel(tp=1), CFG, train={"lr": 0.01}, engines=[llm]) as c:
        # the live slices (read from Megatron-FSDP's buffers) are the rules' prediction of them
        assert _pieces(c.driver.src) == _pieces(megatron_layout(spec, training))
        held = _held(c.driver.src)
        # every data-parallel rank holds rows of its own: no parameter is held whole by two ranks
        # of one TP position (norms are replicated over TP only)
        tp_copies = {n: training.tp if len(shape) == 1 else 1 for n, (shape, _) in spec.tensor_table().items()}
        assert held == {n: tp_copies[n] * math.prod(shape) for n, (shape, _) in spec.tensor_table().items()}
        first = c.refit_once()
        assert first.verified and first.at_minimum and any("full verification" in n for n in first.notes)
        assert prompt_logprobs(llm, TOKENS) == want  # the checkpoint, bit for bit
        assert c.logprob_error(TOKENS) < FP32_BOUND  # megatron-FSDP's own forward (its all-gather)
        for _ in range(2):
            c.step(TOKENS)
            m = c.refit_once()
            assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        trained = prompt_logprobs(llm, TOKENS)
        assert trained != want
        assert c.logprob_error(TOKENS) < FP32_BOUND
        saved = trained_checkpoint(c, spec, ckpt, tmp_path / "trained")
    fresh = engine_cache.get(saved, tp=1, fresh=True)
    assert prompt_logprobs(fresh, TOKENS) == trained  # a fresh engine on the trained weights


def test_a_bf16_megatron_fsdp_policy_refits_its_model_weights(ckpt_cache):
    """Under mixed precision Megatron-FSDP keeps two slices of every parameter: the bf16 model
    weights a forward gathers and the fp32 main weights the optimizer steps. The refit sends
    the model weights (bf16, the engine's dtype: at 2 bytes an element, the minimum), each
    refit after a step verified element for element and within NeMo RL's bf16 bound of
    Megatron-FSDP's own forward."""
    from mcore_reshard.jobs.refit import TOKEN_MULT_PROB_BOUND

    ckpt = ckpt_cache.get(dtype="bfloat16", seed=31)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    with local_cluster(spec, ckpt, MegatronParallel(dp=2, fsdp=True), VllmParallel(tp=1), CFG,
                       train={"lr": 0.01}) as c:
        first = c.refit_once()
        assert first.verified and first.at_minimum and c.driver.plan.itemsize == 2
        c.step(TOKENS)
        stale = c.logprob_error(TOKENS)
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        assert stale > c.logprob_error(TOKENS) and c.logprob_error(TOKENS) <= TOKEN_MULT_PROB_BOUND["bfloat16"]
