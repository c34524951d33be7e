"""Tensors both sides keep in a dtype wider than the wire's (DeepSeek's fp32 router bias in a
bf16 refit) are carried as their bits, reinterpreted, never cast: planner, executor, report."""

from __future__ import annotations

import dataclasses
import math
import traceback
from typing import Any

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import TINY_DEEPSEEK_V3
from mcore_reshard.layout.descriptor import DTYPE_BYTES
from mcore_reshard.layout.spec import spec_from_hf_config
from mcore_reshard.transport.views import TORCH_DTYPES, local_view, materialize_local
from mcore_reshard.plan import PlanError, build_plan, plan_report
from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire
from mcore_reshard.infra.ports import free_port
from mcore_reshard.transport.executor import TensorSink, TransferOptions, execute_plan
from mcore_reshard.transport.group import RankMap, RefitGroup
from mcore_reshard.wire.faults import Fault
from mcore_reshard.testing.local_plan import run_plan_locally
from support.worlds import canonical, expected_equal, refit_once, spawn_ranks
from toy_layouts import split_layout

BIAS = "mlp.gate.e_score_correction_bias"


def _deepseek(dtype: str = "bfloat16"):
    spec = spec_from_hf_config(TINY_DEEPSEEK_V3, dtype=dtype)
    return spec, megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1)), vllm_layout(spec, VllmParallel(tp=2))


def _real_bytes(layout) -> int:
    return sum((p.numel - p.padding) * DTYPE_BYTES[p.dtype] for p in layout.params)


def _simulate(src, dst, plan, seed: int = 0) -> None:
    """Sources from random canonical tensors in their own dtypes, the plan run in-process,
    every destination tensor compared bit for bit (padding zero)."""
    g = torch.Generator().manual_seed(seed)
    canon = {n: torch.randn(s, generator=g).to(TORCH_DTYPES[d]) for n, (s, d) in src.tensors.items()}
    src_t = {r: {} for r in range(src.world_size)}
    for p in src.params:
        src_t[p.rank][p.name] = materialize_local(p, canon)
    dst_t = {r: {} for r in range(dst.world_size)}
    for p in dst.params:
        dst_t[p.rank][p.name] = torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype])
    assert run_plan_locally(plan, src_t, dst_t) == plan.bytes_planned == plan.bytes_min
    for p in dst.params:
        got, want = dst_t[p.rank][p.name], materialize_local(p, canon)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (p.rank, p.name)


def test_deepseek_bf16_plans_with_the_fp32_router_bias_as_bits():
    spec, src, dst = _deepseek()
    biases = [n for n in spec.tensor_table() if n.endswith(BIAS)]
    assert len(biases) == len(spec.moe_layers) == 3
    assert all(spec.tensor_table()[n][1] == "float32" for n in biases)
    assert {p.dtype for p in src.params if p.name.endswith("router.expert_bias")} == {"float32"}
    assert {p.dtype for p in dst.params if p.name.endswith(BIAS)} == {"float32"}
    plan = build_plan(src, dst, bucket_bytes=1 << 14)
    assert plan.dtype == "bfloat16" and plan.casts == ()
    assert plan.reinterpret == tuple((n, "float32") for n in biases)
    # real bytes: every router bias at 4 bytes per element, once per vLLM TP rank
    assert plan.bytes_planned == plan.bytes_min == _real_bytes(dst)
    bias_bytes = sum(t.nbytes for t in plan.transfers if t.canonical.endswith(BIAS))
    assert bias_bytes == len(biases) * spec.num_experts * 4 * 2
    # every destination element exactly once, in wire units (2 bf16 per fp32 element)
    got: dict[tuple[int, str], int] = {}
    for t in plan.transfers:
        got[(t.dst, t.dst_name)] = got.get((t.dst, t.dst_name), 0) + t.box.numel
    for p in dst.params:
        r = DTYPE_BYTES[p.dtype] // 2
        assert got[(p.rank, p.name)] == (p.numel - p.padding) * r, p.name
    # per-rank slices name the local tensors to view as bf16, and survive the wire
    for side, world in (("src", src.world_size), ("dst", dst.world_size)):
        for r in range(world):
            s = plan.for_rank(side, r)
            suffix = "router.expert_bias" if side == "src" else BIAS
            assert s.reinterpret and all(n.endswith(suffix) and d == "float32" for n, d in s.reinterpret)
            back = slice_from_wire(slice_to_wire(s))
            assert back.reinterpret == s.reinterpret and back.digest() == s.digest()
    _simulate(src, dst, plan)
    # the report groups them
    rep = plan_report(plan)
    assert [r["tensor"] for r in rep.to_json()["reinterpret"]] == biases
    assert (f"reinterpreted: model.layers.*.{BIAS} (x 3 layers) carried as float32 bits in a bfloat16 plan"
            in rep.table())


