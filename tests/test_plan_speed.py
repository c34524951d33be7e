"""The planner's fast paths change nothing: plans on fixed layouts (toy, named corner cases,
seeded draws from the property-test space, real model configs cut to a few layers) hash to the
digests the straightforward planner produced. Torch-free: layouts come from the pure rules."""

from __future__ import annotations

import dataclasses
import functools
import gc
import random

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.settings.config import resolve_model
from mcore_reshard.layout import Box, LayoutError, LocalParam, Piece, SideLayout, View
from mcore_reshard.plan import buckets, build_plan
from mcore_reshard.plan.types import Transfer, transfers_from_columns
from toy_layouts import NAMED_LAYOUTS, split_layout, tiny_spec

TOY = {"a.weight": ((12, 8), "float32"), "b.weight": ((8,), "float32"), "c.weight": ((6, 4, 4), "float32")}


def _toy_cases():
    yield "toy rows->cols replicas padding", split_layout(TOY, parts=2, dim=0, replicas=3), \
        split_layout(TOY, parts=4, dim=1, replicas=2, pad_rows=1), 64
    yield "toy replicas balanced", split_layout(TOY, parts=1, dim=0, replicas=4), \
        split_layout(TOY, parts=2, dim=0, replicas=4), 1 << 20
    yield "toy cols->rows", split_layout(TOY, parts=4, dim=1, replicas=2), split_layout(TOY, parts=2, dim=0, replicas=3), 96
    yield "toy split inside rows", split_layout({"w": ((4, 64), "float32")}, parts=1, dim=0), \
        split_layout({"w": ((4, 64), "float32")}, parts=2, dim=1), 100
    shape = (8, 4)
    fused = (Piece(0, "fused", "w", Box((0, 0), (4, 4)), View(0, (4, 4), (4, 1))),
             Piece(0, "fused", "w", Box((4, 0), (4, 4)), View(16, (4, 4), (4, 1))))
    src = SideLayout("s", 1, (LocalParam(0, "fused", shape, "float32", fused),), {"w": (shape, "float32")})
    yield "toy merge adjacent", src, split_layout({"w": (shape, "float32")}, parts=1, dim=0), 1 << 20
    # the same canonical rows twice in one destination tensor, and in two tensors of one rank
    twice = (Piece(0, "d", "w", Box((0, 0), (4, 4)), View(0, (4, 4), (4, 1))),
             Piece(0, "d", "w", Box((0, 0), (4, 4)), View(16, (4, 4), (4, 1))),
             Piece(0, "d", "w", Box((4, 0), (4, 4)), View(32, (4, 4), (4, 1))))
    other = (Piece(0, "e", "w", Box((0, 0), (8, 4)), View(0, (8, 4), (4, 1))),)
    dst = SideLayout("d", 1, (LocalParam(0, "d", (12, 4), "float32", twice), LocalParam(0, "e", shape, "float32", other)),
                     {"w": (shape, "float32")})
    yield "toy duplicate destination boxes", split_layout({"w": (shape, "float32")}, parts=2, dim=0, replicas=2), dst, 48


NAMED = NAMED_LAYOUTS  # the named corner cases shared with test_plan_properties


def _random_case(rng: random.Random):
    """One draw from the space ``test_plan_properties.layouts`` explores, seeded."""
    moe, layers = rng.random() < 0.5, rng.randint(2, 6)
    spec_kw = dict(moe=moe, nkv=rng.choice([1, 2, 4]), p=rng.choice([1, 2, 3, 4]), layers=layers, tied=rng.random() < 0.5,
                   bias=rng.random() < 0.5, vocab=rng.randint(40, 300), dtype=rng.choice(["float32", "bfloat16"]),
                   experts=rng.choice([4, 8]))
    if moe and rng.random() < 0.5:
        spec_kw["moe_layers"] = tuple(i for i in range(layers) if rng.random() < 0.5)
    pp = rng.choice([1, 2])
    mpar = MegatronParallel(tp=rng.choice([1, 2, 4]), pp=pp, ep=rng.choice([1, 2, 4]), etp=rng.choice([None, 1, 2]),
                            dp=rng.choice([1, 2, 4]), vpp=rng.choice([1, 2]) if pp > 1 else 1,
                            first_stage_layers=rng.choice([None, 1]) if pp > 1 else None,
                            layer_spec=rng.choice(["local", "te"]), experts=rng.choice(["sequential", "grouped"]))
    enable_ep = moe and rng.random() < 0.5
    vpar = VllmParallel(tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2]), dp=rng.choice([1, 2]), replicas=rng.choice([1, 2]),
                        enable_ep=enable_ep, num_redundant_experts=rng.choice([0, 2]) if enable_ep else 0)
    return spec_kw, mpar, vpar


