"""gpt-oss and GLM-4.5 live, as the other families run (fp32, tiny checkpoints written locally).

vLLM's CPU engine, started fresh on checkpoint B, holds what the family's table predicts (its
own loaders, recorded, equal the rules piece for piece) and serves transformers' logprobs on B.
It is then given A's weights; megatron-core trainers built from the table's config (gpt-oss:
biases everywhere, learnable softmax offsets as the sinks, every other layer windowed, the
clamped SwiGLU; GLM-4.5: q/k/v biases, qk-norm, partial RoPE, a dense first layer, a shared
expert, the sigmoid router with its expert bias), their live parameters checked against the
rules name by name, load B through their descriptors and refit the engine: it serves exactly
the logprobs of vLLM's own load of B, and megatron's forward is within the fp32 bound of it.
The trainers take an optimizer step and refit again, verified (checksums and ``verify=full``);
the trained weights, saved as an HF checkpoint, load into a fresh engine that serves
bit-identical logprobs. A bf16 GLM-4.5 policy widens its router weight on the way.
"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.engine import after_refit, describe, prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_rank_params
from mcore_reshard.infra.checkpoint import make_tiny_checkpoint
from mcore_reshard.jobs.refit import local_cluster, token_mult_prob_error
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.protocol import VerifyMode
from support.live import trained_checkpoint

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
FP32_BOUND = 1.001  # token_mult_prob_error, vLLM vs megatron's forward

#: (family, trainers, engine TP): TP2 x EP2 trainers (experts whole, split over EP) for
#: gpt-oss, whose expert biases megatron-core allows only with ETP 1; TP2 with expert-TP 2
#: for GLM-4.5 (every expert split by rows).
CASES = [("gpt_oss", MegatronParallel(tp=2, ep=2, etp=1), 2), ("glm4_moe", MegatronParallel(tp=2, etp=2), 1)]


def _hf_logprobs(ckpt, tokens):
    """transformers' logprobs of ``tokens`` (each after the ones before it) on ``ckpt``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1].float(), -1)
    return logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: (make_tiny_checkpoint(root / f"{fam}-a", family=fam, seed=21),
                  make_tiny_checkpoint(root / f"{fam}-b", family=fam, seed=22)) for fam, _, _ in CASES}


def _norm(view):
    return view.offset, view.shape, tuple(s if n > 1 else 0 for n, s in zip(view.shape, view.stride))


def _pieces(params):
    return ({(p.local_name, p.canonical, p.box, _norm(p.view)) for lp in params for p in lp.pieces},
            {lp.name: (tuple(lp.shape), lp.dtype) for lp in params})


@pytest.mark.parametrize("family, training, tp", CASES, ids=[c[0] for c in CASES])
def test_refit_trains_and_equals_vllms_own_load(ckpts, family, training, tp, engine_cache, tmp_path):
    a, b = ckpts[family]
    spec = load_model_spec(b, dtype="float32")
    llm = engine_cache.get(b, tp=tp, fresh=True)
    want = prompt_logprobs(llm, TOKENS)  # vLLM's own loader on B
    assert token_mult_prob_error(want, _hf_logprobs(b, TOKENS)) < FP32_BOUND  # and transformers' on B
    for params, info in zip(describe(llm), llm.collective_rpc("mr_rank_info")):
        assert _pieces(params) == _pieces(vllm_rank_params(spec, VllmParallel(tp=tp), info["rank"]))
    statuses = llm.collective_rpc("mr_load_canonical", args=(str(a),))
    assert all(s["state"] == "serving" for s in statuses), statuses
    after_refit(llm)
    assert prompt_logprobs(llm, TOKENS) != want  # A now
    with local_cluster(spec, b, training, VllmParallel(tp=tp), CFG, train={"lr": 0.01}, engines=[llm]) as c:
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        assert prompt_logprobs(llm, TOKENS) == want  # bit for bit vLLM's own load of B
        assert c.logprob_error(TOKENS) < FP32_BOUND  # megatron's forward of B: its modules are the family's
        c.step(TOKENS)
        second = c.refit_once()
        assert second.verified and second.at_minimum and any("full verification" in n for n in second.notes)
        trained = prompt_logprobs(llm, TOKENS)
        assert trained != want
        assert c.logprob_error(TOKENS) < FP32_BOUND
        saved = trained_checkpoint(c, spec, b, tmp_path / "trained")
    fresh = engine_cache.get(saved, tp=tp, fresh=True)
    assert prompt_logprobs(fresh, TOKENS) == trained  # a fresh engine on the trained checkpoint
    assert json.loads((saved / "config.json").read_text())["architectures"] == spec.hf_config["architectures"]


