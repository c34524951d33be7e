"""LoRA, an MTP draft and delta refits through vLLM's trainer-side API only: megatron-core
ranks call ``WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(...))`` and
``send_weights()``; the engine is an ``LLM`` in this process, driven by vLLM's own calls
(``_trainer_api_jobs.ForwardingClient``). Both entry points plan with one function
(``plan.refit_plans.plan_refit``). FP8: its plan and refusals are checked here without an
engine; a live FP8 engine through this API is ``test_fp8_live.py`` (CPUs with AMX tiles).
"""

from __future__ import annotations

from typing import Any

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.layout.lora import PeftConfig

pytestmark = pytest.mark.slow  # the engine cases start engines; the rest import vLLM (the backend)

TOKENS = [11, 42, 7, 99, 123, 5, 77, 300, 8, 64]
PEFT = PeftConfig(enabled=True, dim=4, alpha=12.0, max_lora_rank=8, max_loras=2)


def _logprobs(llm, lora=None) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": TOKENS}], params, use_tqdm=False, lora_request=lora)[0]
    return [float(lp[t].logprob) for t, lp in zip(TOKENS[1:], out.prompt_logprobs[1:])]


def _drive(llm, world: int, args: tuple, probe) -> tuple[list, list]:
    """Run the trainers (``trainer_api_job``, ``args`` less its queues) while this thread runs
    each vLLM call they send on ``llm`` (``support.live.drive_trainer_api``)."""
    from _trainer_api_jobs import trainer_api_job
    from mcore_reshard.testing.trainer_api import drive_trainer_api
    from support.megatron import run_world

    return drive_trainer_api(llm, lambda queues: run_world(trainer_api_job, world, args[:-1] + queues + args[-1:],
                                                           timeout_s=600), probe)


def _moved(reports: list) -> tuple[int, int, bool, bool]:
    """(bytes received, bytes of a full refit, all verified, all destinations sent a delta)."""
    dst = [r for r in reports if r[0] == "dst"]
    return sum(r[3] for r in dst), sum(r[4] for r in dst), all(r[2] for r in reports), all(r[5] for r in dst)


def test_delta_refits_through_the_trainer_api_move_what_changed(ckpt_cache, shared_engine):
    """The session's fp32 tiny MoE engine (TP1) from megatron TP2xEP2: the first
    ``send_weights`` is full at the plan's minimum, the second (after a training step) a
    delta, reported by every destination, and the engine serves what megatron computes. The
    canary is on (``init_info.canary``): each refit's engine checked its forward against the
    reference the trainers computed inside the refit."""
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs
    from mcore_reshard.refit.verify import token_mult_prob_error

    ckpt = ckpt_cache.get(moe=True, seed=7)
    llm = shared_engine(ckpt, tp=1)
    info = {"engine_tp": 1, "timeout_s": 60.0, "delta": "auto", "bucket_bytes": 1 << 16, "canary": True}
    ranks, served = _drive(llm, 2, (str(ckpt), "float32", MegatronParallel(tp=2, ep=2, etp=1), info, [TOKENS], 2,
                                    {}), lambda step: prompt_logprobs(llm, TOKENS))
    rank0 = ranks[0]
    assert ranks[1]["reports"] == rank0["reports"]  # every rank read the same vote
    (full_bytes, full, ok0, delta0), (delta_bytes, full1, ok1, delta1) = map(_moved, rank0["reports"])
    assert ok0 and ok1 and full == full1 == full_bytes == rank0["bytes_min"]
    assert not delta0 and delta1 and 0 < delta_bytes <= rank0["bytes_min"]
    assert all(r[6] for rs in rank0["reports"] for r in rs if r[0] == "dst")  # every engine rank ran the canary
    for trainer, engine in zip(rank0["trainer"], served):
        assert token_mult_prob_error(engine, trainer) < 1.001
    assert token_mult_prob_error(served[1], served[0]) > 1.001  # the step reached the engine


def test_a_lora_policy_moves_base_and_adapter_first_then_the_adapter_only(ckpt_cache, shared_engine):
    """A megatron TP2 bf16 LoRA policy into a TP2 bf16 engine with LoRA slots
    (``peft=``): the first ``send_weights`` moves base and adapter (B = 0: the adapter serves
    the base model), every later one the adapter only, at the adapter plan's minimum; the
    base stays bit for bit and the adapter serves the trained policy."""
    from mcore_reshard.adapters.vllm.lora_slots import refit_lora_request
    from mcore_reshard.jobs.refit import policy_engine_args

    ckpt = ckpt_cache.get(family="qwen3", dtype="bfloat16")
    # test_lora_refit's engine (cached): its refit adapter is installed already, by that module's drivers
    llm = shared_engine(ckpt, tp=2, dtype="bfloat16", engine_args=policy_engine_args(PEFT))
    lora = refit_lora_request(PEFT)
    info = {"engine_tp": 2, "timeout_s": 60.0, "peft": PEFT.to_wire(), "bucket_bytes": 1 << 16}
    ranks, served = _drive(llm, 2, (str(ckpt), "bfloat16", MegatronParallel(tp=2), info,
                                    [TOKENS, TOKENS[::-1]], 2, {}),
                           lambda step: (_logprobs(llm), _logprobs(llm, lora)))
    rank0 = ranks[0]
    assert rank0["plans"] == [rank0["bytes_min"], rank0["adapter_bytes_min"]]
    assert rank0["adapter_bytes_min"] < rank0["bytes_min"] / 10
    moved = [_moved(r) for r in rank0["reports"]]
    assert all(m[2] for m in moved)
    assert moved[0][0] == rank0["bytes_min"] and moved[1][0] == moved[1][1] == rank0["adapter_bytes_min"]
    (base, adapted0), (base1, adapted) = served
    assert adapted0 == base  # a zero adapter: the base model
    assert base1 == base  # the base, bit for bit untouched by the adapter refit
    assert adapted != base
    assert max(abs(a - b) for a, b in zip(adapted, rank0["trainer"][1])) < 0.05  # bf16 on both sides


