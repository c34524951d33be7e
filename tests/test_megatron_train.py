"""The production training stack (``adapters/megatron/train.py``) on real megatron-core, CPU gloo.

``Float16Module`` (bf16) + ``DistributedDataParallel`` (overlapped grad reduce and param gather,
distributed optimizer) + ``get_megatron_optimizer`` (adam), every step through
``get_forward_backward_func()``. Oracles: HF transformers' log-probs of the same checkpoint, a
PP1 (single-process) megatron run of the same weights, TP replicas that must stay identical, and
the distributed optimizer's own shards (stale params before the param all-gather).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_reshard.adapters.megatron.build import init_megatron
from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.layout.spec import load_model_spec
from mcore_reshard.infra.checkpoint import load_canonical, make_tiny_checkpoint
from support.megatron import run_world  # warm rank processes, one per world size (conftest.py)

pytestmark = pytest.mark.slow

A = [3, 17, 998, 42, 5, 600, 7, 123, 999, 0, 77, 250]
B = [11, 500, 2, 64, 901, 33, 8, 420, 19, 700, 1, 5]
BATCH = [A, B]
STEPS = 3
#: Params replicated over TP (each TP rank must hold the same values after every step).
_TP_REPLICATED = ("layernorm", "router.weight")


# --------------------------------------------------------------------------- jobs (spawned)


def train_job(ctx: WorldCtx, par: MegatronParallel, ckpt: str, settings_kw: dict[str, Any],
              batch: list[list[int]], steps: int) -> dict[str, Any]:
    """Build the policy, load ``ckpt``, log-probs, ``steps`` train steps, sync, log-probs."""
    from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy

    settings = TrainSettings(**settings_kw)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    spec = load_model_spec(ckpt, dtype=settings.dtype)
    pol = build_policy(spec, par, settings)
    pol.load_canonical(load_canonical(ckpt))
    main_loaded = _main_params_match_model(pol)
    loaded = {n: p.detach().clone() for n, p in pol.local_params().items()}
    lp0 = pol.logprobs(batch)
    seen: list[tuple[int, int, bool, str]] = []

    def grpo_like(lp: torch.Tensor, index: int) -> torch.Tensor:
        seen.append((index, lp.shape[0], lp.requires_grad, str(lp.dtype)))
        return -lp.mean()  # same objective as the default; checks the hook's contract

    losses = [pol.train_step(batch, loss_fn=grpo_like if i == 0 else None) for i in range(steps)]
    pol.sync_params()
    params = {n: p.detach().clone() for n, p in pol.local_params().items()}
    return dict(
        rank=ctx.rank, lp0=lp0, lp1=pol.logprobs(batch), losses=losses, seen=seen, main_loaded=main_loaded,
        param_dtypes=sorted({str(p.dtype) for p in params.values()}),
        desc_dtypes=sorted({d.dtype for d in pol.describe()}),
        chunk_types=[type(c).__name__ + "(" + type(c.module).__name__ + ")" for c in pol.chunks],
        optimizer=type(pol.optimizer).__name__,
        replicated={n: p for n, p in params.items() if any(k in n for k in _TP_REPLICATED)},
        loaded_replicated={n: p for n, p in loaded.items() if any(k in n for k in _TP_REPLICATED)},
    )


def _main_params_match_model(pol) -> bool:
    """The distributed optimizer's fp32 main shards hold exactly this rank's model-param shards
    (bf16: a separate fp32 copy, refreshed by ``reload_model_params``; fp32: views)."""
    opts = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    pairs = [(m, s) for o in opts for gm, gs in zip(o.shard_fp32_from_float16_groups, o.shard_float16_groups)
             for m, s in zip(gm, gs)]
    pairs += [(m, m) for o in opts for g in o.shard_fp32_groups for m in g]
    return bool(pairs) and all(torch.equal(m.to(s.dtype), s) for m, s in pairs)


def stale_job(ctx: WorldCtx, par: MegatronParallel, ckpt: str, overlap_param_gather: bool) -> dict[str, Any]:
    """One step, then the params as a refit would read them: before and after ``sync_params``,
    and the optimizer's own fp32 main-param shards cast to the model dtype."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy

    settings = TrainSettings(dtype="bfloat16", overlap_param_gather=overlap_param_gather, lr=1e-2)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    spec = load_model_spec(ckpt, dtype="bfloat16")
    pol = build_policy(spec, par, settings)
    pol.load_canonical(load_canonical(ckpt))
    loaded = {n: p.detach().clone() for n, p in pol.local_params().items()}
    loss = pol.train_step(BATCH)
    before = {n: p.detach().clone() for n, p in pol.local_params().items()}
    # The optimizer's shard of the (bf16) param buffer == its fp32 main params cast to bf16.
    opts = getattr(pol.optimizer, "chained_optimizers", [pol.optimizer])
    mains = [p for o in opts for g in o.shard_fp32_from_float16_groups for p in g]
    models = [p for o in opts for g in o.shard_float16_groups for p in g]
    main_matches_own_shard = all(torch.equal(m.to(torch.bfloat16), s) for m, s in zip(mains, models))
    buckets = [b for c in pol.chunks for buf in c.buffers for b in buf.buckets]
    dp = pol.chunks[0].bucket_groups[0].intra_distributed_optimizer_instance_size
    dp_rank = pol.chunks[0].bucket_groups[0].intra_distributed_optimizer_instance_rank
    own_before = [shard_buffer(b.param_data, dp)[dp_rank].clone() for b in buckets]
    pol.sync_params()
    after = {n: p.detach().clone() for n, p in pol.local_params().items()}
    own_after = [shard_buffer(b.param_data, dp)[dp_rank].clone() for b in buckets]
    pol.sync_params()  # idempotent
    again = {n: p.detach().clone() for n, p in pol.local_params().items()}
    lp_synced = pol.logprobs(BATCH)
    return dict(rank=ctx.rank, loss=loss, loaded=loaded, before=before, after=after, again=again, dp=dp,
                main_matches_own_shard=main_matches_own_shard and len(mains) > 0,
                own_shard_kept=all(torch.equal(x, y) for x, y in zip(own_before, own_after)),
                lp_synced=lp_synced)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_ckpt")
    return dict(dense=str(make_tiny_checkpoint(root / "dense")), moe=str(make_tiny_checkpoint(root / "moe", moe=True)),
                tied=str(make_tiny_checkpoint(root / "tied", overrides=dict(tie_word_embeddings=True))))


