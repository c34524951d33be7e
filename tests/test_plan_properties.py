"""Plans between the real Megatron-Core and vLLM layout rules: exact coverage, minimal bytes,
determinism, and bit-exact simulated execution -- over named corner cases and random layouts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.layout import LayoutError, ModelSpec
from mcore_reshard.transport.views import TORCH_DTYPES, materialize_local
from mcore_reshard.plan import build_plan
from mcore_reshard.testing.local_plan import run_plan_locally
from toy_layouts import NAMED_LAYOUTS, tiny_spec


def simulate(spec: ModelSpec, mpar: MegatronParallel, vpar: VllmParallel, bucket_bytes: int = 1 << 12, seed: int = 0):
    """Random canonical tensors -> every source local via source descriptors -> plan applied
    in-process -> every destination local equals the one built directly from its descriptors."""
    src = megatron_layout(spec, mpar)
    dst = vllm_layout(spec, vpar)
    plan = build_plan(src, dst, bucket_bytes=bucket_bytes)
    assert plan.bytes_planned == plan.bytes_min
    g = torch.Generator().manual_seed(seed)
    dtype = TORCH_DTYPES[spec.dtype]
    canon = {n: torch.randn(t.shape, generator=g).to(dtype) for n, t in spec.tensors().items()}
    src_t: dict[int, dict] = {r: {} for r in range(src.world_size)}
    for p in src.params:
        src_t[p.rank][p.name] = materialize_local(p, canon)
    dst_t: dict[int, dict] = {r: {} for r in range(dst.world_size)}
    for p in dst.params:
        dst_t[p.rank][p.name] = torch.zeros(p.shape, dtype=dtype)
    assert run_plan_locally(plan, src_t, dst_t) == plan.bytes_min
    for p in dst.params:
        assert torch.equal(dst_t[p.rank][p.name], materialize_local(p, canon)), (p.rank, p.name)
    # every destination element exactly once: the pieces' element counts add up to the tensor
    for p in dst.params:
        assert sum(q.numel for q in p.pieces) + p.padding == p.numel
    return src, dst, plan


#: The named corner cases (``toy_layouts.NAMED_LAYOUTS``; ``test_plan_speed`` pins their plans).
CASES = NAMED_LAYOUTS


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_layouts_simulate_bit_exact(name):
    kw, mpar, vpar = CASES[name]
    simulate(tiny_spec(**kw), mpar, vpar)


def test_explicit_eplb_map_followed():
    spec = tiny_spec(experts=4)
    G = 6
    maps = tuple((layer, (3, 2, 1, 0, 0, 3)) for layer in range(spec.num_layers))
    vpar = VllmParallel(tp=2, enable_ep=True, num_redundant_experts=G - 4, physical_to_logical=maps)
    _, dst, plan = simulate(spec, MegatronParallel(ep=2, dp=2), vpar)
    # rank 0 holds physical slots 0..2 -> logical experts 3, 2, 1 of layer 0
    names = [q.canonical for p in dst.params if p.rank == 0 and "layers.0." in p.name and "w2" in p.name for q in p.pieces]
    assert names == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (3, 2, 1)]


def test_plan_is_deterministic():
    spec = tiny_spec()
    a = build_plan(megatron_layout(spec, MegatronParallel(tp=2, ep=2, dp=2)), vllm_layout(spec, VllmParallel(tp=2, replicas=2)), bucket_bytes=512)
    b = build_plan(megatron_layout(spec, MegatronParallel(tp=2, ep=2, dp=2)), vllm_layout(spec, VllmParallel(tp=2, replicas=2)), bucket_bytes=512)
    assert a.digest() == b.digest() and a.transfers == b.transfers


@st.composite
def layouts(draw):
    moe = draw(st.booleans())
    nkv = draw(st.sampled_from([1, 2, 4]))
    p = draw(st.sampled_from([1, 2, 3, 4]))
    layers = draw(st.integers(2, 6))
    spec_kw = dict(moe=moe, nkv=nkv, p=p, layers=layers, tied=draw(st.booleans()), bias=draw(st.booleans()),
                   vocab=draw(st.integers(40, 300)), dtype=draw(st.sampled_from(["float32", "bfloat16"])),
                   experts=draw(st.sampled_from([4, 8])))
    if moe and draw(st.booleans()):
        spec_kw["moe_layers"] = tuple(i for i in range(layers) if draw(st.booleans()))
    pp = draw(st.sampled_from([1, 2]))
    mpar = MegatronParallel(
        tp=draw(st.sampled_from([1, 2, 4])), pp=pp, ep=draw(st.sampled_from([1, 2, 4])),
        etp=draw(st.sampled_from([None, 1, 2])), dp=draw(st.sampled_from([1, 2, 4])),
        vpp=draw(st.sampled_from([1, 2])) if pp > 1 else 1,
        first_stage_layers=draw(st.sampled_from([None, 1])) if pp > 1 else None,
        layer_spec=draw(st.sampled_from(["local", "te"])), experts=draw(st.sampled_from(["sequential", "grouped"])),
    )
    enable_ep = moe and draw(st.booleans())
    vpar = VllmParallel(
        tp=draw(st.sampled_from([1, 2, 4])), pp=draw(st.sampled_from([1, 2])), dp=draw(st.sampled_from([1, 2])),
        replicas=draw(st.sampled_from([1, 2])), enable_ep=enable_ep,
        num_redundant_experts=draw(st.sampled_from([0, 2])) if enable_ep else 0,
    )
    return spec_kw, mpar, vpar


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_simulate_bit_exact(case):
    spec_kw, mpar, vpar = case
    try:
        spec = tiny_spec(**spec_kw)
        megatron_layout(spec, mpar)
        vllm_layout(spec, vpar)
    except LayoutError:
        assume(False)  # a combination the real library rejects too
    simulate(spec, mpar, vpar, bucket_bytes=2048, seed=len(spec_kw))
