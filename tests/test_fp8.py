"""Block-FP8 rollout, quantized at the sender: layouts (codes + scales on both sides, a cut
block refused in one line), plans at the FP8 minimum, and the plan run in-process ending in
exactly what vLLM's online ``fp8_per_block`` quantization makes of every worker's shard."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3, TINY_DENSE_128, TINY_MOE_128
from mcore_reshard.layout import LayoutError
from mcore_reshard.layout.quant import FP8, BlockFp8, fp8_sides, quantize_side, quantized_tensors, scale_name
from mcore_reshard.layout.spec import spec_from_hf_config
from mcore_reshard.plan import build_plan, plan_report
from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire
from mcore_reshard.testing.local_plan import run_plan_locally
from mcore_reshard.transport.quantize import per_block_fp8
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local

Q = BlockFp8()


def _spec(moe: bool = True):
    return spec_from_hf_config(TINY_MOE_128 if moe else TINY_DENSE_128, dtype="bfloat16")


#: DeepSeek-V3 shaped (MLA with q_lora, a dense first layer, a shared expert, the fp32 router
#: bias), every projection whole 128x128 blocks at TP2: kv_a_proj_with_mqa's 576 rows end in a
#: partial block that ends the tensor (and vLLM's fused_qkv_a_proj) too.
DEEPSEEK_128 = dict(TINY_DEEPSEEK_V3, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256,
                    qk_nope_head_dim=128, v_head_dim=128)


def _sides(moe, mpar: MegatronParallel, vpar: VllmParallel):
    """(spec, the bf16 training layout, the FP8 engine's layout, that layout as it receives)."""
    spec = spec_from_hf_config(DEEPSEEK_128, dtype="bfloat16") if moe == "deepseek" else _spec(moe)
    src, dst = megatron_layout(spec, mpar), quantize_side(vllm_layout(spec, vpar), Q, "vllm")
    return spec, src, dst, fp8_sides(src, dst)[1]


def test_which_tensors_are_quantized():
    spec = _spec()
    names = quantized_tensors(spec.tensor_table(), Q)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    # embeddings, the LM head, norms and the router stay in the model dtype
    for keep in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert keep not in names
    assert len(names) == spec.num_layers * (4 + 3 * spec.num_experts)
    # an ignore pattern keeps a module out
    no_attn = BlockFp8(ignore=("*.mlp.gate", "*.self_attn.*"))
    assert not any(".self_attn." in n for n in quantized_tensors(spec.tensor_table(), no_attn))


def test_vllm_fp8_layout_holds_codes_and_block_scales():
    spec = _spec()
    dst = quantize_side(vllm_layout(spec, VllmParallel(tp=2, enable_ep=True)), Q, "vllm")
    by = {(p.rank, p.name): p for p in dst.params}
    qkv = by[(0, "model.layers.0.self_attn.qkv_proj.weight")]
    assert qkv.dtype == FP8 and qkv.shape == (512, 256)  # q 256 + k 128 + v 128 rows per TP rank
    s = by[(0, "model.layers.0.self_attn.qkv_proj.weight_scale_inv")]
    assert s.dtype == "float32" and s.shape == (4, 2)
    # one scale piece per weight piece, at the weight's block coordinates
    assert [(q.canonical, q.box.offsets, q.box.sizes, q.view.offset) for q in s.pieces] == [
        ("model.layers.0.self_attn.q_proj.weight_scale_inv", (0, 0), (2, 2), 0),
        ("model.layers.0.self_attn.k_proj.weight_scale_inv", (0, 0), (1, 2), 4),
        ("model.layers.0.self_attn.v_proj.weight_scale_inv", (0, 0), (1, 2), 6)]
    w13 = by[(1, "model.layers.0.mlp.experts.routed_experts.w13_weight")]
    assert w13.dtype == FP8 and w13.shape == (4, 512, 256)  # 4 local experts, [gate; up] of 256 rows each
    assert by[(1, "model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv")].shape == (4, 4, 2)
    # what stays bf16, and the canonical table in both forms
    assert by[(0, "model.layers.0.mlp.gate.weight")].dtype == "bfloat16"
    assert dst.tensors["model.layers.0.self_attn.o_proj.weight"] == ((256, 512), FP8)
    assert dst.tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] == ((2, 4), "float32")
    # describing it again changes nothing (an engine's own FP8 description)
    assert quantize_side(dst, Q, "vllm") is dst


