"""DeepSeek-V3 family on the vLLM side: the model-format rules at full size, and on a live CPU
engine (CPU_MLA backend) recording with vLLM's own loaders == the rules, and a refit through
the applier (kv_b_proj via the layerwise reload + W_UK/W_UV rebuilt) == HF transformers."""

from __future__ import annotations

import pytest

from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout, vllm_rank_params
from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3, make_tiny_checkpoint
from mcore_reshard.settings.config import CONFIG_DIR
from mcore_reshard.layout import Box, LayoutError, load_model_spec, spec_from_hf_config

PROMPTS = [[1, 5, 9, 200, 17], [3, 4, 5], [700, 12, 999, 42, 8, 8]]
MAX_TOKENS = 6
NO_Q_LORA = dict(TINY_DEEPSEEK_V3, q_lora_rank=None)


def _params(spec, par, rank):
    return {p.name: p for p in vllm_rank_params(spec, par, rank)}


# --------------------------------------------------------------------------- rules


def test_deepseek_v3_tp8_mla_shared_experts_and_ep():
    spec = load_model_spec(CONFIG_DIR / "models" / "deepseek-v3.json")
    par = VllmParallel(tp=8, enable_ep=True, num_redundant_experts=32)
    p = _params(spec, par, 5)
    a = "model.layers.3.self_attn."
    fused = p[a + "fused_qkv_a_proj.weight"]  # [q_a_proj; kv_a_proj_with_mqa], replicated
    assert fused.shape == (1536 + 576, 7168)
    assert [(x.canonical.rsplit(".", 2)[-2], x.box, x.view.offset) for x in fused.pieces] == [
        ("q_a_proj", Box((0, 0), (1536, 7168)), 0),
        ("kv_a_proj_with_mqa", Box((0, 0), (576, 7168)), 1536 * 7168)]
    assert p[a + "q_b_proj.weight"].pieces[0].box == Box((5 * 16 * 192, 0), (16 * 192, 1536))
    assert p[a + "kv_b_proj.weight"].pieces[0].box == Box((5 * 16 * 256, 0), (16 * 256, 512))
    assert p[a + "o_proj.weight"].pieces[0].box == Box((0, 5 * 16 * 128), (7168, 16 * 128))
    m = "model.layers.3.mlp."
    assert p[m + "gate.e_score_correction_bias"].pieces[0].box == Box((0,), (256,))
    assert p[m + "shared_experts.gate_up_proj.weight"].shape == (2 * 256, 7168)
    w13 = p[m + "experts.routed_experts.w13_weight"]
    assert w13.shape == (36, 2 * 2048, 7168)  # (256 + 32) / 8 physical slots, whole experts
    experts = [int(x.canonical.split(".")[5]) for x in w13.pieces[::2]]
    assert experts == list(range(180, 216))
    assert "model.layers.2.mlp.gate_up_proj.weight" in p and "model.layers.2.mlp.gate.weight" not in p
    notes = " ".join(vllm_layout(spec, VllmParallel(tp=8)).notes)
    assert "MTP layers 61..61" in notes and "not held by the destination" in notes
    assert "W_UK/W_UV" in notes