def _real(model: str, layers: int, mpar: MegatronParallel, vpar: VllmParallel):
    spec = resolve_model(model)
    first_dense = sum(1 for i in range(spec.num_layers) if not spec.is_moe(i)) if spec.moe_layers else 0
    moe_layers = tuple(range(min(first_dense, layers), layers)) if spec.moe_layers else ()
    spec = dataclasses.replace(spec, num_layers=layers, moe_layers=moe_layers)
    return megatron_layout(spec, mpar), vllm_layout(spec, vpar)


def fixed_cases():
    """(id, source layout, destination layout, bucket bytes) of every frozen-digest case."""
    yield from _toy_cases()
    for name, (kw, mpar, vpar) in NAMED.items():
        spec = tiny_spec(**kw)
        yield name, megatron_layout(spec, mpar), vllm_layout(spec, vpar), 1 << 12
    rng, found = random.Random(20261201), 0
    while found < 40:
        spec_kw, mpar, vpar = _random_case(rng)
        try:
            spec = tiny_spec(**spec_kw)
            src, dst = megatron_layout(spec, mpar), vllm_layout(spec, vpar)
        except LayoutError:
            continue
        yield f"random {found}", src, dst, 2048
        found += 1
    yield "qwen3-8b tp2.dp2 -> tp4", *_real("qwen3-8b", 36, MegatronParallel(tp=2, dp=2), VllmParallel(tp=4)), 1 << 28
    yield "qwen3-30b-a3b 2 layers default", *_real(
        "qwen3-30b-a3b", 2, MegatronParallel(tp=1, pp=2, ep=8, etp=1, dp=8, layer_spec="te", experts="grouped"),
        VllmParallel(tp=2, replicas=8)), 1 << 26
    yield "deepseek-v3-sized 4 layers", *_real(
        "deepseek-v3-sized-moe", 4, MegatronParallel(tp=1, pp=2, ep=16, etp=1, dp=16, layer_spec="te", experts="grouped"),
        VllmParallel(tp=32, dp=2, enable_ep=True)), 1 << 30
    yield "qwen3-235b-a22b 4 layers", *_real(
        "qwen3-235b-a22b", 4, MegatronParallel(tp=4, pp=2, ep=16, etp=1, dp=4, layer_spec="te", experts="grouped"),
        VllmParallel(tp=8, dp=8, enable_ep=True)), 1 << 27


