"""The live megatron adapter against megatron-core itself (2-process gloo jobs on CPU).

Each job builds a real GPTModel, describes it, and cross-checks the descriptors element by
element against megatron's own ``sharded_state_dict()``; the functional jobs load a tiny HF
checkpoint through the descriptors and compare megatron's logits with HF transformers'.
"""

from __future__ import annotations

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import TIED_OUTPUT_NOTE, MegatronParallel, megatron_layout, \
    megatron_rank_params
from mcore_reshard.layout import spec_from_hf_config
from mcore_reshard.infra.checkpoint import TINY_DENSE, TINY_MOE, make_tiny_checkpoint
from support.megatron import run_world  # warm rank processes, one per world size (conftest.py)

from _megatron_jobs import canonical_ids, layout_job

pytestmark = pytest.mark.slow

TOKENS = [3, 17, 998, 42, 5, 600, 7, 123, 999, 0, 77, 250]
#: Tied embeddings, and one KV group at TP2 (ng < tp: each rank holds half of the group block).
TIED = dict(TINY_DENSE, tie_word_embeddings=True, num_key_value_heads=1)


def _run(par: MegatronParallel, cfg, ckpt=None, train_steps: int = 0):
    return run_world(layout_job, par.world_size, (par, cfg, str(ckpt) if ckpt else None, TOKENS, train_steps),
                     timeout_s=240)


def _check_layout(results, par: MegatronParallel, cfg) -> None:
    """Descriptors == rules; descriptors == sharded_state_dict placement; main replicas
    cover every canonical element exactly once."""
    spec = spec_from_hf_config(cfg, dtype="float32")
    ids = canonical_ids(spec)
    total = sum(t.numel() for t in ids.values())
    main_count = torch.zeros(total, dtype=torch.int64)
    held = torch.zeros(total, dtype=torch.bool)
    for res in results:
        rank = res["rank"]
        assert res["descs"] == megatron_rank_params(spec, par, rank)
        assert res["world_params"] == megatron_layout(spec, par).params
        names = {d.name for d in res["descs"]}
        tied_copy = {n for n in res["live_names"] if spec.tied and par.pp > 1 and n.endswith("output_layer.weight")}
        assert names == set(res["live_names"]) - tied_copy
        assert set(res["oracle"]) | tied_copy == set(res["live_names"]), res["unmatched"]
        for name in names:
            pred, orac = res["predicted"][name], res["oracle"][name]
            assert torch.equal(pred, orac), f"rank {rank} {name}: descriptor placement != sharded_state_dict"
            real = orac >= 0
            held[orac[real]] = True
            main_count.index_add_(0, orac[real & res["main"][name]], torch.ones_like(orac[real & res["main"][name]]))
    assert held.all(), "some canonical elements are held by no rank"
    assert torch.equal(main_count, torch.ones_like(main_count)), "main replicas must cover each element once"


def _check_logits(results, atol=2e-5):
    hf = results[0]["hf_logits"]
    for res in results:
        torch.testing.assert_close(res["logits"], hf, rtol=1e-4, atol=atol)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return dict(
        dense=make_tiny_checkpoint(root / "dense"),
        moe=make_tiny_checkpoint(root / "moe", moe=True),
        tied=make_tiny_checkpoint(root / "tied", overrides=dict(tie_word_embeddings=True, num_key_value_heads=1)),
    )


def test_dense_tp2_placement_logits_and_training(ckpts):
    par = MegatronParallel(tp=2)
    res = _run(par, TINY_DENSE, ckpts["dense"], train_steps=3)
    _check_layout(res, par, TINY_DENSE)
    _check_logits(res)
    losses = res[0]["losses"]
    assert losses[-1] < losses[0], losses  # backward + AdamW run on CPU and learn


def test_moe_ep2_placement_and_logits(ckpts):
    par = MegatronParallel(dp=2, ep=2)
    res = _run(par, TINY_MOE, ckpts["moe"])
    _check_layout(res, par, TINY_MOE)
    _check_logits(res)


def test_moe_tp2_ep2_etp1_placement_and_logits(ckpts):
    par = MegatronParallel(tp=2, ep=2, etp=1)
    res = _run(par, TINY_MOE, ckpts["moe"])
    _check_layout(res, par, TINY_MOE)
    _check_logits(res)


def test_moe_tp2_expert_tp2_placement_and_logits(ckpts):
    par = MegatronParallel(tp=2, etp=None)  # megatron's default: etp = tp
    res = _run(par, TINY_MOE, ckpts["moe"])
    _check_layout(res, par, TINY_MOE)
    _check_logits(res)


def test_dense_tied_single_kv_group_tp2_placement_and_logits(ckpts):
    par = MegatronParallel(tp=2)
    res = _run(par, TIED, ckpts["tied"])
    _check_layout(res, par, TIED)
    assert not any("output_layer" in n for r in res for n in r["live_names"])
    _check_logits(res)


def test_dense_pp2_placement():
    par = MegatronParallel(pp=2)
    res = _run(par, TINY_DENSE)
    _check_layout(res, par, TINY_DENSE)
    assert "embedding.word_embeddings.weight" in res[0]["live_names"]
    assert "output_layer.weight" in res[1]["live_names"]


def test_dense_pp2_vpp2_placement():
    par = MegatronParallel(pp=2, vpp=2)
    res = _run(par, TINY_DENSE)
    _check_layout(res, par, TINY_DENSE)
    # 4 layers, pp 2, vpp 2: stage 0 holds layers [0] and [2], stage 1 holds [1] and [3]
    qkv = {r["rank"]: sorted(p.pieces[0].canonical.split(".")[2] for p in r["descs"]
                             if p.name.endswith("linear_qkv.weight")) for r in res}
    assert qkv == {0: ["0", "2"], 1: ["1", "3"]}


def test_moe_uneven_pp2_placement():
    par = MegatronParallel(pp=2, first_stage_layers=1, last_stage_layers=3)
    res = _run(par, TINY_MOE)
    _check_layout(res, par, TINY_MOE)
    n_layers = [len({p.name.split(".")[2] for p in r["descs"] if p.name.startswith("decoder.layers.")}) for r in res]
    assert n_layers == [1, 3]