def test_a_split_that_cuts_a_block_is_refused_in_one_line():
    spec = _spec(moe=False)
    # vLLM TP4: 256 intermediate rows / 4 = 64 per rank
    with pytest.raises(LayoutError) as e:
        quantize_side(vllm_layout(spec, VllmParallel(tp=4)), Q, "vllm")
    msg = str(e.value)
    assert "\n" not in msg and "mlp.gate_proj.weight" in msg and "cuts a 128x128 FP8 block" in msg
    assert "vllm rank 0" in msg
    # the training side likewise (megatron TP4), when asked to quantize it all
    with pytest.raises(LayoutError, match=r"training rank \d.*cuts a 128x128 FP8 block"):
        quantize_side(megatron_layout(spec, MegatronParallel(tp=4)), Q, "training")


def test_blocks_the_training_layout_cuts_go_unquantized_and_the_receiver_quantizes_them():
    """Megatron TP4 on the 256-row MLPs: 64 rows per rank cut every block of gate/up/down, so
    no sender can quantize them; they travel in bf16 (the receiver quantizes them, as vLLM's
    online quantization does) and the plan says so with what it costs; attention stays FP8."""
    spec = _spec(moe=False)
    src, dst = megatron_layout(spec, MegatronParallel(tp=4)), quantize_side(vllm_layout(spec, VllmParallel(tp=2)), Q, "vllm")
    sent, received, late = fp8_sides(src, dst)
    names = {n for n, _, _ in late}
    assert names == {f"model.layers.{i}.mlp.{m}_proj.weight" for i in range(2) for m in ("gate", "up", "down")}
    assert all(d == "bfloat16" and "cuts a 128x128 FP8 block" in w or "shares" in w for _, d, w in late)
    assert all(received.tensors[n][1] == "bfloat16" and scale_name(n) not in received.tensors for n in names)
    assert received.tensors["model.layers.0.self_attn.q_proj.weight"][1] == FP8
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    assert plan.quantized_at_receiver == late and {n for n, _ in plan.quantized}.isdisjoint(names)
    rep = plan_report(plan)
    mlp = 6 * 256 * 256 * 2  # bf16 bytes of the six MLP weights, half on each vLLM rank
    assert plan.bytes_planned == plan.bytes_min and rep.bytes_over_fp8_minimum == mlp // 2
    assert "quantized at the receiver (the training layout cuts their FP8 blocks): 6 tensor(s)" in rep.table()


