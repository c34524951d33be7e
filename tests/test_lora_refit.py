"""A LoRA policy refit live, on the real stack: a megatron-core TP2 bf16 policy with
Megatron-Bridge's adapters (``adapters/megatron/lora.py``; base frozen, DDP and the distributed
optimizer over the adapters only) -> a vLLM TP2 bf16 engine with LoRA slots.

The first refit moves the base weights and the adapter; every later one the adapter only, into
the engine's refit adapter slot (``adapters/vllm/lora_slots.py``), through the same vote and
commit. A fresh engine that loads the trained adapter from a PEFT directory serves the same
logprobs, bit for bit, and holds in its slots, bit for bit, what the slot layout says
(``adapters/vllm/lora_rules.py``: A and B per rank, B x alpha / r rounded in bf16, the rank
past r zero, the last slot empty).

Dense only: vLLM 0.32's CPU build cannot run an engine with LoRA on a MoE model (its MoE LoRA
path needs Triton), so MoE adapter refits are planned and checked in-process
(``test_lora_layouts.py``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.vllm.rules import VllmParallel
from mcore_reshard.errors import RefitFailed
from mcore_reshard.layout import load_model_spec
from mcore_reshard.layout.lora import PeftConfig, adapter_tensors, adapters_only, is_adapter_tensor
from mcore_reshard.settings.policy import RefitConfig
from mcore_reshard.wire.faults import Fault, Faults, TrainerFault

pytestmark = pytest.mark.slow

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300]
PEFT = PeftConfig(enabled=True, dim=4, alpha=12.0, max_lora_rank=8, max_loras=2)  # scaling 3.0


def _logprobs(llm, lora=None) -> list[float]:
    """Prompt logprobs of TOKENS (``lora``: a ``LoRARequest``), as floats."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": TOKENS}], params, use_tqdm=False, lora_request=lora)[0]
    return [float(lp[t].logprob) for t, lp in zip(TOKENS[1:], out.prompt_logprobs[1:])]