def test_an_mtp_draft_moves_with_the_target_in_one_vote(ckpt_cache, shared_engine):
    """A DeepSeek-V3 policy with megatron's MTP block into an engine drafting with the MTP
    layers (``engine_speculative_config``): every draft tensor is in the one plan, every rank
    of both sides verifies it at the plan's minimum, and the engine serves what megatron
    computes. The canary is on: every engine rank checked the target and the draft (the
    endpoint's ``canary_draft``: megatron's MTP head) inside the vote."""
    from mcore_reshard.adapters.vllm.engine import prompt_logprobs
    from mcore_reshard.layout import load_model_spec
    from mcore_reshard.layout.mtp import draft_tensors
    from mcore_reshard.refit.verify import token_mult_prob_error

    from test_mtp_vllm import MTP_ENGINE

    speculative = MTP_ENGINE["speculative_config"]
    ckpt = ckpt_cache.get(family="deepseek_v3", dtype="float32", overrides={"num_nextn_predict_layers": 1})
    llm = shared_engine(ckpt, tp=1, dtype="float32", engine_args=MTP_ENGINE)  # test_mtp_vllm's, cached
    before = prompt_logprobs(llm, TOKENS)
    info = {"engine_tp": 1, "timeout_s": 60.0, "engine_speculative_config": speculative, "canary": True}
    ranks, served = _drive(llm, 1, (str(ckpt), "float32", MegatronParallel(tp=1), info, [TOKENS], 1,
                                    {"mtp": True, "train_first": True, "lr": 0.01}),
                           lambda step: prompt_logprobs(llm, TOKENS))
    rank0 = ranks[0]
    assert set(draft_tensors(load_model_spec(ckpt, dtype="float32"))) <= set(rank0["planned"])
    received, full, verified, _ = _moved(rank0["reports"][0])
    assert verified and received == full == rank0["bytes_min"]
    assert all(r[6] for r in rank0["reports"][0] if r[0] == "dst")  # the canary (target and draft) ran
    assert token_mult_prob_error(served[0], rank0["trainer"][0]) < 1.001
    assert token_mult_prob_error(before, served[0]) > 1.001


# --------------------------------------------------------------------------- FP8, no engine


def _fp8_sides():
    from mcore_reshard.adapters.megatron.rules import megatron_layout
    from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
    from mcore_reshard.infra.checkpoint import TINY_MOE_128
    from mcore_reshard.layout.spec import spec_from_hf_config

    spec = spec_from_hf_config(TINY_MOE_128, dtype="bfloat16")
    src = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    return spec, src, vllm_layout(spec, VllmParallel(tp=2, quantization="fp8_per_block"))


def test_an_fp8_engine_is_planned_as_the_driver_plans_it_quantized_at_the_senders():
    """``engine_quantization="fp8_per_block"``: the trainer API's planning (``plan_refit``)
    quantizes at the senders, at the FP8 minimum: the same plan ``get_plan`` gives."""
    from mcore_reshard.plan import get_plan, plan_report
    from mcore_reshard.plan.refit_plans import plan_refit

    spec, src, dst = _fp8_sides()
    plans = plan_refit(src, dst, spec, spec, bucket_bytes=1 << 20)
    plan = plans.plan
    assert plans.adapter_plan is None and plan.digest() == get_plan(src, dst, bucket_bytes=1 << 20).digest()
    assert plan.dtype == "float8_e4m3fn" and plan.quantized and plan.quantized_at_receiver == ()
    rep = plan_report(plan)
    assert plan.bytes_planned == plan.bytes_min and rep.quantized_bytes / rep.quantized_bytes_unquantized <= 0.52


@pytest.mark.parametrize("info, line", [
    ({"engine_quantization": "fp8"}, "engine_quantization='fp8' is not one of"),
    ({"engine_quantization": "fp8_per_block", "peft": PEFT.to_wire()}, "init_info.peft with engine_quantization=fp8_per_block"),
    ({"engine_speculative_config": {"method": "eagle"}}, "engine_speculative_config.method='eagle'"),
    ({"engine_speculative_config": {"method": "mtp"}}, "has no MTP layers"),
    ({"canary": True}, "init_info.canary: this rank's endpoint has no policy"),
])
def test_combinations_the_sides_cannot_hold_are_refused_in_one_line(info: dict, line: str):
    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo
    from mcore_reshard.adapters.vllm.backend.trainer import check_features
    from mcore_reshard.errors import ConfigError

    spec, src, _ = _fp8_sides()
    with pytest.raises(ConfigError) as exc:
        check_features(ReshardTrainerInitInfo(rank=0, **info), spec, src, canary_source=False)
    assert line in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_canary_into_a_drafting_engine_needs_the_mtp_head():
    from mcore_reshard.adapters.vllm.backend import ReshardTrainerInitInfo
    from mcore_reshard.adapters.vllm.backend.trainer import check_features
    from mcore_reshard.errors import ConfigError

    spec, src, _ = _fp8_sides()
    info = ReshardTrainerInitInfo(rank=0, canary=True, engine_speculative_config={"method": "mtp"})
    with pytest.raises(ConfigError, match=r"^init_info.canary with engine_speculative_config: .*canary_draft="):
        check_features(info, spec, src, canary_draft_source=False)