def test_plain_q_and_rejections():
    moon = load_model_spec(CONFIG_DIR / "models" / "moonlight-16b-a3b.json")
    p = _params(moon, VllmParallel(tp=4), 2)
    q = p["model.layers.0.self_attn.q_proj.weight"]
    assert q.pieces[0].box == Box((2 * 4 * 192, 0), (4 * 192, 2048))
    kv_a = p["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.pieces[0].box == Box((0, 0), (576, 2048))
    assert p["model.layers.1.mlp.shared_experts.down_proj.weight"].pieces[0].box == Box((0, 2 * 704), (2048, 704))
    with pytest.raises(LayoutError, match="untied lm_head"):
        vllm_layout(spec_from_hf_config(dict(TINY_DEEPSEEK_V3, tie_word_embeddings=True)), VllmParallel())


# --------------------------------------------------------------------------- live


def _norm(view):
    return view.offset, view.shape, tuple(s if n > 1 else 0 for n, s in zip(view.shape, view.stride))


def _as_sets(params):
    pieces = {(p.local_name, p.canonical, p.box, _norm(p.view)) for lp in params for p in lp.pieces}
    return pieces, {lp.name: tuple(lp.shape) for lp in params}


def _check_against_rules(path, recorded, infos, **par):
    spec = load_model_spec(path, dtype="float32")
    for params, info in zip(recorded, infos):
        got, want = _as_sets(params), _as_sets(vllm_rank_params(spec, VllmParallel(**par), info["rank"]))
        assert got[1] == want[1], f"rank {info['rank']}: local shapes differ"
        assert got[0] == want[0], (f"rank {info['rank']}: only recorded {sorted(got[0] - want[0])[:3]}, "
                                   f"only in rules {sorted(want[0] - got[0])[:3]}")


def _hf(path):
    """HF's greedy continuation of each prompt, and the logprobs of those sequences' tokens."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    seqs, lps = [], []
    with torch.no_grad():
        for p in PROMPTS:
            seq = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0]
            logp = torch.log_softmax(model(seq[None]).logits[0, :-1].float(), -1)
            seqs.append(seq.tolist())
            lps.append(logp.gather(1, seq[1:, None])[:, 0].tolist())
    return seqs, lps


#: token_mult_prob_error in fp32 between vLLM (CPU_MLA, PyTorch rotary: ``start_engine``) and
#: transformers on the same weights; two different random checkpoints are far above it.
FP32_BOUND = 1.001
DIFFERENT = 1.1


def _gap(llm, seqs, lps) -> float:
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs
    from mcore_reshard.refit.verify import token_mult_prob_error

    return max(token_mult_prob_error(prompt_logprobs(llm, s), lp) for s, lp in zip(seqs, lps))


@pytest.mark.slow
@pytest.mark.parametrize("variant, tp", [("q_lora", 1), ("plain_q", 2)])
def test_live_recording_equals_rules_and_refit_matches_hf(tmp_path, variant, tp, shared_engine):
    """On the session's shared engine of that architecture (``test_deepseek_refit`` used both
    before): whatever weights it holds are not B's, recording leaves them alone, and loading B
    through the applier gives transformers' logprobs on B."""
    from mcore_reshard.adapters.vllm.engine import after_refit, describe, greedy

    cfg = TINY_DEEPSEEK_V3 if variant == "q_lora" else NO_Q_LORA
    a = make_tiny_checkpoint(tmp_path / "a", overrides=cfg, family="deepseek_v3", seed=0)
    b = make_tiny_checkpoint(tmp_path / "b", overrides=cfg, family="deepseek_v3", seed=1)
    seqs, lps = _hf(b)
    llm = shared_engine(a, tp=tp)
    before = greedy(llm, PROMPTS, MAX_TOKENS)
    assert _gap(llm, seqs, lps) > DIFFERENT  # not B
    infos = llm.collective_rpc("mr_rank_info")
    _check_against_rules(a, describe(llm), infos, tp=tp)
    assert greedy(llm, PROMPTS, MAX_TOKENS) == before  # recording left the weights alone
    modes = llm.collective_rpc("mr_modes")[0]
    assert modes["model.layers.0.self_attn.kv_b_proj.weight"] == "reload"  # absorbed into W_UK/W_UV
    assert modes["model.layers.1.mlp.gate.e_score_correction_bias"] == "direct"  # left live by the reload
    statuses = llm.collective_rpc("mr_load_canonical", args=(str(b),))
    assert all(s["state"] == "serving" for s in statuses), statuses
    after_refit(llm)
    # B now: vLLM's teacher-forced logprobs equal transformers' within the fp32 bound
    assert _gap(llm, seqs, lps) < FP32_BOUND
