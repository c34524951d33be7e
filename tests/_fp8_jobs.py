"""FP8 rollout with real trainers: megatron-core ranks (bf16 ``Float16Module``, DDP, the
distributed optimizer) take an optimizer step, then refit into block-FP8 destination ranks,
quantizing at the sender. The destination ranks are plain processes holding the FP8 engine's
layout (codes and scales): what a vLLM FP8 worker receives before it packs the codes."""

from __future__ import annotations

from typing import Any

import torch

from mcore_reshard.adapters.megatron.build import init_megatron
from mcore_reshard.adapters.megatron.endpoint import TrainerEndpoint
from mcore_reshard.adapters.megatron.rules import MegatronParallel
from mcore_reshard.adapters.megatron.train import TrainSettings, build_policy
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import load_canonical
from mcore_reshard.layout import SideLayout, load_model_spec
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.wire import slice_to_wire
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.protocol import JoinInfo, RankMap, RankReport, RefitRequest, VerifyMode
from mcore_reshard.testing.worlds import WorldCtx
from mcore_reshard.transport.participant import IN_PLACE, RefitEndpoint
from mcore_reshard.transport.executor import TensorSink
from mcore_reshard.transport.views import TORCH_DTYPES


def fp8_trainer_job(ctx: WorldCtx, ckpt: str, par: MegatronParallel, vllm: VllmParallel, tokens: list[int],
                    outboxes: list, refits: int) -> dict:
    """Load, step, refit ``refits`` times into ``vllm`` (an FP8 layout); return this rank's
    weights (the truth the destinations are checked against), reports and the plan's bytes."""
    import torch.distributed as dist

    spec = load_model_spec(ckpt, dtype="bfloat16")
    init_megatron(par, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port)
    policy = build_policy(spec, par, TrainSettings(dtype="bfloat16", lr=1e-3))
    policy.load_canonical(load_canonical(ckpt))
    policy.train_step([tokens])
    ep = TrainerEndpoint(policy.chunks, spec, sync_params=policy.sync_params)
    mine = ep.describe()
    every: list = [None] * ctx.world_size
    dist.all_gather_object(every, mine)
    src = SideLayout("megatron", ctx.world_size, tuple(p for r in every for p in r), spec.tensor_table())
    dst = vllm_layout(spec, vllm)
    plan = build_plan(src, dst, bucket_bytes=1 << 16)
    boxed = [free_port() if ctx.rank == 0 else None]
    dist.broadcast_object_list(boxed, src=0)
    rank_map = RankMap.disaggregated(src.world_size, dst.world_size)
    info = JoinInfo("127.0.0.1", boxed[0], rank_map.world_size, rank_map, 60.0, secret="fp8-test")
    requests = [RefitRequest(plan.digest(), timeout_s=60.0, verify=VerifyMode.CHECKSUM, epoch=i + 1)
                for i in range(refits)]
    if ctx.rank == 0:
        for r, box in enumerate(outboxes):
            box.put({"join": info.to_wire(), "digest": plan.digest(), "slice": slice_to_wire(plan.for_rank("dst", r)),
                     "requests": [q.to_wire() for q in requests]})
    ep.join(info)
    ep.set_plan(slice_to_wire(plan.for_rank("src", ctx.rank)), plan.digest())
    reports, errors = [], []
    for request in requests:
        try:
            reports.append(ep.refit(request).to_wire())
        except Exception as exc:  # noqa: BLE001 - the test asserts on it (only the last refit may fail)
            errors.append(str(exc).splitlines()[0])
    policy.sync_params()
    weights = {name: t.detach().clone() for name, t in policy.local_params().items()}
    ep.leave()
    return {"weights": weights, "descs": mine, "reports": reports, "errors": errors, "bytes_min": plan.bytes_min,
            "quantize": plan.for_rank("src", ctx.rank).quantize}


class _FlipScale(TensorSink):
    """A destination whose held scale of ``target`` was changed before the refit (a wrong
    baseline for a delta: the checksum of the whole box must catch it)."""

    def __init__(self, tensors: dict, target: str) -> None:
        super().__init__(tensors)
        tensors[target].view(-1)[0] *= 2.0


def fp8_destination_main(rank: int, world: int, inbox: Any, q: Any, layout: SideLayout, flip: str) -> None:
    """One destination rank: receive every refit into FP8-layout tensors (zero before the first);
    before the last one, one scale of ``flip`` (when set) is changed where it is held."""
    out: dict[str, Any] = {"outcomes": [], "stats": []}
    try:
        torch.set_num_threads(1)
        msg = inbox.get(timeout=600)
        ep = RefitEndpoint("dst", rank)
        ep.join(JoinInfo.from_wire(msg["join"]))
        ep.set_plan(msg["slice"], msg["digest"])
        requests = [RefitRequest.from_wire(r) for r in msg["requests"]]
        for i, request in enumerate(requests):
            if i == 0:  # later refits start from what the last one left (a delta rebuilds boxes from it)
                tensors = {p.name: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for p in layout.for_rank(rank)}
            last = i == len(requests) - 1
            sink = _FlipScale(tensors, flip) if (flip and last) else TensorSink(tensors)
            outcome, report = ep.refit(request, {}, sink, IN_PLACE)
            out["outcomes"].append((outcome.commit, outcome.errors))
            out["stats"].append(None if report is None else RankReport.to_wire(report))
            if i == 0:  # as bytes: a queued tensor's shared memory dies with this process
                out["tensors"] = {n: (str(t.dtype).replace("torch.", ""), tuple(t.shape),
                                      t.contiguous().view(torch.uint8).numpy().tobytes()) for n, t in tensors.items()}
        ep.leave()
    except BaseException:  # noqa: BLE001
        import traceback

        out["crash"] = traceback.format_exc()
    q.put((rank, out))