@pytest.mark.parametrize("moe, mpar, vpar", [
    (True, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=1)),
    (True, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2, enable_ep=True)),
    (False, MegatronParallel(tp=2, pp=2), VllmParallel(tp=2)),
    ("deepseek", MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2)),
], ids=["moe-tp2ep2-to-tp1", "moe-tp2ep2-to-tp2ep2", "dense-tp2pp2-to-tp2", "deepseek-tp2ep2-to-tp2"])
def test_fp8_plan_is_at_the_fp8_minimum_and_ends_as_vllm_quantizes(moe, mpar, vpar):
    spec, src, engine, dst = _sides(moe, mpar, vpar)
    plan = build_plan(src, engine, bucket_bytes=1 << 16)
    assert plan.dtype == FP8 and plan.casts == ()
    names = quantized_tensors(spec.tensor_table(), Q)
    if moe == "deepseek":  # every MLA projection quantized; the fp32 router bias rides as bits
        assert {n.rsplit(".", 2)[-2] for n in names if ".self_attn." in n} == {
            "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
        assert any(n.endswith("e_score_correction_bias") and d == "float32" for n, d in plan.reinterpret)
        # megatron TP2 splits kv_a_proj_with_mqa's 576 rows 288 + 288: a block straddles the
        # two ranks, so it goes unquantized, and q_a_proj with it (vLLM fuses them)
        late = {n.rsplit(".", 2)[-2] for n, _, _ in plan.quantized_at_receiver}
        assert late == {"kv_a_proj_with_mqa", "q_a_proj"}
        names = tuple(n for n in names if n not in {m for m, _, _ in plan.quantized_at_receiver})
    else:
        assert plan.quantized_at_receiver == ()
    assert [n for n, _ in plan.quantized] == list(names) and {d for _, d in plan.quantized} == {"bfloat16"}
    real = sum((p.numel - p.padding) * torch.empty((), dtype=TORCH_DTYPES[p.dtype]).element_size() for p in dst.params)
    assert plan.bytes_planned == plan.bytes_min == real
    # codes + scales of the quantized tensors: about half their bf16 bytes
    rep = plan_report(plan)
    assert rep.quantized_bytes / rep.quantized_bytes_unquantized <= 0.52
    assert rep.quantized_bytes_unquantized == 2 * sum(t.box.numel for t in plan.transfers if t.canonical in set(names))
    assert "quantized at the sender (block FP8 128x128" in rep.table()
    bf16 = build_plan(megatron_layout(spec, mpar), vllm_layout(spec, vpar), bucket_bytes=1 << 16)
    # the whole refit: only the tensors quantized at the sender change their bytes
    assert plan.bytes_min == bf16.bytes_min - rep.quantized_bytes_unquantized + rep.quantized_bytes
    assert plan.digest() != bf16.digest()
    # slices: the senders learn what to quantize, over the wire and in the digest
    for r in range(src.world_size):
        s = plan.for_rank("src", r)
        assert s.quantize and all(not n.endswith("_scale_inv") for n in s.quantize)
        back = slice_from_wire(slice_to_wire(s))
        assert back.quantize == s.quantize and back.digest() == s.digest()
    assert not plan.for_rank("dst", 0).quantize

    # run it: bf16 canonical weights at a published spread -> every destination tensor is
    # what vLLM's fp8_per_block makes of that worker's bf16 shard (codes and scales), the
    # rest bit for bit
    g = torch.Generator().manual_seed(1)
    canon = {n: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
             for n, (shape, _) in spec.tensor_table().items()}
    src_t = {r: {} for r in range(src.world_size)}
    for p in megatron_layout(spec, mpar).params:
        src_t[p.rank][p.name] = materialize_local(p, canon)
    dst_t = {r: {} for r in range(dst.world_size)}
    for p in dst.params:
        dst_t[p.rank][p.name] = torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype])
    assert run_plan_locally(plan, src_t, dst_t) == plan.bytes_planned
    model_format = {(p.rank, p.name): p for p in vllm_layout(spec, vpar).params}
    checked = 0
    for p in dst.params:
        got = dst_t[p.rank][p.name]
        if p.name.endswith("_scale_inv"):
            continue
        bf = materialize_local(model_format[(p.rank, p.name)], canon)  # (received unquantized: as is)
        if p.dtype == FP8:
            codes, scales = per_block_fp8(bf)
            assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8)), (p.rank, p.name)
            assert torch.equal(dst_t[p.rank][scale_name(p.name)], scales), (p.rank, p.name)
            checked += 1
        else:
            assert torch.equal(got.view(torch.int16), bf.view(torch.int16)), (p.rank, p.name)
    assert checked == sum(1 for p in dst.params if p.dtype == FP8) > 0


