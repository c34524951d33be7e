"""Mixed-dtype sources: the plan records every cast (the sender converts while packing, the wire
carries the destination's dtype), the report lists them, and without ``refit.allow_cast=true`` a
dtype mismatch is a one-line error naming the tensor and both dtypes. Torch-free."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import tiny_config
from mcore_reshard.layout import SideLayout, spec_from_hf_config
from mcore_reshard.plan import PlanError, build_plan, check_sides, get_plan, plan_report
from toy_layouts import split_layout

MPAR = MegatronParallel(tp=2, ep=2, etp=1)
VPAR = VllmParallel(tp=2)
ROUTER = ".mlp.gate.weight"  # the HF name of megatron's router (mlp.router.weight)


@functools.cache
def _spec():
    return spec_from_hf_config(tiny_config("qwen3_moe"))


def _layouts(src_dtype: str, dst_dtype: str) -> tuple[SideLayout, SideLayout]:
    spec = _spec()
    return megatron_layout(spec.with_dtype(src_dtype), MPAR), vllm_layout(spec.with_dtype(dst_dtype), VPAR)


def _with_fp32(side: SideLayout, pick) -> SideLayout:
    """``side`` with the tensors ``pick`` selects (and every local param holding them) in fp32."""
    tensors = {n: (shape, "float32" if pick(n) else dt) for n, (shape, dt) in side.tensors.items()}
    params = tuple(dataclasses.replace(p, dtype="float32") if p.pieces and pick(p.pieces[0].canonical) else p
                   for p in side.params)
    return dataclasses.replace(side, tensors=tensors, params=params)


def _is_router(name: str) -> bool:
    return name.endswith(ROUTER) and ".experts." not in name


def _dst_numel(dst: SideLayout) -> int:
    return sum(p.numel - p.padding for p in dst.params)


def test_mismatch_without_allow_cast_is_one_line_naming_tensor_and_dtypes():
    src, dst = _layouts("bfloat16", "float32")
    with pytest.raises(PlanError) as err:
        build_plan(src, dst)
    msg = str(err.value)
    assert "\n" not in msg
    first = next(iter(dst.tensors))
    assert msg.startswith(f"{first}: ")
    assert "bfloat16" in msg and "float32" in msg and "refit.allow_cast=true" in msg
    with pytest.raises(PlanError, match="refit.allow_cast=true"):
        check_sides(src, dst)  # before anything else: the side check alone raises it
    with pytest.raises(PlanError, match="refit.allow_cast=true"):
        get_plan(src, dst, bucket_bytes=1 << 20)


def test_bf16_model_into_fp32_engine_casts_every_tensor_at_destination_bytes():
    src, dst = _layouts("bfloat16", "float32")
    plan = build_plan(src, dst, bucket_bytes=1 << 14, allow_cast=True)
    assert plan.casts == tuple((n, "bfloat16", "float32") for n in dst.tensors)  # destination order
    assert plan.dtype == "float32" and plan.itemsize == 4
    assert plan.bytes_min == _dst_numel(dst) * 4
    assert plan.bytes_planned == plan.bytes_min
    assert all(t.nbytes == t.box.numel * 4 for t in plan.transfers)
    assert all(plan.for_rank("src", r).dtype == "float32" for r in range(src.world_size))
    # same transfers as the fp32 -> fp32 plan: only the casts (and so the digest) differ
    same = build_plan(*_layouts("float32", "float32"), bucket_bytes=1 << 14)
    assert same.casts == () and same.transfers == plan.transfers and same.bytes_min == plan.bytes_min
    assert same.digest() != plan.digest()
    assert check_sides(src, dst, allow_cast=True) == plan.casts

    rep = plan_report(plan)
    js = json.loads(json.dumps(rep.to_json()))
    assert js["casts"] == [{"tensor": n, "from": "bfloat16", "to": "float32"} for n in dst.tensors]
    assert js["bytes_planned"] == js["bytes_min"] == plan.bytes_min
    text = rep.table()
    assert f"casts (sender converts while packing): {len(dst.tensors)} tensor(s)" in text
    cast_lines = [line for line in text.splitlines() if line.startswith("  cast: ")]
    assert 1 <= len(cast_lines) <= 8  # grouped per layer, short
    assert "  cast: model.layers.*.mlp.gate.weight (x4): bfloat16 -> float32" in text or "more pattern" in text
    assert "model.layers.0." not in text  # per-layer names are grouped


def test_fp32_router_in_bf16_model_lists_only_the_router():
    src, dst = _layouts("bfloat16", "bfloat16")
    src = _with_fp32(src, _is_router)
    routers = [n for n in dst.tensors if _is_router(n)]
    assert len(routers) == _spec().num_layers
    with pytest.raises(PlanError) as err:
        build_plan(src, dst)
    assert str(err.value).startswith(f"{routers[0]}: ") and "float32" in str(err.value) and "bfloat16" in str(err.value)
    plan = build_plan(src, dst, bucket_bytes=1 << 14, allow_cast=True)
    assert plan.casts == tuple((n, "float32", "bfloat16") for n in routers)
    assert plan.dtype == "bfloat16" and plan.bytes_planned == plan.bytes_min == _dst_numel(dst) * 2
    rep = plan_report(plan)
    assert [c["tensor"] for c in rep.to_json()["casts"]] == routers
    text = rep.table()
    assert "casts (sender converts while packing): 4 tensor(s)" in text
    assert "  cast: model.layers.*.mlp.gate.weight (x4): float32 -> bfloat16" in text


def test_fp32_main_weights_source_into_bf16_engine():
    src, dst = _layouts("float32", "bfloat16")
    plan = build_plan(src, dst, bucket_bytes=1 << 14, allow_cast=True)
    assert plan.casts == tuple((n, "float32", "bfloat16") for n in dst.tensors)
    assert plan.bytes_planned == plan.bytes_min == _dst_numel(dst) * 2


def test_param_dtype_checked_against_its_own_sides_table():
    # The source table says fp32 for the routers, the destination's says bf16: each local param
    # matches its own side, so this plans.
    src, dst = _layouts("bfloat16", "bfloat16")
    src = _with_fp32(src, _is_router)
    build_plan(src, dst, allow_cast=True)
    # A source router param still in bf16 while its own table says fp32 is named.
    bad_params = tuple(dataclasses.replace(p, dtype="bfloat16") if p.pieces and _is_router(p.pieces[0].canonical)
                       else p for p in src.params)
    with pytest.raises(PlanError, match=r"router\.weight \(source rank \d\) holds bfloat16 but .*mlp\.gate\.weight is float32"):
        build_plan(dataclasses.replace(src, params=bad_params), dst, allow_cast=True)
    # Tables changed, params not: a router param in fp32 against its (bf16) table is named too.
    only_params = dataclasses.replace(src, tensors=_layouts("bfloat16", "bfloat16")[0].tensors)
    with pytest.raises(PlanError, match="holds float32 but .*mlp.gate.weight is bfloat16"):
        build_plan(only_params, dst, allow_cast=True)


def test_fused_param_checked_on_every_tensor_it_holds():
    # A fused QKV param: its table marks only v_proj fp32 (not the first piece's tensor).
    src, dst = _layouts("bfloat16", "bfloat16")
    tensors = {n: (s, "float32" if n.endswith("v_proj.weight") else d) for n, (s, d) in src.tensors.items()}
    with pytest.raises(PlanError, match=r"holds bfloat16 but model\.layers\.\d\.self_attn\.v_proj\.weight is float32"):
        build_plan(dataclasses.replace(src, tensors=tensors), dst, allow_cast=True)


def test_plans_without_casts_are_unchanged():
    t = {"w": ((8, 4), "float32"), "b": ((4,), "float32")}
    plan = build_plan(split_layout(t, parts=2, dim=0), split_layout(t, parts=1, dim=0), allow_cast=True)
    assert plan.casts == ()
    rep = plan_report(plan)
    assert rep.to_json()["casts"] == [] and "casts (sender converts while packing): none" in rep.table()
    # toy cast: the casts enter the digest, nothing else changes
    t16 = {"w": ((8, 4), "bfloat16"), "b": ((4,), "bfloat16")}
    cast = build_plan(split_layout(t16, parts=2, dim=0), split_layout(t, parts=1, dim=0), allow_cast=True)
    assert cast.casts == (("w", "bfloat16", "float32"), ("b", "bfloat16", "float32"))
    assert cast.transfers == plan.transfers and cast.bytes_min == plan.bytes_min == math.prod((8, 4)) * 4 + 16
    assert cast.digest() != plan.digest()
    assert cast.for_rank("dst", 0).digest() == plan.for_rank("dst", 0).digest()  # slices: same bytes, same wire


def test_mixed_destination_dtypes_stay_an_error():
    t = {"w": ((8, 4), "float16"), "b": ((4,), "bfloat16")}  # one width: neither carries the other
    with pytest.raises(PlanError, match="mixed element types on the destination"):
        build_plan(split_layout(t, parts=1, dim=0), split_layout(t, parts=1, dim=0), allow_cast=True)