def test_deepseek_fp32_plan_is_unchanged_and_digests_only_move_with_bits():
    _, src, dst = _deepseek("float32")
    plan = build_plan(src, dst)
    assert plan.reinterpret == () and all(not plan.for_rank("dst", r).reinterpret for r in range(2))
    assert "reinterpret" not in slice_to_wire(plan.for_rank("dst", 0))
    assert plan.bytes_min == _real_bytes(dst)


def test_toy_mixed_plan_simulates_bit_exact_with_splits_and_replicas():
    t = {"a": ((12, 8), "bfloat16"), "bias": ((8,), "float32"), "m": ((6, 4), "float32"),
         "c": ((6, 4, 4), "bfloat16")}
    src = split_layout(t, parts=2, dim=0, replicas=2)
    dst = split_layout(t, parts=2, dim=1, replicas=2, pad_rows=1)
    plan = build_plan(src, dst, bucket_bytes=32)
    assert plan.reinterpret == (("bias", "float32"), ("m", "float32"))
    assert plan.bytes_min == _real_bytes(dst)
    _simulate(src, dst, plan, seed=3)


def test_what_cannot_be_carried_as_bits_stays_an_error():
    # two dtypes of one width: neither is a whole number of the other's elements
    t = {"w": ((8, 4), "float16"), "b": ((4,), "bfloat16")}
    with pytest.raises(PlanError, match="mixed element types on the destination"):
        build_plan(split_layout(t, parts=1, dim=0), split_layout(t, parts=1, dim=0))
    # the wire is the narrowest dtype: fp32 weights beside a small bf16 tensor go as bf16 bits
    t = {"w": ((8, 4), "float32"), "b": ((4,), "bfloat16")}
    plan = build_plan(split_layout(t, parts=1, dim=0), split_layout(t, parts=1, dim=0))
    assert plan.dtype == "bfloat16" and plan.reinterpret == (("w", "float32"),) and plan.bytes_min == 32 * 4 + 4 * 2
    # a cast into a dtype other than the wire's
    t16 = {"w": ((8, 4), "bfloat16"), "b": ((4,), "bfloat16")}
    t32b = {"w": ((8, 4), "bfloat16"), "b": ((4,), "float32")}
    with pytest.raises(PlanError, match="mixed element types on the destination"):
        build_plan(split_layout(t16, parts=1, dim=0), split_layout(t32b, parts=1, dim=0), allow_cast=True)
    # a bucket budget that would cut an fp32 element into two halves
    tb = {"w": ((8, 4), "bfloat16"), "b": ((6,), "float32")}
    with pytest.raises(PlanError, match="cuts its float32 elements"):
        build_plan(split_layout(tb, parts=1, dim=0), split_layout(tb, parts=1, dim=0), bucket_bytes=6)
    # casts still work next to bits: fp32 source weights into a bf16 engine, fp32 bias on both
    s = {"w": ((8, 4), "float32"), "b": ((4,), "float32")}
    d = {"w": ((8, 4), "bfloat16"), "b": ((4,), "float32")}
    plan = build_plan(split_layout(s, parts=2, dim=0), split_layout(d, parts=1, dim=0), allow_cast=True)
    assert plan.casts == (("w", "float32", "bfloat16"),) and plan.reinterpret == (("b", "float32"),)
    assert plan.bytes_min == 32 * 2 + 4 * 4
    _simulate(split_layout(s, parts=2, dim=0), split_layout(d, parts=1, dim=0), plan, seed=5)
    # a source param in the wrong dtype for its (reinterpreted) tensor is named
    src = split_layout(d, parts=1, dim=0)
    bad = tuple(dataclasses.replace(p, dtype="bfloat16") if p.name == "local.b" else p for p in src.params)
    with pytest.raises(PlanError, match="holds bfloat16 but b is float32"):
        build_plan(dataclasses.replace(src, params=bad), split_layout(d, parts=1, dim=0))


# -- the executor on gloo ----------------------------------------------------------------------

#: bf16 plan (bf16 holds most elements) with fp32 tensors: a small bias (packed) and "w32"
#: whose row halves (256 KiB each) go zero-copy (``Sink.target``/``landed`` in wire units over
#: the real tensor), like "e"'s.
TM = {"a": ((12, 8), "bfloat16"), "bias": ((8,), "float32"), "w32": ((256, 512), "float32"),
      "e": ((512, 512), "bfloat16"), "c": ((6, 4, 4), "bfloat16")}
ZERO_COPY = 256 * 512 * 4 + 512 * 512 * 2


class _ResolveOnly:
    """The smallest sink (``resolve``, ``commit_box``): the fp32 bias is resolved in its own dtype
    and seen as wire elements by the transport (``ReinterpretSink``)."""

    def __init__(self, tensors) -> None:
        self.tensors = tensors

    def resolve(self, name, view):
        return local_view(self.tensors[name], view)

    def commit_box(self, name, view) -> None:
        pass


