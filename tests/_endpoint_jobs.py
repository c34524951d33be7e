"""A framework's own trainer processes, as a test starts them: megatron-core ranks built with
the production stack, each creating a ``TrainerEndpoint`` itself, planning against the vLLM
rules, and handing the engine's init info and the refit request to the test process (which
plays the framework's controller and drives a plain ``vllm.LLM``)."""

from __future__ import annotations

from typing import Any

from mcore_reshard.adapters.megatron.build import init_megatron
from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.adapters.megatron.endpoint import TrainerEndpoint
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import load_canonical
from mcore_reshard.layout import SideLayout, load_model_spec
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.wire import slice_to_wire
from mcore_reshard.training.ranks import RankCall, TrainerRank
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.protocol import JoinInfo, RankMap, RefitRequest


def endpoint_refit_job(ctx: WorldCtx, ckpt: str, dtype: str, par: MegatronParallel, vllm: VllmParallel,
                       tokens: list[int], to_controller: Any) -> dict:
    import torch.distributed as dist

    spec = load_model_spec(ckpt, dtype=dtype)
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    policy = build_policy(spec, par, TrainSettings(dtype=dtype, lr=0.05))
    policy.load_canonical(load_canonical(ckpt))
    loss = policy.train_step([tokens])  # the trainer's weights now differ from the engine's checkpoint

    ep = TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params)
    mine = ep.describe()
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    src = SideLayout("megatron", ctx.world_size, tuple(p for r in every for p in r), spec.tensor_table())
    dst = vllm_layout(spec, vllm)  # a plain engine: its layout from the rules (it checks its slice itself)
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    digest = plan.digest()
    boxed = [free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(boxed, src=0)
    rank_map = RankMap.disaggregated(src.world_size, dst.world_size)
    info = JoinInfo("127.0.0.1", boxed[0], rank_map.world_size, rank_map, 60.0, secret="test-secret")
    request = RefitRequest(digest, timeout_s=60.0)
    if ctx.rank == 0:
        to_controller.put({"init_info": {"join": info.to_wire(), "plan_digest": digest,
                                         "slices": {str(r): slice_to_wire(plan.for_rank("dst", r))
                                                    for r in range(dst.world_size)}},
                           "update_info": {"request": request.to_wire()}})
    # the refit calls through the ``TrainerRank`` a framework's actor holds (the short form's
    # ``call.run(rank)``); a rank around a framework's endpoint refuses the policy's training calls
    rank = TrainerRank(ep)
    RankCall("join", (info,)).run(rank)
    RankCall("set_plan", (slice_to_wire(plan.for_rank("src", ctx.rank)), digest)).run(rank)
    reply = RankCall("refit", (request,)).run(rank)
    report = reply.report
    assert reply.reports == (tuple(ep.last_reports) if ctx.rank == 0 else ()), reply
    try:
        RankCall("train_step", (((1, 2),),)).run(rank)
        raise AssertionError("a framework's rank ran a training call")
    except TypeError as exc:
        assert "answers refit calls only" in str(exc) and "'train_step'" in str(exc), exc
    logprobs = policy.logprobs([tokens])[0]
    RankCall("leave").run(rank)
    return {"loss": loss, "report": report.to_wire(), "reports": [r.to_wire() if r else None for r in ep.last_reports],
            "logprobs": logprobs, "bytes_min": plan.bytes_min}