def _hf_logprobs(ckpt: str, batch) -> list[list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    x = torch.tensor(batch)
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits.float(), dim=-1)
    return [[float(lp[s, i - 1, t]) for i, t in enumerate(seq) if i > 0] for s, seq in enumerate(batch)]


@pytest.fixture(scope="module")
def hf_lp(ckpts):
    return {k: _hf_logprobs(ckpts[k], BATCH) for k in ("dense", "moe")}


_REFS: dict[tuple[str, str], dict[str, Any]] = {}


def _reference(ckpts, kind: str, dtype: str) -> dict[str, Any]:
    """PP1 / TP1 single-process run of the same weights and settings (cached per module)."""
    key = (kind, dtype)
    if key not in _REFS:
        par = MegatronParallel()
        _REFS[key] = run_world(train_job, 1, (par, ckpts[kind], dict(dtype=dtype), BATCH, STEPS), timeout_s=240)[0]
    return _REFS[key]


def _close(a, b, atol: float) -> None:
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=atol)


def _check_training(res, batch=BATCH) -> None:
    for r in res:
        assert r["main_loaded"], "optimizer main params do not hold the loaded weights"
        losses = r["losses"]
        assert losses[-1] < losses[0] - 0.1, losses
        # The first step's loss is the mean next-token CE of the weights logprobs() saw.
        first = sum(-sum(lp) / len(lp) for lp in r["lp0"]) / len(r["lp0"])
        assert abs(losses[0] - first) < 2e-2, (losses[0], first)
        assert sum(map(sum, r["lp1"])) > sum(map(sum, r["lp0"]))
        # The loss_fn hook: one call per sequence, T-1 fp32 log-probs that require grad.
        mine = sorted(r["seen"])
        assert all(n == len(batch[0]) - 1 and grad and dt == "torch.float32" for _, n, grad, dt in mine), mine
        assert all(x == res[0]["losses"] for x in [r["losses"]])
        assert r["lp1"] == res[0]["lp1"], "every rank returns the same log-probs"


def _check_tp_replicas(res) -> None:
    """Params replicated over TP are identical on the TP pair (ranks 0, 1) after training, and
    the q/k layernorms did change (so their TP-partial grads really were summed)."""
    a, b = res[0]["replicated"], res[1]["replicated"]
    assert a.keys() == b.keys() and any("q_layernorm" in n for n in a)
    for n in a:
        assert torch.equal(a[n], b[n]), f"TP replicas of {n} diverged"
    changed = [n for n in a if "k_layernorm" in n and not torch.equal(a[n], res[0]["loaded_replicated"][n])]
    assert changed, "k_layernorm did not train"


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind,par", [("dense", MegatronParallel(tp=2)),
                                      ("moe", MegatronParallel(tp=2, ep=2, etp=1))], ids=["tp2", "tp2xep2-moe"])