def _mixed_main(rank: int, world: int, port: int, q: Any) -> None:
    """2 sources (row halves) -> 1 destination (whole tensors), wire bf16."""
    out: dict[str, Any] = {}
    try:
        torch.set_num_threads(1)
        src = split_layout(TM, parts=2, dim=0)
        dst = split_layout(TM, parts=1, dim=0)
        plan = build_plan(src, dst, bucket_bytes=1 << 20)
        out["plan"] = (plan.dtype, plan.reinterpret, plan.bytes_min)
        rm = RankMap.disaggregated(2, 1)
        s_rank, d_rank = rm.roles(rank)
        group = RefitGroup.create("127.0.0.1", port, rank, world, 20.0, rank == 0, rank_map=rm)
        out["ok"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 3, tensors=TM)
        out["plain"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 4, tensors=TM,
                                  sink=lambda d: _ResolveOnly(d))
        # a corrupted fp32 bias element on the destination is caught and named
        out["flip"] = refit_once(plan, src, dst, s_rank, d_rank, group, rm, 5, tensors=TM,
                                 fault=Fault("bitflip", tensor="local.bias") if d_rank == 0 else None)
        group.close()
    except BaseException:  # noqa: BLE001 -- ship every failure to the parent
        out["crash"] = traceback.format_exc()
    q.put((rank, out))


@pytest.mark.slow
def test_executor_carries_fp32_bits_in_a_bf16_refit():
    res = spawn_ranks(_mixed_main, 3, free_port(), wait_s=60.0)
    dtype, reinterpret, bytes_min = res[0]["plan"]
    assert dtype == "bfloat16" and reinterpret == (("bias", "float32"), ("w32", "float32"))
    assert bytes_min == 12 * 8 * 2 + 8 * 4 + ZERO_COPY + 6 * 4 * 4 * 2
    for key in ("ok", "plain"):
        got = res[2][key]
        assert got["err"] is None and got["bad"] == [], (key, got)
        assert got["stats"].verified and got["stats"].bytes_received == bytes_min
    assert res[2]["ok"]["stats"].bytes_zero_copy == ZERO_COPY  # both halves of w32 and e
    assert res[2]["plain"]["stats"].bytes_zero_copy == ZERO_COPY  # received into what the sink resolves
    for r in (0, 1):
        st = res[r]["ok"]["stats"]
        assert st.verified and st.bytes_sent == bytes_min // 2
    err = res[2]["flip"]["err"]
    assert err is not None and "checksum mismatch" in err and "local.bias" in err, err
    assert res[2]["flip"]["bad"] == ["local.bias"]


def test_tensor_sink_in_process_round_trip():
    """One process, both roles (a colocated rank copies to itself): the sink adapter writes
    fp32 bits into the real tensor and the checksums agree."""
    src = split_layout(TM, parts=1, dim=0)
    dst = split_layout(TM, parts=1, dim=1)
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    canon = canonical(TM, 9)
    s = {p.name: materialize_local(p, canon) for p in src.params}
    d = {p.name: torch.full(p.shape, float("nan"), dtype=TORCH_DTYPES[p.dtype]) for p in dst.params}
    group = RefitGroup.create("127.0.0.1", free_port(), 0, 1, 20.0, True, rank_map=RankMap.colocated(1))
    try:
        st = execute_plan(plan.for_rank("src", 0), plan.for_rank("dst", 0), s, TensorSink(d), group,
                          TransferOptions(20.0, plan_digest=plan.digest()))
    finally:
        group.close()
    assert st.verified and expected_equal(dst, 0, canon, d) == []
    assert math.isfinite(float(d["local.bias"].sum()))


@pytest.mark.heavy  # imports megatron-core (~4 s)
def test_live_expert_bias_is_read_in_fp32_as_training_uses_it():
    """Float16Module's cast reaches megatron's expert_bias buffer until the router's first
    forward puts it back in fp32; the live reader does that megatron step itself (rules: fp32)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from mcore_reshard.adapters.megatron.live import named_local_params

    class Router(torch.nn.Module):
        _maintain_float32_expert_bias = TopKRouter._maintain_float32_expert_bias

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 2))
            self.register_buffer("expert_bias", torch.tensor([0.1, -0.2, 0.3, 1e-3]))

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.decoder.layers[0].mlp = torch.nn.Module()
    model.decoder.layers[0].mlp.router = Router()
    model.bfloat16()  # what Float16Module does
    assert model.decoder.layers[0].mlp.router.expert_bias.dtype == torch.bfloat16
    got = named_local_params([model])
    bias = got["decoder.layers.0.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and got["decoder.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    assert bias is model.decoder.layers[0].mlp.router.expert_bias  # the live buffer, not a copy