@pytest.mark.slow  # starts nothing, but vLLM's deep_gemm module imports ~3 s more of vLLM than the fast tier does
@pytest.mark.parametrize("shape", [(256, 256), (384, 200), (1000, 130), (2, 3, 300, 260)])
def test_sender_quantizer_is_vllms_bit_for_bit(shape):
    """``per_block_fp8`` against vLLM's own ``per_block_cast_to_fp8`` (what an online
    ``fp8_per_block`` engine runs on every weight it loads): codes and scales identical, with
    partial edge blocks and stacked (expert) tensors."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    codes, scales = per_block_fp8(w)
    flat, sflat = codes.reshape(-1, *shape[-2:]), scales.reshape(-1, *scales.shape[-2:])
    for i, x in enumerate(w.reshape(-1, *shape[-2:])):
        want, want_s = per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)
        assert torch.equal(flat[i].view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(sflat[i], want_s)


def test_fp8_codes_round_trip_within_the_block_bound():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 260, generator=g) * 0.02).to(torch.bfloat16)
    codes, scales = per_block_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape and scales.shape == (3, 3)
    back = codes.float() * scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's scale-normalised value
    err = (back - w.float()).abs()
    bound = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260] * 448 / 16
    assert bool((err <= bound).all()) and math.isfinite(float(err.max()))


# -- live: megatron trainers quantize at the sender ----------------------------------------------

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64, 512, 3]


@pytest.mark.slow
def test_trainers_quantize_at_the_sender_into_fp8_destinations(ckpt_cache):
    """bf16 megatron trainers (TP2 x EP2, distributed optimizer) take an optimizer step and
    refit into the layout of a block-FP8 vLLM engine of TP2 (two destination processes):
    every FP8 tensor lands as exactly what vLLM's ``fp8_per_block`` makes of that worker's bf16
    shard of the trained weights (codes and scales), checksums verified on the codes and
    scales, the senders' quantization time reported; a delta of the same weights moves
    headers only; a scale changed where a destination holds it is caught by the checksum of the
    whole box and the refit aborted everywhere."""
    import torch.multiprocessing as mp

    from _fp8_jobs import fp8_destination_main, fp8_trainer_job
    from mcore_reshard.adapters.megatron.rules import MegatronParallel
    from mcore_reshard.layout import LocalParam
    from mcore_reshard.wire.protocol import RankReport
    from mcore_reshard.transport.views import box_slices, local_view
    from support.megatron import run_world

    ckpt = ckpt_cache.get(family="qwen3_moe_128", dtype="bfloat16")
    spec = spec_from_hf_config(TINY_MOE_128, dtype="bfloat16")
    par, vpar = MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2, quantization="fp8_per_block")
    dst = vllm_layout(spec, vpar)
    flip = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    try:
        inboxes, q = [manager.Queue() for _ in range(dst.world_size)], ctx.Queue()
        procs = [ctx.Process(target=fp8_destination_main, args=(r, dst.world_size, inboxes[r], q, dst, flip),
                             daemon=True) for r in range(dst.world_size)]
        for p in procs:
            p.start()
        ranks = run_world(fp8_trainer_job, 2, (str(ckpt), par, vpar, TOKENS, inboxes, 3), timeout_s=600)
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    finally:
        manager.shutdown()
    assert all("crash" not in got[r] for r in got), [got[r].get("crash") for r in got]

    # the trained weights, assembled from the trainers' own shards
    canon = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, (shape, _) in spec.tensor_table().items()}
    for out in ranks:
        for lp in out["descs"]:
            for piece in lp.pieces:
                canon[piece.canonical][box_slices(piece.box)] = local_view(out["weights"][lp.name], piece.view)
    assert all(out["quantize"] for out in ranks)

    # refit 1: committed, every tensor as vLLM's online quantization makes it
    model_format = {(p.rank, p.name): p for p in vllm_layout(spec, VllmParallel(tp=2)).params}
    for r in range(dst.world_size):
        commit, errors = got[r]["outcomes"][0]
        assert commit, errors
        held = {n: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(TORCH_DTYPES[d]).reshape(shape)
                for n, (d, shape, raw) in got[r]["tensors"].items()}
        for lp in dst.for_rank(r):
            if lp.name.endswith("_scale_inv"):
                continue
            bf = materialize_local(model_format[(r, lp.name)], canon)
            if lp.dtype == FP8:
                codes, scales = per_block_fp8(bf)
                assert torch.equal(held[lp.name].view(torch.uint8), codes.view(torch.uint8)), lp.name
                assert torch.equal(held[scale_name(lp.name)], scales), lp.name
            else:
                assert torch.equal(held[lp.name].view(torch.int16), bf.view(torch.int16)), lp.name
    reports = [RankReport.from_wire(out["reports"][0]) for out in ranks]
    assert all(r.verified and r.phases.get("quantize", 0) > 0 for r in reports)
    received = [RankReport.from_wire(got[r]["stats"][0]) for r in range(dst.world_size)]
    assert sum(r.bytes_received for r in received) == ranks[0]["bytes_min"]
    # the trainers' steps changed the weights: what landed is not the checkpoint's quantization
    ckpt_q = per_block_fp8(load_canonical_bf16(ckpt)["model.layers.0.self_attn.o_proj.weight"])[0]
    assert not torch.equal(ckpt_q.view(torch.uint8),
                           per_block_fp8(canon["model.layers.0.self_attn.o_proj.weight"])[0].view(torch.uint8))

    # refit 2, the same weights: a delta of FP8 codes and scales moves headers only, verified
    # against the whole boxes the destinations hold
    for r in range(dst.world_size):
        assert got[r]["outcomes"][1][0], got[r]["outcomes"][1][1]
        rep = RankReport.from_wire(got[r]["stats"][1])
        assert rep.verified and rep.delta.on
        assert rep.bytes_received == rep.bytes_headers > 0 and rep.bytes_full == received[r].bytes_received
    for out in ranks:  # the senders compared the new codes and scales with what they sent
        rep = RankReport.from_wire(out["reports"][1])
        assert rep.delta.on and rep.delta.elements > 0 and rep.delta.changed == 0

    # refit 3, a delta again, but a destination's held scale was changed first: the checksum of
    # the whole box names the tensor, nobody commits
    for r in range(dst.world_size):
        commit, errors = got[r]["outcomes"][2]
        assert not commit and any("o_proj.weight_scale_inv" in e for e in errors), errors
    assert all(len(out["errors"]) == 1 and len(out["reports"]) == 2 for out in ranks)


def load_canonical_bf16(ckpt) -> dict:
    from mcore_reshard.infra.checkpoint import load_canonical

    return {k: v.to(torch.bfloat16) for k, v in load_canonical(str(ckpt)).items()}


def test_the_canary_reference_of_an_fp8_refit_computes_with_the_weights_as_sent():
    """``as_sent``: while a quantized refit's canary reference runs, each tensor the rank
    quantized holds its FP8 round trip (codes times block scales, in its dtype: what the FP8
    engine computes with); on the way out -- an exception included -- the weights are back bit
    for bit."""
    from mcore_reshard.transport.quantize import as_sent, dequantize

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(256, 384, generator=g) * 0.02).to(torch.bfloat16)
    other = torch.randn(4, 4, generator=g).to(torch.bfloat16)
    keep, keep_other = w.clone(), other.clone()
    codes, scales = per_block_fp8(keep)
    with pytest.raises(RuntimeError, match="inside"):
        with as_sent({"w": w, "other": other}, ["w"]):
            assert torch.equal(w, dequantize(codes, scales, torch.bfloat16)) and not torch.equal(w, keep)
            assert torch.equal(other, keep_other)  # not quantized: untouched
            # the round trip is the FP8 error only: every element within the widest code step of its
            # block (32 x its scale: e4m3 codes between 256 and 448 are 32 apart)
            step = scales.repeat_interleave(128, 0).repeat_interleave(128, 1) * 32
            assert ((w.float() - keep.float()).abs() <= step).all()
            raise RuntimeError("inside")
    assert torch.equal(w.view(torch.int16), keep.view(torch.int16))