#: ``plan.digest()`` of every case, computed with the planner before its fast paths (one sort
#: per phase, a Box and a tuple per fragment). The digest covers every transfer's ranks,
#: tensor, box, both views and bucket: equal digests are bit-identical plans.
REFERENCE_DIGESTS = {
    'toy rows->cols replicas padding': 'd033469990480425',  # 40 transfers, 6 buckets
    'toy replicas balanced': 'f0e338670d21fc48',  # 24 transfers, 1 buckets
    'toy cols->rows': '1c9f26730d2a33ea',  # 60 transfers, 6 buckets
    'toy split inside rows': '6420708dd3ecb1e1',  # 16 transfers, 11 buckets
    'toy merge adjacent': 'dd83f29baa04fd97',  # 1 transfers, 1 buckets
    'toy duplicate destination boxes': '6bae594e6d219e03',  # 10 transfers, 7 buckets
    'dense tp2 -> tp1': '6c7c96cd83ad29d9',  # 81 transfers, 20 buckets
    'ng<tp split inside a head (ng=1, P=4, tp=4)': 'e9407cdff3adf2ba',  # 208 transfers, 7 buckets
    'ng<tp, kv replicated in vLLM': '000c84cc460078e4',  # 188 transfers, 10 buckets
    'qkv bias, tied, dp replicas': 'e5e750765677eb50',  # 236 transfers, 8 buckets
    'uneven pp + vpp': '509cae85a411a232',  # 93 transfers, 14 buckets
    'moe ep2 etp1 -> vllm tp2': '704b69def11ebb30',  # 274 transfers, 14 buckets
    'moe etp2 != tp1 grouped te': 'bde31a2c5568098c',  # 540 transfers, 9 buckets
    'moe -> vllm ep + redundant': '77b21e399291a1f6',  # 308 transfers, 16 buckets
    'moe -> vllm dp moe-tp flatten': 'cc60adde65548fa6',  # 548 transfers, 14 buckets
    'mixed dense/moe layers bf16': '9d2086e234f20d2b',  # 188 transfers, 5 buckets
    'padded vocab both sides': 'e75a4bb35852b435',  # 1012 transfers, 26 buckets
    'uneven first/last stage': 'e77bd1f919bc8d30',  # 79 transfers, 22 buckets
    'random 0': '1c5bd3d22c2a6b67',  # 304 transfers, 28 buckets
    'random 1': '3cea2c7746b5c372',  # 776 transfers, 27 buckets
    'random 2': '4f76c475bfc69616',  # 552 transfers, 13 buckets
    'random 3': '1d16453111905712',  # 366 transfers, 9 buckets
    'random 4': 'fb0bd6d9a3b6b384',  # 246 transfers, 40 buckets
    'random 5': 'e4ccf2beba64c06a',  # 276 transfers, 12 buckets
    'random 6': '0f447cc74263f998',  # 464 transfers, 19 buckets
    'random 7': '456af90a91b18d4e',  # 736 transfers, 33 buckets
    'random 8': 'fefd472a0f33db21',  # 256 transfers, 24 buckets
    'random 9': 'b01c6bf338384111',  # 912 transfers, 19 buckets
    'random 10': 'ffa03b7241ba4ccc',  # 656 transfers, 17 buckets
    'random 11': 'cd2060d8c680b072',  # 204 transfers, 39 buckets
    'random 12': '58b2499ba86f2e55',  # 352 transfers, 18 buckets
    'random 13': '9fd1658189843052',  # 368 transfers, 31 buckets
    'random 14': 'aff621c16fb9e59d',  # 188 transfers, 23 buckets
    'random 15': '03a3970c5faa6162',  # 226 transfers, 13 buckets
    'random 16': '95c25f00bb2f5339',  # 384 transfers, 16 buckets
    'random 17': '8f20e018b75e7990',  # 234 transfers, 58 buckets
    'random 18': 'c325b05247a2e3fb',  # 472 transfers, 17 buckets
    'random 19': '957eeaa3d564d1f6',  # 600 transfers, 20 buckets
    'random 20': '1d70508a8c06930f',  # 224 transfers, 9 buckets
    'random 21': 'bef6377333c65be8',  # 292 transfers, 22 buckets
    'random 22': '60f06fa01cc7bb38',  # 224 transfers, 21 buckets
    'random 23': 'ec87792156f8993f',  # 672 transfers, 28 buckets
    'random 24': 'c00ab4a4bf402bd4',  # 366 transfers, 6 buckets
    'random 25': '9c24fb5d855464f9',  # 448 transfers, 16 buckets
    'random 26': '50b7bb50713495d1',  # 1168 transfers, 22 buckets
    'random 27': 'd5b85abfd70560b2',  # 454 transfers, 35 buckets
    'random 28': '918e6d8869dd563a',  # 230 transfers, 13 buckets
    'random 29': '922201e0f10af187',  # 408 transfers, 7 buckets
    'random 30': 'abeb2e5ff1902caa',  # 1476 transfers, 16 buckets
    'random 31': '76c7405b4e727619',  # 70 transfers, 20 buckets
    'random 32': '37a3c47afbc5712b',  # 1168 transfers, 5 buckets
    'random 33': '26911e8f54424acd',  # 516 transfers, 18 buckets
    'random 34': '017630c9a8482e4d',  # 752 transfers, 12 buckets
    'random 35': '54404374a1ba43d3',  # 86 transfers, 7 buckets
    'random 36': 'ac79efd33b0494b0',  # 576 transfers, 5 buckets
    'random 37': 'fd51467ec4f1a208',  # 392 transfers, 7 buckets
    'random 38': 'f9675bca6963c495',  # 944 transfers, 34 buckets
    'random 39': 'c2956ae43ede2b45',  # 408 transfers, 11 buckets
    'qwen3-8b tp2.dp2 -> tp4': 'd4f954066e61ec9f',  # 2038 transfers, 18 buckets
    'qwen3-30b-a3b 2 layers default': 'be018b06f12f86b6',  # 12848 transfers, 38 buckets
    'deepseek-v3-sized 4 layers': 'd736e55d97e3460f',  # 5952 transfers, 2 buckets
    'qwen3-235b-a22b 4 layers': '471e52b9a48c4290',  # 4208 transfers, 14 buckets
}


