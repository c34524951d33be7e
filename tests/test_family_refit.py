"""gpt-oss and GLM-4.5 live, as the other families run (fp32, tiny checkpoints written locally).

megatron-core builds each family's real modules on CPU (gpt-oss: biases everywhere, learnable
softmax offsets as the sinks, every other layer windowed, the clamped SwiGLU; GLM-4.5: q/k/v
biases, qk-norm, partial RoPE, a dense first layer, a shared expert, the sigmoid router with
its expert bias): its parameters are what the family's table predicts, rank by rank, and a
checkpoint loaded through them gives transformers' logits.

vLLM's CPU engine, started fresh on checkpoint B, is what the table predicts too (its own
loaders, recorded, equal the rules piece for piece). It is then given A's weights; trainers
loaded from B refit it: it serves exactly the logprobs of vLLM's own load of B. The trainers
take an optimizer step and refit again, verified (checksums and ``verify=full``), within the
fp32 bound of megatron's own forward; the trained weights, saved as an HF checkpoint, load into
a fresh engine that serves bit-identical logprobs.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_rank_params
from mcore_reshard.adapters.vllm.engine import after_refit, describe, prompt_logprobs
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_rank_params
from mcore_reshard.infra.checkpoint import checkpoint_form, make_tiny_checkpoint
from mcore_reshard.jobs.refit import local_cluster
from mcore_reshard.layout import load_model_spec
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.transport.views import local_view
from mcore_reshard.wire.protocol import VerifyMode
from support.megatron import run_world

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3, 250, 17, 901, 46]
CFG = RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0, verify=VerifyMode.FULL)
FP32_BOUND = 1.001  # token_mult_prob_error, vLLM vs megatron's forward

#: (family, trainers, engine TP): TP2 x EP2 trainers (experts whole, split over EP) for
#: gpt-oss, whose expert biases megatron-core allows only with ETP 1; TP2 with expert-TP 2
#: for GLM-4.5 (every expert split by rows).
CASES = [("gpt_oss", MegatronParallel(tp=2, ep=2, etp=1), 2), ("glm4_moe", MegatronParallel(tp=2, etp=2), 1)]


def _megatron_job(ctx, par, ckpt, tokens):
    """Build the family's model, describe it (checked against the live parameters), load the
    checkpoint through the descriptors, run a forward."""
    from mcore_reshard.adapters.megatron.build import build_gpt, init_megatron
    from mcore_reshard.adapters.megatron.live import describe as describe_live, named_local_params
    from mcore_reshard.adapters.megatron.train import forward_logits
    from mcore_reshard.infra.checkpoint import load_canonical
    from mcore_reshard.transport.views import write_pieces

    spec = load_model_spec(ckpt, dtype="float32")
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    chunks = build_gpt(spec, par, dtype="float32")
    descs = describe_live(chunks, spec)
    tensors = load_canonical(ckpt)
    params = named_local_params(chunks)
    with torch.no_grad():
        for lp in descs:
            params[lp.name].data.zero_()
            write_pieces(params[lp.name].data, lp.pieces, tensors)
    chunks[0].eval()
    with torch.no_grad():
        logits = forward_logits(chunks[0], torch.tensor([tokens]), spec.vocab)[0]
    return dict(rank=ctx.rank, descs=descs, names=sorted(params), logits=logits)


def _hf_logits(ckpt, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: (make_tiny_checkpoint(root / f"{fam}-a", family=fam, seed=21),
                  make_tiny_checkpoint(root / f"{fam}-b", family=fam, seed=22)) for fam, _, _ in CASES}


@pytest.mark.parametrize("family, par, _", CASES, ids=[c[0] for c in CASES])
def test_megatron_builds_the_table_and_gives_hf_logits(ckpts, family, par, _):
    a, _b = ckpts[family]
    results = run_world(_megatron_job, par.world_size, (par, str(a), TOKENS), timeout_s=240)
    spec = load_model_spec(a, dtype="float32")
    want = _hf_logits(a, TOKENS)
    for res in results:
        assert res["descs"] == megatron_rank_params(spec, par, res["rank"])
        assert {d.name for d in res["descs"]} == set(res["names"])
        torch.testing.assert_close(res["logits"], want, rtol=1e-4, atol=5e-5)


def _norm(view):
    return view.offset, view.shape, tuple(s if n > 1 else 0 for n, s in zip(view.shape, view.stride))


def _pieces(params):
    return ({(p.local_name, p.canonical, p.box, _norm(p.view)) for lp in params for p in lp.pieces},
            {lp.name: (tuple(lp.shape), lp.dtype) for lp in params})


def _trained_checkpoint(c, spec, like, out):
    """The trainers' weights now, assembled from every rank's pieces as an HF checkpoint
    (the table's shapes reshaped back to the checkpoint's) beside ``like``'s config."""
    from safetensors.torch import save_file

    local = c.pool.local_tensors().wait()
    canon = {n: torch.empty(shape, dtype=torch.float32) for n, (shape, _) in spec.tensor_table().items()}
    for p in c.driver.src.params:
        for pc in p.pieces:
            box = tuple(slice(o, o + n) for o, n in zip(pc.box.offsets, pc.box.sizes))
            canon[pc.canonical][box] = local_view(local[p.rank][p.name], pc.view)
    out.mkdir()
    shutil.copy(like / "config.json", out / "config.json")
    save_file({n: t.contiguous() for n, t in checkpoint_form(canon, spec).items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("family, training, tp", CASES, ids=[c[0] for c in CASES])
def test_refit_trains_and_equals_vllms_own_load(ckpts, family, training, tp, engine_cache, tmp_path):
    a, b = ckpts[family]
    spec = load_model_spec(b, dtype="float32")
    llm = engine_cache.get(b, tp=tp, fresh=True)
    want = prompt_logprobs(llm, TOKENS)  # vLLM's own loader on B
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
        assert c.logprob_error(TOKENS) < FP32_BOUND
        c.step(TOKENS)
        second = c.refit_once()
        assert second.verified and second.at_minimum and any("full verification" in n for n in second.notes)
        trained = prompt_logprobs(llm, TOKENS)
        assert trained != want
        assert c.logprob_error(TOKENS) < FP32_BOUND
        saved = _trained_checkpoint(c, spec, b, tmp_path / "trained")
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