def test_glm_bf16_router_weight_widened_on_the_way(tmp_path):
    """A bf16 GLM-4.5 policy into a bf16 engine: vLLM holds the router weight in fp32 and
    megatron-core in bf16; the trainers widen it when they send it (the table's ``widened``),
    and it travels as fp32 bits beside the fp32 router bias. Verified with ``verify=full``, at
    the minimum bytes, within NeMo RL's bf16 bound."""
    ckpt = make_tiny_checkpoint(tmp_path / "glm-bf16", family="glm4_moe", seed=23, dtype="bfloat16")
    spec = load_model_spec(ckpt, dtype="bfloat16")
    with local_cluster(spec, ckpt, MegatronParallel(tp=2, etp=2), VllmParallel(tp=1), CFG, train={"lr": 0.01}) as c:
        m = c.refit_once()
        assert m.verified and m.at_minimum and any("full verification" in n for n in m.notes)
        carried = dict(c.driver.plan.reinterpret)
        assert carried["model.layers.1.mlp.gate.weight"] == carried["model.layers.1.mlp.gate.e_score_correction_bias"] \
            == "float32"
        assert c.logprob_error(TOKENS) < 1.05
        c.step(TOKENS)
        second = c.refit_once()
        assert second.verified and second.at_minimum and c.logprob_error(TOKENS) < 1.05


def test_a_bias_the_cpu_kernel_widens_is_written_in_model_format(tmp_path, shared_engine):
    """A bf16 Qwen2 engine (q/k/v biases): on a CPU with AMX tiles vLLM's GEMM keeps each
    small linear's bias in fp32 after loading, a tensor vLLM's reload leaves live. The worker
    describes it in model format (bf16, what the plan sends), stages it and converts it into
    the live fp32 tensor at the commit, streamed and atomic: the engine then serves exactly what
    vLLM's own load of the same checkpoint serves. (On a CPU without AMX nothing is widened and
    the same refits write the bias in place.)"""
    a = make_tiny_checkpoint(tmp_path / "qwen2-a", family="qwen2", seed=31, dtype="bfloat16")
    b = make_tiny_checkpoint(tmp_path / "qwen2-b", family="qwen2", seed=32, dtype="bfloat16")
    llm = shared_engine(b, tp=1, dtype="bfloat16", fresh=True)
    want, want_lp = llm.collective_rpc("mr_served_checksums")[0], prompt_logprobs(llm, TOKENS)
    bias = next(p for p in describe(llm)[0] if p.name.endswith("qkv_proj.bias"))
    assert bias.dtype == "bfloat16"  # model format, whatever the kernel holds
    for path, atomic in ((a, False), (b, False), (a, True), (b, True)):
        status = llm.collective_rpc("mr_load_canonical", args=(str(path),), kwargs={"atomic": atomic})[0]
        assert status["state"] == "serving", status
        after_refit(llm)
        if path == b:
            assert llm.collective_rpc("mr_served_checksums")[0] == want and prompt_logprobs(llm, TOKENS) == want_lp
        else:
            assert prompt_logprobs(llm, TOKENS) != want_lp