def test_bf16_float16module_ddp_distributed_optimizer(ckpts, hf_lp, kind, par):
    res = run_world(train_job, par.world_size, (par, ckpts[kind], dict(dtype="bfloat16"), BATCH, STEPS), timeout_s=240)
    r0 = res[0]
    assert r0["chunk_types"] == ["DistributedDataParallel(Float16Module)"]
    assert r0["optimizer"] in ("DistributedOptimizer", "ChainedOptimizer")
    for r in res:
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["desc_dtypes"] == ["bfloat16"]
        # Loaded through the descriptors: bf16 megatron log-probs == HF fp32 within bf16 noise.
        _close(r["lp0"], hf_lp[kind], atol=0.05)
    _check_training(res)
    _check_tp_replicas(res)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_param_gather", "no_overlap"])
def test_params_stale_until_sync_with_distributed_optimizer(ckpts, overlap):
    """TP1 x DP2: each DP rank's optimizer updates only its own shard of the bf16 params; with
    ``overlap_param_gather`` the other shard is stale until the next forward's all-gather, so a
    refit must call ``sync_params`` first. Without overlap the step gathers at once."""
    par = MegatronParallel(dp=2)
    res = run_world(stale_job, 2, (par, ckpts["dense"], overlap), timeout_s=240)
    for r in res:
        assert r["dp"] == 2
        assert r["main_matches_own_shard"], "own shard != fp32 main params cast to bf16"
        assert r["own_shard_kept"], "the gather must not change this rank's own shard"
        for n in r["after"]:
            assert torch.equal(r["after"][n], r["again"][n]), "sync_params is not idempotent"
            assert torch.equal(r["after"][n], res[0]["after"][n]), f"DP replicas of {n} differ after sync"
        assert any(not torch.equal(r["after"][n], r["loaded"][n]) for n in r["after"]), "the step changed nothing"
        stale = [n for n in r["before"] if not torch.equal(r["before"][n], r["after"][n])]
        # The not-yet-gathered part of the stale read is exactly the pre-step weights.
        if overlap:
            assert stale, f"rank {r['rank']}: expected stale params before the gather"
            for n in stale:
                diff = r["before"][n] != r["after"][n]
                assert torch.equal(r["before"][n][diff], r["loaded"][n][diff])
        else:
            assert not stale, f"rank {r['rank']}: params changed by a sync without overlap: {stale[:3]}"
    if overlap:
        differ = [n for n in res[0]["before"] if not torch.equal(res[0]["before"][n], res[1]["before"][n])]
        assert differ, "without sync the two DP replicas must disagree"
    assert res[0]["lp_synced"] == res[1]["lp_synced"]


_PP_CASES = {
    "pp2-fp32": ("dense", "float32", MegatronParallel(pp=2)),
    "pp2-bf16": ("dense", "bfloat16", MegatronParallel(pp=2)),
    "pp2xvpp2-fp32": ("dense", "float32", MegatronParallel(pp=2, vpp=2)),
    "pp2-uneven-1-3-fp32": ("dense", "float32", MegatronParallel(pp=2, first_stage_layers=1, last_stage_layers=3)),
    "pp2xdp2xep2-moe-fp32": ("moe", "float32", MegatronParallel(pp=2, dp=2, ep=2)),
    # Tied embeddings: the last stage's output-layer copy, kept equal by finalize_model_grads.
    "pp2-tied-fp32": ("tied", "float32", MegatronParallel(pp=2)),
}


@pytest.mark.parametrize("case", list(_PP_CASES))
def test_pipeline_schedule_matches_pp1(ckpts, case):
    """Training and log-probs through megatron's pipeline schedules (1F1B, interleaved for
    virtual stages, uneven stages, PP x EP, tied embeddings) agree with a PP1 run of the same
    weights."""
    kind, dtype, par = _PP_CASES[case]
    batch = BATCH * par.dp if par.dp > 1 else BATCH  # every DP rank sees the same two sequences
    res = run_world(train_job, par.world_size, (par, ckpts[kind], dict(dtype=dtype), batch, STEPS), timeout_s=240)
    ref = _reference(ckpts, kind, dtype)
    tol = 1e-4 if dtype == "float32" else 2e-2
    _check_training(res, batch)
    wrapped = "Float16Module" if dtype == "bfloat16" else "GPTModel"
    for r in res:
        assert r["param_dtypes"] == [f"torch.{dtype}"]
        assert r["chunk_types"] == [f"DistributedDataParallel({wrapped})"] * par.vpp
        _close(r["lp0"][:2], ref["lp0"], atol=tol)
        _close(r["losses"][:1], ref["losses"][:1], atol=tol)
        # After Adam steps rounding differences can flip near-zero updates: a bit looser.
        _close(r["losses"], ref["losses"], atol=10 * tol)
        _close(r["lp1"][:2], ref["lp1"], atol=10 * tol)