def _enqueued(llm, lora) -> list[float]:
    """The same through ``enqueue`` + ``wait_for_completion`` (the engine's queue, another client)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    llm.enqueue([{"prompt_token_ids": TOKENS}], params, use_tqdm=False, lora_request=lora)
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(out=llm.wait_for_completion(use_tqdm=False)), daemon=True)
    waiter.start()
    waiter.join(60)
    assert "out" in got, "an enqueued adapter request did not complete"
    return [float(lp[t].logprob) for t, lp in zip(TOKENS[1:], got["out"][0].prompt_logprobs[1:])]


@pytest.fixture(scope="module")
def job(ckpt_cache, engine_cache):
    """The LoRA policy, a TP2 ``LLM`` engine (``engines[0]``: ``generate``, ``enqueue``; from the
    session's cache: test_trainer_api's LoRA case then refits it in a session of its own) and a
    TP1 ``AsyncLLM`` engine (``engines[1]``: the async client path), refit together."""
    from mcore_reshard.adapters.vllm.engine import start_async_engine, stop_engine
    from mcore_reshard.jobs.refit import local_cluster, policy_engine_args

    ckpt = ckpt_cache.get(family="qwen3", dtype="bfloat16")
    spec = load_model_spec(ckpt, dtype="bfloat16")
    engines = [engine_cache.get(ckpt, tp=2, dtype="bfloat16", engine_args=policy_engine_args(PEFT))]
    try:
        engines.append(start_async_engine(str(ckpt), tp=1, dtype="bfloat16",
                                          weight_transfer_config={"backend": "mcore_reshard"},
                                          **policy_engine_args(PEFT)))
        with local_cluster(spec, ckpt, MegatronParallel(tp=2), VllmParallel(tp=2),
                           RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0), train={"lr": 0.05}, engines=engines,
                           peft=PEFT) as c:
            yield c
    finally:
        for llm in engines[1:]:
            stop_engine(llm)
        engine_cache.check(engines[0])


def test_the_first_refit_moves_the_base_and_every_later_one_the_adapter_only(job):
    from mcore_reshard.adapters.vllm.lora_slots import refit_lora_request

    llm, d = job.engines[0], job.driver
    lora = refit_lora_request(PEFT)
    # what every worker's slots hold of the adapter, bf16: the adapter refit's minimum
    adapter_bytes = sum(p.numel - p.padding for p in adapters_only(d.dst).params) * 2
    assert d.adapter_plan.bytes_min == adapter_bytes < d.plan.bytes_min / 10
    m = d.refit()  # base + adapter (B = 0: Bridge's init) into the slot
    assert m.verified and m.at_minimum and m.bytes_moved == m.bytes_min > d.adapter_plan.bytes_min
    base = _logprobs(llm)
    assert _logprobs(llm, lora) == base  # a zero adapter: the base model's outputs
    assert d.plan is d.adapter_plan  # committed: the base is in the engine

    job.pool.train_step([TOKENS, TOKENS[::-1]]).wait()  # the adapters train, the base is frozen
    m = d.refit()
    assert m.verified and m.at_minimum and m.bytes_moved == d.adapter_plan.bytes_min  # the adapter only
    assert _logprobs(llm) == base  # the base model, bit for bit untouched
    adapted = _logprobs(llm, lora)
    assert adapted != base
    train = job.pool.logprobs([TOKENS]).wait()[0][0]
    assert max(abs(a - b) for a, b in zip(adapted, train)) < 0.05  # the trained policy (bf16 on both sides)
    assert _enqueued(llm, lora) == adapted  # every client path serves the new adapter


def test_a_fresh_engine_loading_the_trained_adapter_from_peft_serves_bit_identical_logprobs(job, tmp_path):
    """The trainer's adapter, gathered and written as an HF PEFT directory, loaded by a new
    engine through a plain ``LoRARequest``: its slots are what the layout says, and it serves
    exactly what the refit engine serves."""
    from vllm.lora.request import LoRARequest

    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
    from mcore_reshard.adapters.vllm.lora_rules import slot_name, vllm_lora_layout
    from mcore_reshard.adapters.vllm.lora_slots import refit_lora_request
    from mcore_reshard.infra.checkpoint import save_peft_adapter
    from mcore_reshard.transport.views import gather_canonical, materialize_local

    d = job.driver
    canon = gather_canonical(d.src.params, d.src.tensors, job.pool.local_tensors().wait(), only=is_adapter_tensor)
    assert set(canon) == set(adapter_tensors(job.spec, PEFT))
    assert not any(t.isnan().any() for t in canon.values())
    save_peft_adapter(tmp_path / "adapter", PEFT.peft_config_json(), canon)
    served = _logprobs(job.engines[0], refit_lora_request(PEFT))
    fresh = start_engine(str(job.checkpoint), tp=2, dtype="bfloat16", enable_lora=True, max_lora_rank=PEFT.engine_rank,
                         max_loras=PEFT.max_loras)
    try:
        base = _logprobs(fresh)
        assert _logprobs(fresh, LoRARequest("trained", 1, str(tmp_path / "adapter"))) == served
        # vLLM's own set_lora put in each worker's slot what the slot layout says, bit for bit
        held = {n: (t.clone().mul_(PEFT.scaling) if n.endswith("lora_B.weight") else t) for n, t in canon.items()}
        dst = vllm_lora_layout(job.spec, VllmParallel(tp=2), PEFT)
        names = [p.name for p in dst.for_rank(0)]
        empty = [slot_name(0, "self_attn.qkv_proj", "lora_b", 0, 1), slot_name(0, "mlp.down_proj", "lora_a", 0, 1)]
        got = fresh.collective_rpc("mr_lora_slots", args=(names + empty,))
        assert len(got) == 2
        for rank in (0, 1):
            for p in dst.for_rank(rank):
                want = materialize_local(p, held)
                assert torch.equal(torch.tensor(got[rank][p.name], dtype=want.dtype), want), (rank, p.name)
            assert all(not any(map(any, got[rank][n])) for n in empty), rank  # the last slot stays empty
        assert _logprobs(fresh) == base  # a request without the adapter: the base model
    finally:
        stop_engine(fresh)


def test_a_failed_adapter_refit_keeps_the_old_adapter_then_deltas_and_overlap_carry_it(job):
    from mcore_reshard.adapters.vllm.lora_slots import refit_lora_request

    (llm, aeng), d = job.engines, job.driver
    lora = refit_lora_request(PEFT)
    assert d.plan is d.adapter_plan
    before, base, async_before = _logprobs(llm, lora), _logprobs(llm), _logprobs(aeng, lora)
    job.pool.train_step([TOKENS]).wait()
    with pytest.raises(RefitFailed, match="checksum"):  # a corrupted adapter box: every worker votes no
        d.refit(faults=Faults(TrainerFault(1, Fault("bitflip", bucket=0))))
    # the old adapter, whole, on every client path: generate, the engine's queue, the async engine
    assert _logprobs(llm, lora) == before and _enqueued(llm, lora) == before
    assert _logprobs(aeng, lora) == async_before
    assert _logprobs(llm) == base

    m = d.refit()  # after a failure: full adapter boxes, on a new group
    assert m.verified and m.at_minimum and not m.delta
    after = _logprobs(llm, lora)
    assert after != before and _logprobs(aeng, lora) != async_before
    job.pool.train_step([TOKENS[::-1]]).wait()
    m = d.refit()  # the same plan, every rank holds the last refit: a delta of the adapter
    assert m.verified and m.at_minimum and m.delta and m.bytes_moved <= d.adapter_plan.bytes_min + m.bytes_headers
    delta_served = _logprobs(llm, lora)
    assert delta_served != after

    job.pool.train_step([TOKENS]).wait()
    pending = d.begin_refit()  # overlapped: the engine serves the old adapter while the new one arrives
    during = _logprobs(llm, lora)
    m = pending.finish()
    assert m.verified and m.overlapped
    assert during == delta_served and _logprobs(llm, lora) != delta_served
    assert _logprobs(llm) == base  # the base model never moved


def test_settings_either_side_cannot_hold_are_refused_in_one_line(job):
    """Before a byte moves: an alpha the engine's adapter was not installed with (its workers
    refuse at init and the first refit votes no with that line), an alpha the training policy
    does not have (its ranks refuse the plan), a rank the policy does not have (the planner),
    and an engine without LoRA slots."""
    from dataclasses import replace

    from mcore_reshard.adapters.vllm.lora_slots import install_refit_adapter
    from mcore_reshard.errors import RefitError
    from mcore_reshard.refit.driver import RefitDriver

    from mcore_reshard.errors import ConfigError, TrainerError

    def refit_with(peft):
        d = RefitDriver(job.pool, job.engines, job.refit, job.spec, peft=peft)
        try:
            d.__enter__()
            d.refit()
        finally:
            d.close()

    with pytest.raises(TrainerError, match=r"in 'set_plan': training rank \d: the plan scales decoder.layers.0.\S+"
                                           r"adapter.linear_out.weight by 6 \(the engine's alpha / r\); this policy has "
                                           r"peft.alpha=12, peft.dim=4$"):
        refit_with(replace(PEFT, alpha=24.0))
    with pytest.raises(ConfigError, match=r"^peft.dim=8: the training ranks hold model.layers.0.self_attn.q_proj.lora_A."
                                          r"weight as \[4, 64\], the settings say \[8, 64\]$"):
        refit_with(replace(PEFT, dim=8))
    with pytest.raises(RefitFailed, match=r"peft.max_lora_rank=16: the engine was started with max_lora_rank=8"):
        refit_with(replace(PEFT, max_lora_rank=16))
    with pytest.raises(RefitError, match="started without enable_lora=True"):
        install_refit_adapter(torch.nn.Linear(2, 2), PEFT, job.spec, VllmParallel(tp=2), 0)
    job.driver.disconnect()  # the job's own driver takes the engine back at its next refit
    assert job.driver.refit().verified


def test_a_restarted_driver_plans_the_installed_adapter_slots_once(job):
    """A new driver (a restarted job) on an engine whose refit adapter is installed: the
    engine's workers describe its slots too, and the plan still holds each slot once (the
    rules'); the new driver's first refit moves base and adapter at the minimum. (Before,
    every slot was planned twice and the refit was refused on every rank.)"""
    from mcore_reshard.jobs.refit import local_cluster

    with local_cluster(job.spec, job.checkpoint, MegatronParallel(tp=2), VllmParallel(tp=2),
                       RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0), train={"lr": 0.05},
                       engines=job.engines[:1], peft=PEFT) as c:
        d = c.driver
        d.make_plan()
        held = [(p.rank, p.name) for p in d.dst.params]
        assert len(held) == len(set(held)) and any("lora_a_stacked" in n for _, n in held)
        m = d.refit()
        assert m.verified and m.at_minimum and m.bytes_moved == m.bytes_min > d.adapter_plan.bytes_min
        assert d.plan is d.adapter_plan


def test_a_moe_policys_expert_adapters_refit_into_fused_moe_slots_as_vllms_own_load(ckpt_cache, tmp_path):
    """A MoE LoRA policy with adapters on every routed expert (megatron TP2 x EP2 x ETP1, Bridge's
    adapters on each local expert's linear_fc1 / fc2) refits a TP2 engine's ``FusedMoEWithLoRA``
    slots: the first refit base + adapter, after a step the adapter only. vLLM 0.32's CPU build
    cannot run a MoE model's forward with LoRA (its MoE LoRA kernel needs Triton), so no request
    runs here; instead vLLM's own loader puts the same trained adapter, exported as PEFT, into the
    engine's other slot, and every slot tensor of every worker -- experts and attention -- equals
    the refit's bit for bit."""
    from vllm.lora.request import LoRARequest

    from mcore_reshard.adapters.vllm.engine import start_engine, stop_engine
    from mcore_reshard.adapters.vllm.lora_rules import vllm_lora_layout
    from mcore_reshard.infra.checkpoint import save_peft_adapter
    from mcore_reshard.jobs.refit import local_cluster
    from mcore_reshard.transport.views import gather_canonical

    ckpt = ckpt_cache.get(moe=True, dtype="bfloat16")
    spec = load_model_spec(ckpt, dtype="bfloat16")
    peft = PeftConfig(enabled=True, dim=4, alpha=12.0, max_lora_rank=8, max_loras=2)  # every module, experts too
    llm = start_engine(str(ckpt), tp=2, dtype="bfloat16", enable_lora=True, max_lora_rank=8, max_loras=2,
                       weight_transfer_config={"backend": "mcore_reshard"})
    try:
        with local_cluster(spec, ckpt, MegatronParallel(tp=2, ep=2, etp=1), VllmParallel(tp=2),
                           RefitConfig(buffer_bytes=1 << 16, timeout_s=60.0), train={"lr": 0.05}, engines=[llm],
                           peft=peft) as c:
            d = c.driver
            assert d.refit().verified and d.plan is d.adapter_plan  # base + adapter
            c.pool.train_step([TOKENS, TOKENS[::-1]]).wait()
            m = d.refit()
            assert m.verified and m.bytes_moved == d.adapter_plan.bytes_min  # the adapter only
            canon = gather_canonical(d.src.params, d.src.tensors, c.pool.local_tensors().wait(), only=is_adapter_tensor)
        experts = [n for n in canon if ".mlp.experts." in n]
        assert experts and len(experts) == 2 * 3 * spec.num_experts * len(spec.moe_layers)
        save_peft_adapter(tmp_path / "trained", peft.peft_config_json(), canon)
        assert llm.llm_engine.add_lora(LoRARequest("trained", 2, str(tmp_path / "trained")))  # slot 1, vLLM's own
        mine = [p.name for p in vllm_lora_layout(spec, VllmParallel(tp=2), peft).for_rank(0)]
        theirs = [n.replace(".slot0", ".slot1") for n in mine]
        got = llm.collective_rpc("mr_lora_slots", args=(mine + theirs,))
        for rank in (0, 1):
            for a, b in zip(mine, theirs):
                held = torch.tensor(got[rank][a])
                assert held.abs().sum() > 0 and torch.equal(held, torch.tensor(got[rank][b])), (rank, a)
    finally:
        stop_engine(llm)
