"""LoRA adapters as layouts: Megatron-Bridge's sharded adapters -> vLLM's live LoRA slots,
planned at the per-rank minimum and run in-process bit for bit (B scaled by alpha/r at the
sender, as vLLM's loader scales it), for every TP pairing and KV replication; the bad inputs
get one line before anything is planned. Torch on metadata and tiny tensors only."""

from __future__ import annotations

import math

import pytest
import torch

from mcore_reshard.adapters.megatron.lora_rules import megatron_lora_layout
from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.lora_rules import vllm_lora_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.layout import LayoutError
from mcore_reshard.layout.descriptor import DTYPE_BYTES
from mcore_reshard.layout.lora import PeftConfig, adapter_tensors
from mcore_reshard.plan import PlanError, build_plan
from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire
from mcore_reshard.testing.local_plan import run_plan_locally
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local
from toy_layouts import tiny_spec

PEFT = PeftConfig(enabled=True, dim=4, alpha=12.0)  # scaling 3.0: not a power of two


def _canonical(tensors, seed: int) -> dict[str, torch.Tensor]:
    """A random adapter as a Megatron-Bridge policy exports it: one A per fused module, so
    k/v share q's A and up shares gate's."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(shape, generator=g).to(TORCH_DTYPES[dt]) for n, (shape, dt) in tensors.items()}
    for n in out:
        for other, first in (("k_proj.lora_A", "q_proj.lora_A"), ("v_proj.lora_A", "q_proj.lora_A"),
                             ("up_proj.lora_A", "gate_proj.lora_A")):
            if other in n:
                out[n] = out[n.replace(other, first)]
    return out


def _run(spec, mpar, vpar, peft=PEFT, seed=0):
    src, dst = megatron_lora_layout(spec, mpar, peft), vllm_lora_layout(spec, vpar, peft)
    plan = build_plan(src, dst, bucket_bytes=1 << 12)
    canon = _canonical(src.tensors, seed)
    s = {r: {p.name: materialize_local(p, canon) for p in src.for_rank(r)} for r in range(src.world_size)}
    d = {r: {p.name: torch.full(p.shape, float("nan"), dtype=TORCH_DTYPES[p.dtype]) for p in dst.for_rank(r)}
         for r in range(dst.world_size)}
    for p in dst.params:  # the receiver zero-fills what no piece covers (rank past r), as set_lora leaves it
        d[p.rank][p.name].view(-1).zero_() if p.padding else None
    moved = run_plan_locally(plan, s, d)
    # what vLLM's loader holds: B in the model dtype, multiplied in place by alpha / r
    held = {n: (t.clone().mul_(peft.scaling) if n.endswith("lora_B.weight") else t) for n, t in canon.items()}
    return src, dst, plan, moved, d, held


@pytest.mark.parametrize("mtp,vtp,nkv,dtype", [(1, 1, 2, "float32"), (2, 1, 2, "bfloat16"), (1, 2, 2, "bfloat16"),
                                               (2, 2, 2, "float32"), (2, 4, 2, "bfloat16"), (4, 2, 4, "float32")])
def test_adapters_move_shard_to_shard_into_vllm_slots_bit_for_bit(mtp, vtp, nkv, dtype):
    spec = tiny_spec(moe=False, nkv=nkv, p=2, dtype=dtype)
    src, dst, plan, moved, d, held = _run(spec, MegatronParallel(tp=mtp, dp=1), VllmParallel(tp=vtp))
    assert plan.bytes_planned == plan.bytes_min == moved
    assert plan.scaled and all(f == 3.0 for _, f in plan.scaled)
    for p in dst.params:
        want = materialize_local(p, held)
        got = d[p.rank][p.name]
        assert torch.equal(got, want), (p.rank, p.name)
    # every worker holds the whole adapter (A whole, B its rows; o/down: A its columns, B whole)
    one = sum(math.prod(s_) * DTYPE_BYTES[dt] for s_, dt in src.tensors.values())
    per_rank = [sum((p.numel - p.padding) * DTYPE_BYTES[p.dtype] for p in dst.for_rank(r)) for r in range(vtp)]
    assert plan.bytes_min == sum(per_rank) and per_rank[0] <= one <= sum(per_rank)
    assert (per_rank[0] == one) == (vtp == 1)
    # the scale travels in the source slices (and survives the wire), never in the destination's
    s0 = plan.for_rank("src", 0)
    assert s0.scale and all(n.endswith("adapter.linear_out.weight") for n, _ in s0.scale)
    assert slice_from_wire(slice_to_wire(s0)) == s0 and not plan.for_rank("dst", 0).scale


def test_adapter_bytes_are_a_small_share_of_a_full_refit():
    spec = tiny_spec(moe=False, layers=2)
    full = build_plan(megatron_layout(spec, MegatronParallel(tp=2)), vllm_layout(spec, VllmParallel(tp=2)))
    _, _, plan, _, _, _ = _run(spec, MegatronParallel(tp=2), VllmParallel(tp=2))
    assert 0 < plan.bytes_min < full.bytes_min
    assert len(adapter_tensors(spec, PEFT)) == 2 * 2 * 7  # A and B of 7 projections on 2 layers


@pytest.mark.parametrize("experts", ["sequential", "grouped"])  # grouped: no expert adapter to describe
def test_attention_only_adapters_on_a_moe_model(experts):
    spec = tiny_spec(moe=True, layers=2)
    peft = PeftConfig(enabled=True, dim=8, alpha=16.0, target_modules=("linear_qkv", "linear_proj"))
    _, dst, plan, moved, d, held = _run(spec, MegatronParallel(tp=2, ep=2, experts=experts), VllmParallel(tp=2), peft)
    assert moved == plan.bytes_min and {p.name.split(".")[3] for p in dst.params} == {"self_attn"}
    for p in dst.params:
        assert torch.equal(d[p.rank][p.name], materialize_local(p, held)), p.name


@pytest.mark.parametrize("mpar,vpar", [
    (MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2)),  # vLLM MoE-TP2: B rows / A columns per rank
    (MegatronParallel(tp=1, ep=1, etp=1, dp=2), VllmParallel(tp=2, enable_ep=True)),  # vLLM EP2: half the experts each
    (MegatronParallel(tp=2, ep=1, etp=2), VllmParallel(tp=1)),  # expert-TP2 adapters into one whole slot
])
def test_routed_expert_adapters_move_shard_to_shard_into_fused_moe_slots(mpar, vpar):
    """Every routed expert's adapter (Bridge's adapters on each expert's linear_fc1/fc2 under
    EP / expert TP) into vLLM's ``FusedMoEWithLoRA`` slots, with the attention's, bit for bit."""
    spec = tiny_spec(moe=True, layers=2, dtype="bfloat16")
    _, dst, plan, moved, d, held = _run(spec, mpar, vpar)
    assert moved == plan.bytes_planned == plan.bytes_min
    experts = [p for p in dst.params if ".mlp.experts." in p.name]
    assert {p.name.rsplit(".", 3)[1] for p in experts} == {"w13_lora_a_stacked", "w13_lora_b_stacked",
                                                            "w2_lora_a_stacked", "w2_lora_b_stacked"}
    for p in dst.params:
        assert torch.equal(d[p.rank][p.name], materialize_local(p, held)), (p.rank, p.name)
    if vpar.enable_ep:  # each worker holds its half of the experts, whole
        assert all(p.shape[0] == spec.num_experts // 2 for p in experts)


def test_bad_lora_settings_are_one_line_before_anything_is_planned():
    dense, moe = tiny_spec(moe=False), tiny_spec(moe=True)
    with pytest.raises(LayoutError, match=r"peft.dim=16: the engine's max_lora_rank=8 cannot hold rank 16"):
        PeftConfig(enabled=True, dim=16, max_lora_rank=8)
    with pytest.raises(LayoutError, match=r"peft.max_lora_rank=12: vLLM accepts"):
        PeftConfig(enabled=True, dim=8, max_lora_rank=12)
    with pytest.raises(LayoutError, match=r"peft.target_modules=\['q_proj'\]: \['q_proj'\] not among"):
        PeftConfig(enabled=True, target_modules=("q_proj",))
    with pytest.raises(LayoutError, match=r"peft.exclude_modules=.*leaves no module"):
        PeftConfig(enabled=True, exclude_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    with pytest.raises(LayoutError, match=r"peft.dim=6: Megatron-Bridge splits the A of .* tensor_model_parallel_size=4"):
        megatron_lora_layout(dense, MegatronParallel(tp=4), PeftConfig(enabled=True, dim=6))
    with pytest.raises(LayoutError, match=r"adapters on grouped experts \(TEGroupedMLP\) are not described"):
        megatron_lora_layout(moe, MegatronParallel(tp=1, experts="grouped"), PEFT)
    with pytest.raises(LayoutError, match=r"adapters on the experts with redundant experts \(EPLB\)"):
        vllm_lora_layout(moe, VllmParallel(tp=2, enable_ep=True, num_redundant_experts=2), PEFT)
    with pytest.raises(LayoutError, match=r"LoRA adapters into an FP8 engine are not supported"):
        vllm_lora_layout(dense, VllmParallel(tp=1, quantization="fp8_per_block"), PEFT)
    # a rank or alpha that differs between the two sides: the layouts hold different tensors or scales
    src = megatron_lora_layout(dense, MegatronParallel(tp=1), PEFT)
    with pytest.raises(PlanError, match="lora_A.weight"):
        build_plan(src, vllm_lora_layout(dense, VllmParallel(tp=1), PeftConfig(enabled=True, dim=8, alpha=12.0)))