@functools.cache
def _plans() -> list:
    """Every fixed case with its plan, built once for the tests below."""
    return [(name, src, dst, bb, build_plan(src, dst, bucket_bytes=bb)) for name, src, dst, bb in fixed_cases()]


def test_fixed_layouts_plan_to_reference_digests():
    got = {name: plan.digest() for name, _, _, _, plan in _plans()}
    assert got == REFERENCE_DIGESTS


def test_plan_invariants_on_fixed_layouts():
    """What the digests stand for, checked directly: minimal bytes, exact coverage of every
    destination tensor, the byte budget per round and rank, the documented transfer order."""
    for name, src, dst, bucket_bytes, plan in _plans():
        assert plan.bytes_planned == plan.bytes_min, name
        got: dict[tuple[int, str], int] = {}
        per_round: dict[tuple[str, int, int], int] = {}
        for t in plan.transfers:
            assert t.nbytes == t.box.numel * plan.itemsize and t.src_view.shape == t.dst_view.shape == t.box.sizes
            got[(t.dst, t.dst_name)] = got.get((t.dst, t.dst_name), 0) + t.box.numel
            for key in (("src", t.bucket, t.src), ("dst", t.bucket, t.dst)):
                per_round[key] = per_round.get(key, 0) + t.nbytes
        for p in dst.params:
            assert got.get((p.rank, p.name), 0) == p.numel - p.padding, (name, p.rank, p.name)
        assert max(per_round.values(), default=0) <= bucket_bytes, name
        order = {n: i for i, n in enumerate(dst.tensors)}
        keys = [(t.bucket, t.src, t.dst, order[t.canonical], t.box.offsets) for t in plan.transfers]
        assert keys == sorted(keys), name
        assert plan.num_buckets == (plan.transfers[-1].bucket + 1 if plan.transfers else 0), name


def test_plans_without_numpy_are_the_same(monkeypatch):
    """numpy only speeds up placement keys and sorts: the pure-Python path plans the same,
    on layouts with ties, splits, merges and replicas (and the int64 guard falls back alike)."""
    picked = [c for c in fixed_cases() if c[0].startswith("toy") or c[0] in (
        "moe -> vllm ep + redundant", "padded vocab both sides", "random 4", "qwen3-30b-a3b 2 layers default")]
    assert len(picked) == 10
    monkeypatch.setattr(buckets, "_np", None)
    for name, src, dst, bb in picked:
        assert build_plan(src, dst, bucket_bytes=bb).digest() == REFERENCE_DIGESTS[name], name
    monkeypatch.undo()
    monkeypatch.setattr(buckets, "_INT64_END", 1)  # every key "too large": Python ints
    for name, src, dst, bb in picked:
        assert build_plan(src, dst, bucket_bytes=bb).digest() == REFERENCE_DIGESTS[name], name


def test_bulk_built_transfers_equal_constructed_ones():
    """``transfers_from_columns`` makes the same frozen objects as ``Transfer(...)``."""
    box, view = Box((1, 0), (2, 4)), View(4, (2, 4), (4, 1))
    rows = [(0, 1, "w", box, "a", view, "b", view, 32, 0), (2, 3, "v", box, "c", view, "d", view, 32, 5)]
    made = transfers_from_columns(len(rows), [list(col) for col in zip(*rows)])
    assert made == [Transfer(*row) for row in rows]
    assert [hash(t) for t in made] == [hash(Transfer(*row)) for row in rows]
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].src = 5


def test_planning_leaves_the_collector_as_it_was():
    """The collector is paused while planning and the plan handed to the oldest generation:
    afterwards it runs as before, and objects someone froze stay frozen."""
    name, src, dst, bb = next(iter(fixed_cases()))
    assert gc.isenabled()
    before = gc.get_freeze_count()  # a library in this process (vLLM, Ray) may have frozen some
    build_plan(src, dst, bucket_bytes=bb)
    assert gc.isenabled() and gc.get_freeze_count() == before
    gc.disable()
    try:
        build_plan(src, dst, bucket_bytes=bb)
        assert not gc.isenabled()
    finally:
        gc.enable()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        build_plan(src, dst, bucket_bytes=bb)
        # Objects that die while frozen leave the count (other threads of a long test process
        # free some); an unfreeze by the planner would empty it.
        assert 0 <= frozen - gc.get_freeze_count() < 1000
    finally:
        gc.unfreeze()
